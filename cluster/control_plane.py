"""The control plane's command lines: pure functions from the cluster's layout to argv lists.

etcd on loopback with its data thrown away at each start; kube-apiserver on the bridge's host
address (which its certificate names), with RBAC and Node authorization and service-account
signing; kube-controller-manager and kube-scheduler on loopback; kube-proxy in nftables mode
(the nodes' kubelets are ``kubelet_config.py``'s). Nothing here starts a
process, opens a port or writes a file: ``Cluster`` does, with these lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conveyor.cluster.certs import Pki


@dataclass(frozen=True)
class Ports:
    """The control plane's ports, each found free at start."""

    etcd: int
    """etcd's client port, on loopback."""

    etcd_peer: int
    """etcd's peer port, on loopback (one member, but etcd listens anyway)."""

    apiserver: int
    """The apiserver's secure port, on the bridge's host address."""

    controller_manager: int
    """kube-controller-manager's secure port, on loopback."""

    scheduler: int
    """kube-scheduler's secure port, on loopback."""

    proxy_healthz: int
    """kube-proxy's health port, on loopback."""

    proxy_metrics: int
    """kube-proxy's metrics port, on loopback."""

    dns_health: int
    """CoreDNS's ``/health``, on loopback (it answers lookups on the bridge's host address, port 53)."""

    dns_ready: int
    """CoreDNS's ``/ready``, on loopback."""


@dataclass(frozen=True)
class ControlPlaneInputs:
    """Everything the control plane's command lines are made of."""

    work_dir: Path
    """The cluster's work directory (etcd's data, the components' certificate directories)."""

    host: str
    """The bridge's host address, where the apiserver listens."""

    ports: Ports
    pki: Pki
    kubeconfigs: dict[str, Path]
    """Client name (``controller-manager``, ``scheduler``, ``kube-proxy``, ...) -> its
    kubeconfig."""

    pod_cidr: str
    service_cidr: str
    log_level: int
    """``-v`` of the Kubernetes components."""


def etcd_client_url(ports: Ports) -> str:
    """Where etcd serves its clients (the apiserver) and ``/health``."""
    return f"http://127.0.0.1:{ports.etcd}"


def etcd_args(c: ControlPlaneInputs) -> list[str]:
    client = etcd_client_url(c.ports)
    peer = f"http://127.0.0.1:{c.ports.etcd_peer}"
    return [
        "--name=conveyor",
        f"--data-dir={c.work_dir / 'etcd'}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=conveyor={peer}",
        # The data is thrown away at each start: no fsync, far quicker on a busy disk.
        "--unsafe-no-fsync",
        "--log-level=warn",
    ]


def apiserver_args(c: ControlPlaneInputs) -> list[str]:
    pki = c.pki
    kubelet = pki.clients["apiserver-kubelet"]
    front_proxy = pki.clients["front-proxy"]
    return [
        f"--etcd-servers={etcd_client_url(c.ports)}",
        f"--bind-address={c.host}",
        f"--advertise-address={c.host}",
        f"--secure-port={c.ports.apiserver}",
        f"--tls-cert-file={pki.apiserver.cert}",
        f"--tls-private-key-file={pki.apiserver.key}",
        f"--client-ca-file={pki.ca.cert}",
        f"--kubelet-client-certificate={kubelet.cert}",
        f"--kubelet-client-key={kubelet.key}",
        "--authorization-mode=Node,RBAC",
        # Reach the kubelets' API (logs, exec, port-forward) at their InternalIP: the
        # nodes' hostnames resolve nowhere.
        "--kubelet-preferred-address-types=InternalIP,Hostname",
        f"--requestheader-client-ca-file={pki.ca.cert}",
        "--requestheader-allowed-names=front-proxy-client",
        "--requestheader-username-headers=X-Remote-User",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        f"--proxy-client-cert-file={front_proxy.cert}",
        f"--proxy-client-key-file={front_proxy.key}",
        # In addition to the default plugins: NodeRestriction as kubeadm enables it, and
        # ExtendedResourceToleration so that pods requesting nvidia.com/gpu tolerate the
        # GPU nodes' taint, as on managed GPU clusters.
        "--enable-admission-plugins=NodeRestriction,ExtendedResourceToleration",
        f"--service-cluster-ip-range={c.service_cidr}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={pki.service_account_pub}",
        f"--service-account-signing-key-file={pki.service_account_key}",
        "--allow-privileged=true",
        "--profiling=false",
        f"--cert-dir={c.work_dir / 'apiserver'}",
        f"--v={c.log_level}",
    ]


def _controller_args(c: ControlPlaneInputs, component: str, port: int) -> list[str]:
    """What kube-controller-manager and kube-scheduler share: one kubeconfig for the API and
    for delegated authentication and authorization, HTTPS on loopback, their own cert folder."""
    kubeconfig = c.kubeconfigs[component]
    return [
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        f"--secure-port={port}",
        f"--cert-dir={c.work_dir / component}",
    ]


def controller_manager_args(c: ControlPlaneInputs) -> list[str]:
    return [
        *_controller_args(c, "controller-manager", c.ports.controller_manager),
        f"--service-account-private-key-file={c.pki.service_account_key}",
        f"--root-ca-file={c.pki.ca.cert}",
        "--use-service-account-credentials=true",
        f"--cluster-signing-cert-file={c.pki.ca.cert}",
        f"--cluster-signing-key-file={c.pki.ca.key}",
        "--leader-elect=false",
        "--controllers=*",
        f"--v={c.log_level}",
    ]


def scheduler_args(c: ControlPlaneInputs) -> list[str]:
    return [
        *_controller_args(c, "scheduler", c.ports.scheduler),
        "--leader-elect=false",
        f"--v={c.log_level}",
    ]


def kube_proxy_config(c: ControlPlaneInputs, node: str) -> dict[str, Any]:
    """kube-proxy's ``KubeProxyConfiguration``, as the node ``node``'s proxy."""
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "nftables",
        "clientConnection": {"kubeconfig": str(c.kubeconfigs["kube-proxy"])},
        "hostnameOverride": node,
        "bindAddress": c.host,
        "healthzBindAddress": f"127.0.0.1:{c.ports.proxy_healthz}",
        "metricsBindAddress": f"127.0.0.1:{c.ports.proxy_metrics}",
        "clusterCIDR": c.pod_cidr,
        "detectLocalMode": "ClusterCIDR",
        "nodePortAddresses": [f"{c.host}/32"],
        # Zero leaves the host's conntrack sysctls as they are.
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s",
            "udpTimeout": "0s",
            "udpStreamTimeout": "0s",
        },
    }


def kube_proxy_args(c: ControlPlaneInputs, config: Path) -> list[str]:
    """kube-proxy's command line, given the file holding ``kube_proxy_config``."""
    return [f"--config={config}", f"--v={c.log_level}"]
