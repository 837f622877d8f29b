"""A pod's network: a network namespace, a veth pair into the bridge, an address, a default route.

The node agent calls this for each pod it runs; until it exists, tests make a pod's network
by hand with it. Names derive from the pod's namespace and name, so a pod's network is found
again after a restart, and all of them are found by prefix when the cluster stops.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path

from conveyor.cluster.network import NetworkPlan, link_exists, run

NETNS_PREFIX = "cvpod-"
"""Prefix of every pod network namespace (``ip netns list``); the cluster removes all of them."""

VETH_PREFIX = "cvp"
"""Prefix of the host end of every pod's veth pair."""

NETNS_DIR = Path("/run/netns")


@dataclass(frozen=True)
class PodNetwork:
    """One pod's network, as made by ``PodNetworks.create``."""

    netns: str
    host_veth: str
    address: ipaddress.IPv4Address
    gateway: ipaddress.IPv4Address

    def exec_argv(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the pod's network namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]


def pod_key_digest(namespace: str, name: str) -> str:
    """A short stable digest of a pod's namespace and name (names must fit in 15 characters)."""
    return hashlib.sha256(f"{namespace}/{name}".encode()).hexdigest()[:10]


def mac_for(address: ipaddress.IPv4Address) -> str:
    """A pod's MAC address, from its IP (locally administered, Docker's 02:42 scheme).

    Addresses are reused as soon as a pod is gone; with a random MAC per veth, a peer that had
    talked to the old pod (a gateway polling its replicas) would keep the old MAC in its ARP
    cache and its packets would go nowhere until that entry went stale and failed: 8-13 s of a
    replica's wake-up from zero. So the same IP always has the same MAC."""
    return "02:42:" + ":".join(f"{b:02x}" for b in address.packed)


class PodNetworks:
    """Makes and removes pod networks on one cluster's bridge."""

    def __init__(self, plan: NetworkPlan) -> None:
        self.plan = plan

    def names(self, namespace: str, name: str) -> tuple[str, str]:
        """The network namespace and host veth names of a pod."""
        digest = pod_key_digest(namespace, name)
        return f"{NETNS_PREFIX}{digest}", f"{VETH_PREFIX}{digest}"

    def create(
        self, namespace: str, name: str, address: ipaddress.IPv4Address | None = None
    ) -> PodNetwork:
        """Make the pod's network; ``address`` defaults to the lowest free one of the slice."""
        netns, host_veth = self.names(namespace, name)
        if (NETNS_DIR / netns).exists():
            raise FileExistsError(f"pod {namespace}/{name} already has a network ({netns})")
        address = address or self.allocate_address()
        if address not in self.plan.pod_cidr or address == self.plan.host_address:
            raise ValueError(f"{address} is not a pod address of {self.plan.pod_cidr}")
        gateway = self.plan.host_address
        run("ip", "netns", "add", netns)
        try:
            peer = f"{VETH_PREFIX}{pod_key_digest(namespace, name)[:9]}x"
            run(
                "ip", "link", "add", host_veth, "type", "veth", "peer", "name", peer, "netns", netns
            )
            run("ip", "link", "set", host_veth, "master", self.plan.bridge)
            # Hairpin: a pod reaching its own Service comes back through the port it left by.
            run("ip", "link", "set", host_veth, "type", "bridge_slave", "hairpin", "on")
            run("ip", "link", "set", host_veth, "up")
            ns = ("ip", "-n", netns)
            run(*ns, "link", "set", peer, "name", "eth0")
            run(*ns, "link", "set", "eth0", "address", mac_for(address))
            run(*ns, "addr", "add", f"{address}/{self.plan.pod_cidr.prefixlen}", "dev", "eth0")
            run(*ns, "link", "set", "eth0", "up")
            run(*ns, "link", "set", "lo", "up")
            run(*ns, "route", "add", "default", "via", str(gateway), "dev", "eth0")
        except BaseException:
            self.delete_netns(netns)
            raise
        return PodNetwork(netns, host_veth, address, gateway)

    def delete(self, namespace: str, name: str) -> None:
        """Remove the pod's network (if it exists)."""
        self.delete_netns(self.names(namespace, name)[0])

    def delete_netns(self, netns: str) -> None:
        """Remove a pod network namespace and its veth pair (deleting one end removes both)."""
        host_veth = VETH_PREFIX + netns.removeprefix(NETNS_PREFIX)
        if link_exists(host_veth):
            run("ip", "link", "del", host_veth)
        if (NETNS_DIR / netns).exists():
            run("ip", "netns", "delete", netns)

    def list_netns(self) -> list[str]:
        """Every pod network namespace on the host."""
        if not NETNS_DIR.exists():
            return []
        return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(NETNS_PREFIX))

    def addresses_in_use(self) -> set[ipaddress.IPv4Address]:
        """Addresses held by the pod network namespaces that exist now."""
        used = set()
        for netns in self.list_netns():
            out = run("ip", "-n", netns, "-j", "addr", "show", "dev", "eth0", check=False).stdout
            for link in json.loads(out or "[]"):
                for a in link.get("addr_info", []):
                    if a.get("family") == "inet":
                        used.add(ipaddress.IPv4Address(a["local"]))
        return used

    def allocate_address(self) -> ipaddress.IPv4Address:
        """The lowest address of the slice that no pod holds (the host address excluded)."""
        used = self.addresses_in_use() | {self.plan.host_address}
        for addr in self.plan.pod_cidr.hosts():
            if addr not in used:
                return addr
        raise RuntimeError(f"no free pod address left in {self.plan.pod_cidr}")

    def sweep(self) -> None:
        """Remove every pod network (the cluster's stop, or a crashed run's leftovers)."""
        for netns in self.list_netns():
            self.delete_netns(netns)
        out = run("ip", "-j", "link", "show").stdout
        for link in json.loads(out or "[]"):
            if link["ifname"].startswith(VETH_PREFIX):
                run("ip", "link", "del", link["ifname"], check=False)
