"""``conveyor cluster up|down|status|build``: the one-machine cluster from the command line."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from dataclasses import replace
from pathlib import Path

from conveyor.cluster.cluster import Cluster
from conveyor.cluster.figures import figures, format_figures
from conveyor.cluster.kubelet_node import missing_host_tools
from conveyor.cluster.leftovers import find_leftovers
from conveyor.cluster.real_nodes import default_node_images, node_image_path
from conveyor.cluster.settings import ClusterSettings
from conveyor.cluster.state import ClusterState, read_state
from conveyor.cluster.teardown import ClusterAlreadyRunning
from conveyor.cluster.tools import build_tools


def _parser() -> argparse.ArgumentParser:
    defaults = ClusterSettings()
    parser = argparse.ArgumentParser(prog="conveyor cluster", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--name", default=defaults.name, help="cluster name (its work directory)")
        p.add_argument(
            "--state-root",
            type=Path,
            default=defaults.state_root,
            help="root of the work directories",
        )

    up = sub.add_parser(
        "up", help="start the cluster and return once it is ready (it keeps running)"
    )
    common(up)
    up.add_argument(
        "--gpu-nodes", type=int, default=defaults.gpu_nodes, help="GPU nodes (fake GPUs)"
    )
    up.add_argument(
        "--gpus-per-node",
        type=int,
        default=defaults.gpus_per_node,
        help="nvidia.com/gpu per GPU node",
    )
    up.add_argument(
        "--cpu-nodes", type=int, default=defaults.cpu_nodes, help="untainted nodes without GPUs"
    )
    up.add_argument(
        "--node-image",
        action="append",
        default=[],
        metavar="IMAGE",
        help="an image each node's containerd gets (repeatable): an OCI layout directory or "
        "archive, or 'conveyor': the project's image as `conveyor image build` left it; "
        "imported once into a cached seed that every node clones; pods use it with "
        "imagePullPolicy: Never. Default: every image `conveyor image build` has built here "
        "(the project's, conveyor-control, vllm-cpu)",
    )
    up.add_argument(
        "--tools-dir",
        type=Path,
        default=None,
        help="use binaries from here instead of building them",
    )
    up.add_argument(
        "--foreground",
        action="store_true",
        help="stay attached; Ctrl-C (or SIGTERM) stops the cluster",
    )
    down = sub.add_parser("down", help="stop the cluster; nothing is left behind")
    common(down)
    status = sub.add_parser("status", help="where the cluster is and how to use it")
    common(status)
    status.add_argument(
        "--figures", action="store_true", help="print build time, start time and memory"
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")
    sub.add_parser("build", help="build the pinned tools (exits at once when they are built)")
    return parser


def main(argv: list[str]) -> int:
    """Entry point of ``conveyor cluster``."""
    args = _parser().parse_args(argv)
    if args.command == "build":
        tools = build_tools()
        print(tools.directory)
        return 0
    settings = ClusterSettings(name=args.name, state_root=args.state_root)
    if args.command == "up":
        try:
            images = [node_image_path(p) for p in args.node_image] or default_node_images()
        except FileNotFoundError as exc:
            print(f"conveyor cluster up: {exc}", file=sys.stderr)
            return 2
        if (missing := missing_host_tools()) is not None:
            print(f"conveyor cluster up: {missing}", file=sys.stderr)
            return 2
        settings = replace(
            settings,
            gpu_nodes=args.gpu_nodes,
            gpus_per_node=args.gpus_per_node,
            cpu_nodes=args.cpu_nodes,
            tools_dir=args.tools_dir,
            node_images=tuple(map(str, images)),
        )
        cluster = Cluster(settings)
        try:
            cluster.start()
        except ClusterAlreadyRunning as exc:
            print(f"conveyor cluster up: {exc}", file=sys.stderr)
            return 1
        print(
            f"cluster {settings.name!r} is up in {cluster.timings['start_total_s']:.1f} s: {cluster.server}"
        )
        print(f"logs: {cluster.logs_dir}")
        print(f"export KUBECONFIG={cluster.kubeconfig_path}", flush=True)
        if args.foreground:
            _wait_for_signal()
            cluster.stop()
            print(f"cluster {settings.name!r} stopped")
        return 0
    cluster = Cluster(settings)
    if args.command == "down":
        was_running = cluster.running()
        cluster.stop()
        print(
            f"cluster {settings.name!r} {'stopped' if was_running else 'was not running; leftovers removed'}"
        )
        return 0
    return _status(cluster, as_json=args.json, with_figures=args.figures)


def _all_states(settings: ClusterSettings) -> list[ClusterState]:
    """The recorded state of every cluster under the state root."""
    states = []
    for work_dir in settings.state_root.glob("*"):
        if (state := read_state(work_dir)) is not None:
            states.append(state)
    return states


def _wait_for_signal() -> None:
    """Block until SIGINT or SIGTERM arrives."""
    wanted = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, wanted)
    signal.sigwait(wanted)


def _status(cluster: Cluster, *, as_json: bool, with_figures: bool) -> int:
    state = read_state(cluster.work_dir)
    running = bool(state and state.alive())
    info: dict = {
        "name": cluster.settings.name,
        "running": running,
        "work_dir": str(cluster.work_dir),
    }
    if state:
        info |= {
            "server": state.server,
            "kubeconfig": state.kubeconfig,
            "processes": {p.name: {"pid": p.pid, "alive": p.alive()} for p in state.processes},
        }
    if running:
        try:
            nodes = cluster.api.get("/api/v1/nodes")["items"]
            info["nodes"] = {
                n["metadata"]["name"]: next(
                    (
                        c["status"]
                        for c in n["status"].get("conditions", [])
                        if c["type"] == "Ready"
                    ),
                    "Unknown",
                )
                for n in nodes
            }
        except OSError as exc:
            info["nodes_error"] = str(exc)
    if with_figures:
        info["figures"] = figures(cluster)
    if as_json:
        print(json.dumps(info, indent=2))
        return 0 if running else 1
    if not running:
        print(f"cluster {cluster.settings.name!r} is not running (start it: conveyor cluster up)")
        for other in _all_states(cluster.settings):
            if other.alive():
                print(
                    f"cluster {other.name!r} is running: conveyor cluster status --name {other.name}"
                )
        left = find_leftovers(cluster.plan, cluster_name=cluster.settings.name, tools_dir=None)
        if any(left.values()) and not any(s.alive() for s in _all_states(cluster.settings)):
            print(
                "left on this machine by a run that did not stop (`conveyor cluster down` removes them):"
            )
            for kind, items in left.items():
                if items:
                    print(f"  {kind}: {', '.join(items)}")
    else:
        print(f"cluster {cluster.settings.name!r} is running at {info['server']}")
        for name, p in info["processes"].items():
            print(f"  {name:<24} pid {p['pid']:<8} {'running' if p['alive'] else 'ENDED'}")
        for name, ready in info.get("nodes", {}).items():
            print(f"  node {name:<19} Ready={ready}")
        print(f"logs: {cluster.logs_dir}")
        print(f"export KUBECONFIG={info['kubeconfig']}")
    if with_figures:
        print(format_figures(info["figures"]))
    return 0 if running else 1
