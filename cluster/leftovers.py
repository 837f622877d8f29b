"""What a cluster may leave on the host, listed by reading it (for tests and ``status``).

``find_leftovers`` names every process, link, route, nftables table and cgroup of the
cluster's making that exists now, and what its nodes leave if anything goes wrong:
processes and mounts under the nodes' directories, the nodes' cgroup trees; after ``stop``
each list must be empty.
``rulesets`` snapshots the whole nftables and iptables state, to compare with one taken
before the cluster started.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from conveyor.cluster.cgroups import ClusterCgroup
from conveyor.cluster.network import KUBE_PROXY_TABLES, NFT_TABLE, NetworkPlan, nft_tables, run


def _processes_of(tools_dir: Path | None) -> list[str]:
    """Processes whose executable is one of the built tools."""
    if tools_dir is None:
        return []
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            exe = (proc / "exe").resolve()
        except OSError:
            continue
        if exe.parent == tools_dir.resolve():
            found.append(f"{exe.name} (pid {proc.name})")
    return found


def _real_node_leftovers(cluster_name: str) -> dict[str, list[str]]:
    """Processes (containerd, its shims, kubelets, device plugins) and mounts whose paths are
    under a real node's directory of this cluster, and the nodes' cgroup trees."""
    marker = f"/{cluster_name}/nodes/"
    processes = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            processes.append(f"{cmdline.split()[0]} (pid {proc.name})")
    mounts = [
        line.split()[4]
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if marker in line.split()[4]
    ]
    root = Path("/sys/fs/cgroup")
    cgroups = sorted(
        str(p)
        for p in [
            *root.glob(f"conveyor-{cluster_name}-*"),
            *root.glob(f"*/conveyor-{cluster_name}-*"),
        ]
    )
    return {
        "real node processes": processes,
        "real node mounts": mounts,
        "real node cgroups": cgroups,
    }


def find_leftovers(
    plan: NetworkPlan, *, cluster_name: str, tools_dir: Path | None
) -> dict[str, list[str]]:
    """Everything of the cluster's making that is on the host now, by kind."""
    links = json.loads(run("ip", "-j", "link", "show").stdout or "[]")
    guarded = []
    for table in ("main", "local"):
        for r in json.loads(run("ip", "-j", "route", "show", "table", table).stdout or "[]"):
            dst = r.get("dst", "")
            if dst.startswith(("198.18.", "198.19.")) or r.get("dev") == plan.bridge:
                guarded.append(f"{table}: {dst} {r.get('type', '')} {r.get('dev', '')}".strip())
    ours = {("inet", NFT_TABLE), *KUBE_PROXY_TABLES}
    return {
        "processes": _processes_of(tools_dir),
        # The bridge, and the host ends of the pods' veth pairs (the CNI plugin's) on it.
        "links": [
            link["ifname"] for link in links if plan.bridge in (link["ifname"], link.get("master"))
        ],
        "routes": guarded,
        "nftables tables": [f"{f} {n}" for f, n in nft_tables() if (f, n) in ours],
        "cgroups": [str(d) for d in ClusterCgroup(cluster_name).dirs if d.exists()],
        **_real_node_leftovers(cluster_name),
    }


def rulesets() -> dict[str, str]:
    """The whole nftables ruleset and iptables rules (where the tools exist), as text."""
    out = {"nft": run("nft", "list", "ruleset").stdout}
    for tool in ("iptables-save", "ip6tables-save"):
        if shutil.which(tool):
            text = run(tool).stdout
            # Drop the comment lines (they carry timestamps).
            out[tool] = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    return out
