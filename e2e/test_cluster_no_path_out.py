"""No path leads out: read the routes and forwarding rules; no packet is sent to test it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pod_helpers import create, pod, wait_phase
from real_nodes_helpers import containerd_task_pid

from conveyor.cluster import Cluster
from conveyor.cluster.network import NFT_TABLE, route_get, routes, run
from conveyor.cluster.testing import KubeUnderTest

# Addresses outside this machine, used only as questions to `ip route get` (nothing is sent).
OUTSIDE = ("192.0.2.77", "203.0.113.9", "8.8.8.8")


def _ruleset() -> list[dict]:
    return json.loads(run("nft", "-j", "list", "ruleset").stdout)["nftables"]


def test_pod_and_service_addresses_stay_on_the_bridge(own_cluster: Cluster) -> None:
    plan = own_cluster.plan
    unreachable = [r["dst"] for r in routes("type", "unreachable")]
    assert str(plan.guard_cidr) in unreachable
    for address in (
        plan.pod_cidr.network_address + 7,
        plan.pod_cidr.broadcast_address - 1,
        plan.kubernetes_service_ip,
    ):
        assert route_get(str(address))["dev"] == plan.bridge, address
    # Inside the guarded /15 but outside this cluster's slices: fails here, never leaves.
    for address in ("198.18.200.1", "198.19.200.1"):
        assert route_get(address)["type"] == "unreachable", address


def test_the_bridge_forwards_nowhere_else_and_nothing_is_masqueraded_out(
    own_cluster: Cluster,
) -> None:
    bridge = own_cluster.plan.bridge
    ruleset = _ruleset()
    chains = [
        x["chain"]
        for x in ruleset
        if "chain" in x and x["chain"]["table"] == NFT_TABLE and x["chain"]["family"] == "inet"
    ]
    assert [(c["name"], c["hook"], c.get("policy")) for c in chains] == [
        ("forward", "forward", "accept")
    ]
    rules = [x["rule"] for x in ruleset if "rule" in x and x["rule"]["table"] == NFT_TABLE]

    def matches(rule: dict) -> set[tuple[str, str, str]]:
        found = set()
        for expr in rule["expr"]:
            if "match" in expr:
                m = expr["match"]
                found.add((m["left"]["meta"]["key"], m["op"], m["right"]))
        return found

    drops = [matches(r) for r in rules if any("drop" in e for e in r["expr"])]
    assert {("iifname", "==", bridge), ("oifname", "!=", bridge)} in drops
    assert {("oifname", "==", bridge), ("iifname", "!=", bridge)} in drops
    # Masquerading lives only in kube-proxy's table (Service traffic it DNATs to pods on the
    # bridge); no other table rewrites a source address toward another interface.
    for rule in (x["rule"] for x in ruleset if "rule" in x):
        if any("masquerade" in e or "snat" in e for e in rule["expr"]):
            assert (rule["family"], rule["table"]) in {
                ("ip", "kube-proxy"),
                ("ip6", "kube-proxy"),
            }, rule
    # The host forwards only because the cluster asked; the rules above confine it to the bridge.
    assert Path("/proc/sys/net/ipv4/ip_forward").read_text().strip() == "1"


def test_a_pod_can_only_reach_the_bridge(
    kube: KubeUnderTest, own_cluster: Cluster, namespace: str
) -> None:
    """A pod's routes all go through its one interface (besides loopback), to the bridge's
    host address; its network comes from the CNI bridge plugin."""
    plan = own_cluster.plan
    create(kube.api, namespace, pod("probe", ["sleep", "600"]))
    running = wait_phase(kube.api, namespace, "probe", "Running")
    container_id = running["status"]["containerStatuses"][0]["containerID"].partition("://")[2]
    pid = containerd_task_pid(own_cluster, running["spec"]["nodeName"], container_id)

    def in_pod(*argv: str) -> Any:
        return json.loads(run("nsenter", "-t", str(pid), "-n", "ip", "-j", *argv).stdout)

    pod_routes = in_pod("route", "show")
    assert {r.get("dev") for r in pod_routes} == {"eth0"}
    default = next(r for r in pod_routes if r["dst"] == "default")
    assert default["gateway"] == str(plan.host_address)
    for address in (*OUTSIDE, str(plan.kubernetes_service_ip)):
        (got,) = in_pod("route", "get", address)
        assert got["dev"] == "eth0" and got["gateway"] == str(plan.host_address), got
    links = {link["ifname"]: link for link in in_pod("link", "show")}
    assert sorted(links) == ["eth0", "lo"]
    # The host end of the pod's veth (the peer's index) is a port of the cluster's bridge.
    host_ends = json.loads(run("ip", "-j", "link", "show").stdout)
    (host_end,) = [link for link in host_ends if link["ifindex"] == links["eth0"]["link_index"]]
    assert host_end["master"] == plan.bridge
