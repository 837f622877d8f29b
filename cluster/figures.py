"""The cluster's figures: cold build time, start to /readyz, idle control-plane memory.

Printed, never asserted: ``conveyor cluster status --figures`` or
``python -m conveyor.cluster.figures``.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

from conveyor.cluster.tools import build_times, tools_directory

if TYPE_CHECKING:
    from conveyor.cluster.cluster import Cluster


def figures(cluster: Cluster) -> dict[str, Any]:
    """What was measured: the build's own record, the last start's timings, memory now."""
    out: dict[str, Any] = {}
    try:
        directory = cluster.tools.directory if cluster.tools else tools_directory()
        times = build_times(directory)
    except (OSError, RuntimeError) as exc:
        times, out["build_error"] = {}, str(exc)
    if times:
        out["build_seconds"] = times
        out["build_total_s"] = sum(times.values())
    timings = cluster.work_dir / "timings.json"
    if timings.exists():
        out["last_start"] = json.loads(timings.read_text())
    memory = cluster.memory()
    if memory:
        out["memory_rss_mib"] = {k: round(v / 2**20, 1) for k, v in memory.items()}
        out["memory_rss_total_mib"] = round(sum(memory.values()) / 2**20, 1)
    return out


def format_figures(fig: dict[str, Any]) -> str:
    """The figures as a few lines of text."""
    lines = ["figures:"]
    if "build_total_s" in fig:
        per = ", ".join(f"{k} {v} s" for k, v in fig["build_seconds"].items())
        lines.append(f"  cold build of the tools: {fig['build_total_s']} s ({per})")
    else:
        lines.append("  cold build of the tools: not recorded")
    start = fig.get("last_start", {})
    for key, label in (
        ("start_to_readyz_s", "start to apiserver /readyz"),
        ("start_to_nodes_ready_s", "start to every node Ready"),
        ("start_to_ready_s", "start to cluster ready (kube-proxy rules, default ServiceAccount)"),
    ):
        if key in start:
            lines.append(f"  {label}: {start[key]:.1f} s")
    if "memory_rss_total_mib" in fig:
        per = ", ".join(f"{k} {v}" for k, v in fig["memory_rss_mib"].items())
        lines.append(f"  control-plane memory now (RSS): {fig['memory_rss_total_mib']} MiB ({per})")
    else:
        lines.append("  control-plane memory: the cluster is not running")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m conveyor.cluster.figures [NAME]``."""
    import argparse

    from conveyor.cluster.cluster import Cluster
    from conveyor.cluster.settings import ClusterSettings

    p = argparse.ArgumentParser(
        prog="python -m conveyor.cluster.figures",
        description="Print the one-machine cluster's figures: cold build time, start to "
        "/readyz, idle control-plane memory (measured, never asserted).",
    )
    p.add_argument("name", nargs="?", help="the cluster's name (default: the default cluster)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    cluster = Cluster(ClusterSettings(name=args.name) if args.name else ClusterSettings())
    print(format_figures(figures(cluster)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
