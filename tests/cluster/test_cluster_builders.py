"""Unit tests of the cluster's pure parts: certificates, nodes, network plan, kubeconfig."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from conveyor.cluster.api import credentials_from_kubeconfig, kubeconfig, write_kubeconfig
from conveyor.cluster.certs import ClientIdentity, generate_pki
from conveyor.cluster.network import NetworkPlan, forward_ruleset
from conveyor.cluster.nodes import (
    GPU_RESOURCE,
    MachineShare,
    node_names,
    node_ready,
)
from conveyor.cluster.settings import ClusterSettings

HOST = ipaddress.IPv4Address("198.18.0.1")
SERVICE = ipaddress.IPv4Address("198.19.0.1")


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_pki_serving_certificate_names_the_bridge_address_and_service_names(tmp_path: Path) -> None:
    pki = generate_pki(
        tmp_path,
        host_address=HOST,
        service_ip=SERVICE,
        clients=[ClientIdentity("admin", "conveyor-admin", ("system:masters",))],
    )
    ca = _cert(pki.ca.cert)
    serving = _cert(pki.apiserver.cert)
    serving.verify_directly_issued_by(ca)
    sans = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {HOST, SERVICE} <= set(sans.get_values_for_type(x509.IPAddress))
    assert "kubernetes.default.svc" in sans.get_values_for_type(x509.DNSName)
    usage = serving.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in usage
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_pki_client_certificates_carry_user_and_groups(tmp_path: Path) -> None:
    pki = generate_pki(
        tmp_path,
        host_address=HOST,
        service_ip=SERVICE,
        clients=[
            ClientIdentity("admin", "conveyor-admin", ("system:masters",)),
            ClientIdentity("proxy", "system:kube-proxy"),
        ],
    )
    admin = _cert(pki.clients["admin"].cert)
    admin.verify_directly_issued_by(_cert(pki.ca.cert))
    assert admin.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "conveyor-admin"
    assert (
        admin.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "system:masters"
    )
    proxy = _cert(pki.clients["proxy"].cert)
    assert not proxy.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
    for key in (pki.ca.key, pki.clients["admin"].key, pki.service_account_key):
        assert key.stat().st_mode & 0o077 == 0, f"{key} is readable by others"
    assert b"PUBLIC KEY" in pki.service_account_pub.read_bytes()


def test_machine_share_never_exceeds_the_machine() -> None:
    one = MachineShare.of_this_machine(1)
    three = MachineShare.of_this_machine(3)
    assert 3 * three.cpu_millis <= one.cpu_millis
    assert 3 * three.memory_bytes <= one.memory_bytes
    assert three.cpu_millis > 0


def test_node_names_follow_the_settings() -> None:
    assert node_names(2, 1) == (["gpu-node-0", "gpu-node-1"], ["cpu-node-0"])


def test_a_node_is_ready_once_ready_and_without_not_ready_taints() -> None:
    def node(ready: str, taints: list[str]) -> dict:
        return {
            "status": {"conditions": [{"type": "Ready", "status": ready}]},
            "spec": {"taints": [{"key": k, "effect": "NoSchedule"} for k in taints]},
        }

    assert node_ready(node("True", [GPU_RESOURCE]))
    assert not node_ready(node("False", []))
    assert not node_ready(node("True", ["node.kubernetes.io/not-ready"]))
    assert not node_ready({"status": {}, "spec": {}})


def test_network_plan_defaults_and_checks() -> None:
    s = ClusterSettings()
    plan = NetworkPlan.from_strings(s.pod_cidr, s.service_cidr, s.guard_cidr, s.bridge)
    assert plan.host_address == HOST
    assert plan.kubernetes_service_ip == SERVICE
    assert plan.pod_cidr.subnet_of(ipaddress.IPv4Network("198.18.0.0/16"))
    assert plan.service_cidr.subnet_of(ipaddress.IPv4Network("198.19.0.0/16"))
    with pytest.raises(ValueError, match="outside the guarded range"):
        NetworkPlan.from_strings("10.0.0.0/24", s.service_cidr, s.guard_cidr, s.bridge)
    with pytest.raises(ValueError, match="overlaps"):
        NetworkPlan.from_strings("198.18.0.0/20", "198.18.0.0/24", s.guard_cidr, s.bridge)
    with pytest.raises(ValueError, match="15 characters"):
        NetworkPlan.from_strings(
            s.pod_cidr, s.service_cidr, s.guard_cidr, "a-very-long-bridge-name"
        )


def test_forward_ruleset_drops_both_directions_between_bridge_and_elsewhere() -> None:
    text = forward_ruleset("conveyor0")
    assert 'iifname "conveyor0" oifname != "conveyor0" counter drop' in text
    assert 'oifname "conveyor0" iifname != "conveyor0" counter drop' in text
    assert "masquerade" not in text


def test_kubeconfig_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig"
    write_kubeconfig(
        path,
        kubeconfig(
            server="https://198.18.0.1:6443",
            ca=tmp_path / "ca.crt",
            user="admin",
            cert=tmp_path / "a.crt",
            key=tmp_path / "a.key",
        ),
    )
    assert path.stat().st_mode & 0o077 == 0
    creds = credentials_from_kubeconfig(path)
    assert creds.server == "https://198.18.0.1:6443"
    assert creds.ca_file == tmp_path / "ca.crt"
    assert creds.cert_file == tmp_path / "a.crt"
    assert creds.token is None


def test_settings_round_trip_through_the_state_file() -> None:
    s = ClusterSettings(name="x", gpu_nodes=3, tools_dir=Path("/opt/tools"))
    assert ClusterSettings.from_json(s.to_json()) == s
    assert ClusterSettings.from_json({**s.to_json(), "removed_setting": 1}) == s
