"""Unit tests of the control plane's command lines (pure: no process, port or file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.cluster.certs import KeyPair, Pki
from conveyor.cluster.control_plane import (
    ControlPlaneInputs,
    Ports,
    apiserver_args,
    controller_manager_args,
    etcd_args,
    etcd_client_url,
    kube_proxy_args,
    kube_proxy_config,
    scheduler_args,
)
from conveyor.cluster.kubeconfigs import CLIENTS

WORK = Path("/work/clusters/test")
HOST = "198.18.0.1"
PORTS = Ports(
    etcd=2379,
    etcd_peer=2380,
    apiserver=6443,
    controller_manager=10257,
    scheduler=10259,
    proxy_healthz=10256,
    proxy_metrics=10249,
    dns_health=18080,
    dns_ready=18181,
)


def _pair(name: str) -> KeyPair:
    return KeyPair(WORK / "pki" / f"{name}.crt", WORK / "pki" / f"{name}.key")


@pytest.fixture
def inputs() -> ControlPlaneInputs:
    pki = Pki(
        ca=_pair("ca"),
        apiserver=_pair("apiserver"),
        clients={c.name: _pair(c.name) for c in CLIENTS},
        service_account_key=WORK / "pki" / "sa.key",
        service_account_pub=WORK / "pki" / "sa.pub",
    )
    kubeconfigs = {
        name: WORK / "config" / f"{name}.kubeconfig"
        for name in ("controller-manager", "scheduler", "kube-proxy")
    }
    return ControlPlaneInputs(
        work_dir=WORK,
        host=HOST,
        ports=PORTS,
        pki=pki,
        kubeconfigs=kubeconfigs,
        pod_cidr="198.18.0.0/20",
        service_cidr="198.19.0.0/20",
        log_level=2,
    )


def _flags(argv: list[str]) -> dict[str, str]:
    """``--name=value`` -> {name: value}; every argument must be of that form, each name once."""
    out: dict[str, str] = {}
    for arg in argv:
        assert arg.startswith("--"), arg
        name, _, value = arg[2:].partition("=")
        assert name not in out, f"--{name} given twice"
        out[name] = value
    return out


def test_etcd_listens_on_loopback_and_keeps_no_data(inputs: ControlPlaneInputs) -> None:
    flags = _flags(etcd_args(inputs))
    assert etcd_client_url(PORTS) == "http://127.0.0.1:2379"
    assert flags["listen-client-urls"] == flags["advertise-client-urls"] == "http://127.0.0.1:2379"
    assert flags["listen-peer-urls"] == "http://127.0.0.1:2380"
    assert flags["initial-cluster"] == "conveyor=http://127.0.0.1:2380"
    assert flags["data-dir"] == str(WORK / "etcd")
    assert "unsafe-no-fsync" in flags


def test_apiserver_serves_on_the_host_address_with_its_certificates(
    inputs: ControlPlaneInputs,
) -> None:
    flags = _flags(apiserver_args(inputs))
    assert flags["etcd-servers"] == "http://127.0.0.1:2379"
    assert flags["bind-address"] == flags["advertise-address"] == HOST
    assert flags["secure-port"] == "6443"
    assert flags["tls-cert-file"] == str(WORK / "pki" / "apiserver.crt")
    assert flags["tls-private-key-file"] == str(WORK / "pki" / "apiserver.key")
    assert (
        flags["client-ca-file"]
        == flags["requestheader-client-ca-file"]
        == str(WORK / "pki" / "ca.crt")
    )
    assert flags["kubelet-client-certificate"] == str(WORK / "pki" / "apiserver-kubelet.crt")
    assert flags["proxy-client-cert-file"] == str(WORK / "pki" / "front-proxy.crt")
    assert flags["requestheader-allowed-names"] == "front-proxy-client"
    assert flags["authorization-mode"] == "Node,RBAC"
    assert flags["enable-admission-plugins"] == "NodeRestriction,ExtendedResourceToleration"
    assert flags["kubelet-preferred-address-types"].startswith("InternalIP")
    assert flags["service-cluster-ip-range"] == "198.19.0.0/20"
    assert flags["service-account-key-file"] == str(WORK / "pki" / "sa.pub")
    assert flags["service-account-signing-key-file"] == str(WORK / "pki" / "sa.key")
    assert flags["v"] == "2"


def test_controller_manager_and_scheduler_use_their_own_kubeconfigs_on_loopback(
    inputs: ControlPlaneInputs,
) -> None:
    cm = _flags(controller_manager_args(inputs))
    own = str(WORK / "config" / "controller-manager.kubeconfig")
    assert cm["kubeconfig"] == cm["authentication-kubeconfig"] == cm["authorization-kubeconfig"]
    assert cm["kubeconfig"] == own
    assert cm["bind-address"] == "127.0.0.1"
    assert cm["secure-port"] == "10257"
    assert cm["service-account-private-key-file"] == str(WORK / "pki" / "sa.key")
    assert cm["cluster-signing-cert-file"] == cm["root-ca-file"] == str(WORK / "pki" / "ca.crt")
    assert cm["cluster-signing-key-file"] == str(WORK / "pki" / "ca.key")
    assert cm["leader-elect"] == "false"

    sched = _flags(scheduler_args(inputs))
    assert sched["kubeconfig"] == str(WORK / "config" / "scheduler.kubeconfig")
    assert sched["bind-address"] == "127.0.0.1"
    assert sched["secure-port"] == "10259"
    assert sched["cert-dir"] == str(WORK / "scheduler")


def test_kube_proxy_config_routes_the_pod_network_in_nftables_mode(
    inputs: ControlPlaneInputs,
) -> None:
    config = kube_proxy_config(inputs, node="cpu-node-0")
    assert config["kind"] == "KubeProxyConfiguration"
    assert config["mode"] == "nftables"
    assert config["hostnameOverride"] == "cpu-node-0"
    assert config["clientConnection"]["kubeconfig"] == str(
        WORK / "config" / "kube-proxy.kubeconfig"
    )
    assert config["bindAddress"] == HOST
    assert config["healthzBindAddress"] == "127.0.0.1:10256"
    assert config["metricsBindAddress"] == "127.0.0.1:10249"
    assert config["clusterCIDR"] == "198.18.0.0/20"
    assert config["nodePortAddresses"] == [f"{HOST}/32"]
    assert config["conntrack"]["maxPerCore"] == 0
    path = WORK / "config" / "kube-proxy.yaml"
    assert kube_proxy_args(inputs, path) == [f"--config={path}", "--v=2"]
