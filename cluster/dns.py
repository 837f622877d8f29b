"""The cluster's DNS: CoreDNS on the bridge's host address, naming Services and pods.

Pods get it as their name server (``dnsPolicy: ClusterFirst``, the default) through each
kubelet's ``clusterDNS``. It
answers the cluster's zone (``<service>.<namespace>.svc.cluster.local``, headless Services'
endpoints, pods by address) and the reverse zones from the apiserver, and nothing else: there
is no ``forward``, so a name outside the cluster is refused at once, as pods here reach nothing
outside. CoreDNS is built from its pinned Go module with only the plugins used here
(``go/coredns``); it signs in as ``system:coredns``, bound to the read-only role that
CoreDNS's own deployment manifests give it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

DOMAIN = "cluster.local"
"""The cluster's DNS domain (the kubelets' ``clusterDomain``)."""

DNS_PORT = 53
"""Where pods send their lookups (resolv.conf has no port)."""

USER = "system:coredns"
"""The user CoreDNS's client certificate names."""

ROLE_NAME = "system:coredns"


def corefile(host: str, *, kubeconfig: Path, health_port: int, ready_port: int) -> str:
    """CoreDNS's configuration: the cluster's zones on ``host``:53, health and readiness on loopback.

    ``ready`` answers 200 once the kubernetes plugin has listed Services and endpoints, which
    is what the cluster waits for. The TTLs are short so that a Service made or deleted
    shows within seconds, as tests and operators expect.
    """
    return f"""\
.:{DNS_PORT} {{
    bind {host}
    errors
    health 127.0.0.1:{health_port}
    ready 127.0.0.1:{ready_port}
    kubernetes {DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig}
        pods insecure
        ttl 5
    }}
    cache 5
}}
"""


def coredns_args(config: Path) -> list[str]:
    """CoreDNS's command line, given the file holding ``corefile``."""
    return ["-conf", str(config)]


def rbac_objects() -> list[tuple[str, dict[str, Any]]]:
    """(collection path, object): the role CoreDNS needs (list and watch what it serves) and its binding."""
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": ROLE_NAME},
        "rules": [
            {
                "apiGroups": [""],
                "resources": ["endpoints", "services", "pods", "namespaces"],
                "verbs": ["list", "watch"],
            },
            {
                "apiGroups": ["discovery.k8s.io"],
                "resources": ["endpointslices"],
                "verbs": ["list", "watch"],
            },
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": ROLE_NAME},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": ROLE_NAME,
        },
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": USER}],
    }
    base = "/apis/rbac.authorization.k8s.io/v1"
    return [(f"{base}/clusterroles", role), (f"{base}/clusterrolebindings", binding)]
