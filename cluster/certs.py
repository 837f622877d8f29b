"""The cluster's certificates and keys, made at each start with ``cryptography``.

A CA; the apiserver's serving certificate (the bridge's host address, the ``kubernetes``
Service's ClusterIP and the ``kubernetes.default.svc`` names); client certificates for the
admin and each component; the service-account signing key pair. ECDSA P-256 throughout:
quick to generate and accepted by every Kubernetes component.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=365)
"""Certificates outlive any cluster run; they are made anew at each start."""


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its key on disk."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class ClientIdentity:
    """A client certificate's user (CN) and groups (O)."""

    name: str
    user: str
    groups: tuple[str, ...] = ()


@dataclass(frozen=True)
class Pki:
    """Paths of everything ``generate_pki`` wrote."""

    ca: KeyPair
    apiserver: KeyPair
    clients: dict[str, KeyPair]
    service_account_key: Path
    service_account_pub: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    """Signing only (ECDSA keys do not encipher); a CA also signs certificates and CRLs."""
    return x509.KeyUsage(
        digital_signature=True,
        key_cert_sign=ca,
        crl_sign=ca,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        encipher_only=False,
        decipher_only=False,
    )


def _name(cn: str, orgs: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    return x509.Name([*attrs, x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _builder(
    subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey, *, ca: bool
) -> x509.CertificateBuilder:
    """A certificate for ``key``, valid from five minutes ago, with the basic constraints and
    key usage of a CA (``ca``) or of a leaf."""
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(_key_usage(ca=ca), critical=True)
    )


def generate_pki(
    directory: Path,
    *,
    host_address: ipaddress.IPv4Address,
    service_ip: ipaddress.IPv4Address,
    clients: list[ClientIdentity],
) -> Pki:
    """Write a fresh CA, serving and client certificates and the service-account keys to ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    ca_name = _name("conveyor-cluster-ca")
    ca_cert = (
        _builder(ca_name, ca_name, ca_key, ca=True)
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca = KeyPair(directory / "ca.crt", directory / "ca.key")
    _write_cert(ca.cert, ca_cert)
    _write_key(ca.key, ca_key)

    def leaf(
        name: str,
        subject: x509.Name,
        usage: list[x509.ObjectIdentifier],
        sans: list[x509.GeneralName],
    ) -> KeyPair:
        key = _key()
        builder = (
            _builder(subject, ca_name, key, ca=False)
            .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                critical=False,
            )
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        pair = KeyPair(directory / f"{name}.crt", directory / f"{name}.key")
        _write_cert(pair.cert, builder.sign(ca_key, hashes.SHA256()))
        _write_key(pair.key, key)
        return pair

    dns = [
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
        "localhost",
    ]
    ips = [host_address, service_ip, ipaddress.IPv4Address("127.0.0.1")]
    apiserver = leaf(
        "apiserver",
        _name("kube-apiserver"),
        [ExtendedKeyUsageOID.SERVER_AUTH],
        [x509.DNSName(d) for d in dns] + [x509.IPAddress(i) for i in ips],
    )
    client_pairs = {
        c.name: leaf(
            f"client-{c.name}", _name(c.user, c.groups), [ExtendedKeyUsageOID.CLIENT_AUTH], []
        )
        for c in clients
    }

    sa_key = _key()
    sa = directory / "service-account.key"
    sa_pub = directory / "service-account.pub"
    _write_key(sa, sa_key)
    sa_pub.write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return Pki(ca, apiserver, client_pairs, sa, sa_pub)
