"""The pod network on the host: guard route, bridge, Service route, forwarding rules.

Laid out in ARCHITECTURE.md ("The one-machine cluster's network"). Order of ``start``:

1. an ``unreachable`` route for all of 198.18.0.0/15, before anything else, so that traffic
   to a pod or Service address that does not exist fails here instead of leaving the machine;
2. the bridge, holding the host address of this cluster's slice of 198.18.0.0/16;
3. a route for the Service range via the bridge (more specific than the guard route, which
   would otherwise fail the host's connect before kube-proxy's rules apply);
4. ``net.ipv4.ip_forward=1`` (kube-proxy's DNAT makes the host route pod to pod);
5. an nftables table of ours dropping anything forwarded between the bridge and any other
   interface, either way. Nothing is masqueraded toward the outside.

``stop`` undoes each step it did, in reverse. ``sweep`` removes what a crashed run left.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

NFT_TABLE = "conveyor"
"""Our nftables table (family ``inet``); kube-proxy's own tables are ``ip``/``ip6 kube-proxy``."""

KUBE_PROXY_TABLES = (("ip", "kube-proxy"), ("ip6", "kube-proxy"))

IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")


def run(
    *argv: str, check: bool = True, input_: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a network command; a failure raises with its stderr."""
    proc = subprocess.run(argv, capture_output=True, text=True, input=input_)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def link_exists(name: str) -> bool:
    """True if the network interface exists."""
    return run("ip", "link", "show", "dev", name, check=False).returncode == 0


def routes(*selector: str) -> list[dict]:
    """``ip -j route show`` in the main table, filtered by ``selector`` (e.g. ``type unreachable``)."""
    out = run("ip", "-j", "route", "show", *selector).stdout
    return json.loads(out or "[]")


def route_get(address: str) -> dict:
    """How the kernel would route a packet to ``address`` (``ip -j route get``): reads, sends nothing."""
    proc = run("ip", "-j", "route", "get", address, check=False)
    if proc.returncode != 0:
        # An unreachable destination is an error for `route get`; report it as such.
        return {"dst": address, "type": "unreachable", "error": proc.stderr.strip()}
    return json.loads(proc.stdout)[0]


def nft_tables() -> list[tuple[str, str]]:
    """The (family, name) of every nftables table on the host."""
    data = json.loads(run("nft", "-j", "list", "tables").stdout or "{}")
    return [
        (t["table"]["family"], t["table"]["name"]) for t in data.get("nftables", []) if "table" in t
    ]


def forward_ruleset(bridge: str) -> str:
    """Our nftables table: forwarding only between the bridge's own ports (``nft -f`` input).

    A drop in any base chain is final, whatever kube-proxy's chains accept. Loading it again
    replaces the table as one transaction.
    """
    return f"""
table inet {NFT_TABLE}
delete table inet {NFT_TABLE}
table inet {NFT_TABLE} {{
    chain forward {{
        type filter hook forward priority filter - 10; policy accept;
        iifname "{bridge}" oifname != "{bridge}" counter drop comment "pods reach nothing beyond the bridge"
        oifname "{bridge}" iifname != "{bridge}" counter drop comment "nothing beyond the bridge reaches pods"
    }}
}}
"""


@dataclass(frozen=True)
class NetworkPlan:
    """Names and addresses of one cluster's network, derived from its settings."""

    pod_cidr: ipaddress.IPv4Network
    service_cidr: ipaddress.IPv4Network
    guard_cidr: ipaddress.IPv4Network
    bridge: str

    @classmethod
    def from_strings(
        cls, pod_cidr: str, service_cidr: str, guard_cidr: str, bridge: str
    ) -> NetworkPlan:
        """Parse and check the settings' values."""
        plan = cls(
            ipaddress.IPv4Network(pod_cidr),
            ipaddress.IPv4Network(service_cidr),
            ipaddress.IPv4Network(guard_cidr),
            bridge,
        )
        for net in (plan.pod_cidr, plan.service_cidr):
            if not net.subnet_of(plan.guard_cidr):
                raise ValueError(
                    f"{net} is outside the guarded range {plan.guard_cidr}: choose a range inside it"
                )
        if plan.pod_cidr.overlaps(plan.service_cidr):
            raise ValueError(
                f"pod range {plan.pod_cidr} overlaps Service range {plan.service_cidr}"
            )
        if len(bridge) > 15:
            raise ValueError(f"bridge name {bridge!r} is longer than 15 characters")
        return plan

    @property
    def host_address(self) -> ipaddress.IPv4Address:
        """The bridge's address on the host: the pods' gateway and the apiserver's address."""
        return self.pod_cidr.network_address + 1

    @property
    def kubernetes_service_ip(self) -> ipaddress.IPv4Address:
        """The ClusterIP the apiserver gives the ``kubernetes`` Service (first of the range)."""
        return self.service_cidr.network_address + 1


@dataclass
class NetworkState:
    """What ``HostNetwork.start`` changed, written to the cluster's state so a crash can be undone."""

    added_guard_route: bool = False
    ip_forward_before: str | None = None

    def to_json(self) -> dict:
        return {
            "added_guard_route": self.added_guard_route,
            "ip_forward_before": self.ip_forward_before,
        }

    @classmethod
    def from_json(cls, data: dict) -> NetworkState:
        return cls(data.get("added_guard_route", False), data.get("ip_forward_before"))


class HostNetwork:
    """The host side of the pod network, with ``start()``/``stop()``."""

    def __init__(self, plan: NetworkPlan, state: NetworkState | None = None) -> None:
        self.plan = plan
        self.state = state or NetworkState()

    def start(self, on_change: Callable[[], None] = lambda: None) -> None:
        """Lay out the network in the order above; ``on_change`` is called after each step (to save state)."""
        p = self.plan
        if not any(r.get("dst") == str(p.guard_cidr) for r in routes("type", "unreachable")):
            self.state.added_guard_route = True
            on_change()
            run("ip", "route", "add", "unreachable", str(p.guard_cidr))
        if not link_exists(p.bridge):
            run("ip", "link", "add", p.bridge, "type", "bridge")
        run("ip", "addr", "replace", f"{p.host_address}/{p.pod_cidr.prefixlen}", "dev", p.bridge)
        run("ip", "link", "set", p.bridge, "up")
        run(
            "ip",
            "route",
            "replace",
            str(p.service_cidr),
            "dev",
            p.bridge,
            "src",
            str(p.host_address),
        )
        if self.state.ip_forward_before is None:
            self.state.ip_forward_before = IP_FORWARD.read_text().strip()
            on_change()
        IP_FORWARD.write_text("1\n")
        run("nft", "-f", "-", input_=forward_ruleset(p.bridge))
        self.check_routes()

    def check_routes(self) -> None:
        """Pod and Service addresses must resolve to the bridge (``ip route get``; nothing is sent)."""
        p = self.plan
        for addr in (p.pod_cidr.network_address + 2, p.kubernetes_service_ip):
            got = route_get(str(addr))
            if got.get("dev") != p.bridge:
                raise RuntimeError(f"{addr} does not route to the bridge {p.bridge}: {got}")
        outside = p.guard_cidr.network_address + (p.guard_cidr.num_addresses - 2)
        got = route_get(str(outside))
        if got.get("type") != "unreachable" and got.get("dev") != p.bridge:
            raise RuntimeError(
                f"{outside} (inside {p.guard_cidr}, outside the cluster) routes out: {got}"
            )

    def stop(self) -> None:
        """Undo ``start`` (also after a crash, from the saved state); each step only if present."""
        p = self.plan
        for family, name in nft_tables():
            if (family, name) == ("inet", NFT_TABLE) or (family, name) in KUBE_PROXY_TABLES:
                run("nft", "delete", "table", family, name)
        # Deleting the bridge removes its address and the Service route through it.
        if link_exists(p.bridge):
            run("ip", "link", "del", p.bridge)
        if self.state.added_guard_route and any(
            r.get("dst") == str(p.guard_cidr) for r in routes("type", "unreachable")
        ):
            run("ip", "route", "del", "unreachable", str(p.guard_cidr))
        self.state.added_guard_route = False
        if self.state.ip_forward_before is not None:
            IP_FORWARD.write_text(self.state.ip_forward_before + "\n")
            self.state.ip_forward_before = None
