"""The node agent seen from the cluster: its command line, its readiness, what its stop leaves.

The cluster starts it last (once the nodes are Ready and kube-proxy routes ClusterIPs) as a
``ManagedProcess`` named ``node-agent`` and stops it first: its SIGTERM stops every pod and
removes what they had.
``sweep_node_agent`` removes what an agent killed outright left (mounts, cgroups, files);
the cluster's network sweep removes the pods' network namespaces.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

from conveyor.cluster.podcgroups import sweep_pod_cgroups

AGENT_NAME = "node-agent"

SKIP_ANNOTATION = "conveyor.dev/node-agent"
"""A pod annotated ``conveyor.dev/node-agent: skip`` is left alone by the agent (for tests that make
a pod's network and status by hand)."""


def agent_argv(work_dir: Path) -> list[str]:
    """The agent's command line (this Python, this checkout)."""
    return [sys.executable, "-m", "conveyor.cluster.agent", str(work_dir)]


def agent_ready(work_dir: Path, pid: int) -> bool:
    """True once the agent with ``pid`` has listed the pods and adopted its own."""
    try:
        return (work_dir / "agent" / "ready").read_text().strip() == str(pid)
    except FileNotFoundError:
        return False


def sweep_node_agent(work_dir: Path, cluster_name: str) -> None:
    """Remove the pods' leftovers after the agent and its pods' processes have ended."""
    sweep_pod_cgroups(cluster_name)
    pods = work_dir / "agent" / "pods"
    if not pods.exists():
        return
    for mount in _mounts_below(pods):
        subprocess.run(["umount", "-l", mount], check=False, capture_output=True)
    for pod_dir in pods.iterdir():
        for path in sorted(pod_dir.rglob("*"), key=lambda p: -len(p.parts)):
            with contextlib.suppress(FileNotFoundError):
                if path.is_dir() and not path.is_symlink():
                    path.rmdir()
                else:
                    path.unlink()
        pod_dir.rmdir()


def _mounts_below(directory: Path) -> list[str]:
    """Mount points under ``directory`` in the host's mount namespace, deepest first."""
    prefix = str(directory) + "/"
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4]
        if point.startswith(prefix):
            found.append(point)
    return sorted(found, key=lambda p: -p.count("/"))
