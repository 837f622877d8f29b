"""The cluster's clients: who each client certificate names, and the kubeconfig each one uses.

The admin's kubeconfig is the one users and tests get (``Cluster.kubeconfig_path``); each
component (controller-manager, scheduler, kube-proxy, CoreDNS) gets its own under ``config/``.
RBAC's bootstrap policy binds the component users; CoreDNS's role is the cluster's own
(``dns.rbac_objects``).
"""

from __future__ import annotations

from pathlib import Path

from conveyor.cluster.api import kubeconfig, write_kubeconfig
from conveyor.cluster.certs import ClientIdentity, Pki

CLIENTS = [
    ClientIdentity("admin", "conveyor-admin", ("system:masters",)),
    ClientIdentity("controller-manager", "system:kube-controller-manager"),
    ClientIdentity("scheduler", "system:kube-scheduler"),
    ClientIdentity("kube-proxy", "system:kube-proxy"),
    ClientIdentity("coredns", "system:coredns"),
    ClientIdentity("apiserver-kubelet", "kube-apiserver-kubelet-client", ("system:masters",)),
    # The aggregation layer's client; only this name may assert users through request headers.
    ClientIdentity("front-proxy", "front-proxy-client"),
]
"""Client certificates: (name, user, groups)."""


def write_kubeconfigs(
    pki: Pki, *, server: str, admin_path: Path, config_dir: Path, context: str
) -> dict[str, Path]:
    """Write a kubeconfig for each client that talks to the apiserver; client name -> its path.

    The admin's goes to ``admin_path``, the others to ``config_dir/<name>.kubeconfig``. The
    front proxy's certificate is the apiserver's own (aggregation layer): it gets none.
    """
    paths = {}
    for client in CLIENTS:
        if client.name == "front-proxy":
            continue
        pair = pki.clients[client.name]
        path = admin_path if client.name == "admin" else config_dir / f"{client.name}.kubeconfig"
        write_kubeconfig(
            path,
            kubeconfig(
                server=server,
                ca=pki.ca.cert,
                user=client.user,
                cert=pair.cert,
                key=pair.key,
                context=context,
            ),
        )
        paths[client.name] = path
    return paths
