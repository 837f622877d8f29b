"""The cluster's DNS: CoreDNS's configuration and the role it signs in with."""

from __future__ import annotations

from pathlib import Path

from conveyor.cluster.dns import USER, corefile, rbac_objects


def test_corefile_serves_the_cluster_zone_on_the_bridge_and_forwards_nothing() -> None:
    text = corefile(
        "198.18.0.1", kubeconfig=Path("/c/coredns.kubeconfig"), health_port=1, ready_port=2
    )
    assert ".:53 {" in text and "bind 198.18.0.1" in text
    assert "kubernetes cluster.local in-addr.arpa ip6.arpa {" in text
    assert "kubeconfig /c/coredns.kubeconfig" in text
    assert "health 127.0.0.1:1" in text and "ready 127.0.0.1:2" in text
    # Pods reach nothing outside: a name the cluster does not own is refused, not forwarded.
    assert "forward" not in text and "fallthrough" not in text


def test_coredns_may_only_read_what_it_serves() -> None:
    (role_path, role), (binding_path, binding) = rbac_objects()
    assert role_path.endswith("/clusterroles") and binding_path.endswith("/clusterrolebindings")
    verbs = {v for rule in role["rules"] for v in rule["verbs"]}
    assert verbs == {"list", "watch"}
    resources = {r for rule in role["rules"] for r in rule["resources"]}
    assert resources == {"endpoints", "endpointslices", "services", "pods", "namespaces"}
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": USER}
    ]
