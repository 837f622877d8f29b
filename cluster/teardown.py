"""Undoing a cluster: its processes, its nodes' leftovers, its cgroup and its host network.

``teardown`` is the end of every cluster's ``stop``; ``clean_leftovers`` runs it, before a
start, for each cluster that crashed without one, and refuses to start beside a cluster whose
processes still run (one cluster per machine).
"""

from __future__ import annotations

import json
from pathlib import Path

from conveyor.cluster.cgroups import ClusterCgroup
from conveyor.cluster.network import HostNetwork
from conveyor.cluster.process import ManagedProcess
from conveyor.cluster.real_nodes import sweep_real_nodes
from conveyor.cluster.settings import ClusterSettings
from conveyor.cluster.state import STATE_FILE, ClusterState


class ClusterAlreadyRunning(RuntimeError):
    """Another cluster's processes are alive on this machine (one cluster per machine)."""


def teardown(state: ClusterState, grace_s: float, processes: list[ManagedProcess]) -> None:
    """End the processes, then remove the nodes' mounts and cgroups, the cluster's cgroup and the
    host network."""
    errors = []
    for proc in processes:
        try:
            proc.stop(grace_s)
        except RuntimeError as exc:
            errors.append(str(exc))
    plan = state.plan()
    if state.settings:  # the nodes: their cgroup trees and mounts
        sweep_real_nodes(ClusterSettings.from_json(state.settings))
    ClusterCgroup(state.name).remove()
    HostNetwork(plan, state.network).stop()
    if errors:
        raise RuntimeError("; ".join(errors))


def clean_leftovers(state_root: Path) -> None:
    """Undo what crashed clusters left; refuse to start beside a cluster that still runs."""
    for state_file in sorted(state_root.glob(f"*/{STATE_FILE}")):
        state = ClusterState.from_json(json.loads(state_file.read_text()))
        if alive := state.alive():
            names = ", ".join(f"{p.name} (pid {p.pid})" for p in alive)
            raise ClusterAlreadyRunning(
                f"cluster {state.name!r} is running ({names}); one cluster runs per machine. "
                f"Use it (export KUBECONFIG={state.kubeconfig}) or stop it: conveyor cluster down --name {state.name}"
            )
        teardown(state, 0.0, [])
        state_file.unlink()
