"""What a cluster did, written to ``state.json`` in its work directory as it happens.

The record is what lets another process act on a cluster: ``conveyor cluster down`` stops a
cluster that ``conveyor cluster up`` started, and a later start cleans up after a crashed
cluster (its settings say where its nodes' directories are) while never touching one
whose processes still run. ``machine_lock`` keeps starts and stops on one machine apart.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conveyor.cluster.network import NetworkPlan, NetworkState
from conveyor.cluster.process import ProcessRecord

STATE_FILE = "state.json"


@dataclass
class ClusterState:
    """What a running (or crashed) cluster did, as written to ``state.json``."""

    name: str
    bridge: str
    pod_cidr: str
    service_cidr: str
    guard_cidr: str
    network: NetworkState = field(default_factory=NetworkState)
    processes: list[ProcessRecord] = field(default_factory=list)
    server: str = ""
    kubeconfig: str = ""
    owner_pid: int = field(default_factory=os.getpid)
    settings: dict[str, Any] = field(default_factory=dict)
    tools_dir: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "bridge": self.bridge,
            "pod_cidr": self.pod_cidr,
            "service_cidr": self.service_cidr,
            "guard_cidr": self.guard_cidr,
            "network": self.network.to_json(),
            "processes": [vars(p) for p in self.processes],
            "server": self.server,
            "kubeconfig": self.kubeconfig,
            "owner_pid": self.owner_pid,
            "settings": self.settings,
            "tools_dir": self.tools_dir,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClusterState:
        return cls(
            name=data["name"],
            bridge=data["bridge"],
            pod_cidr=data["pod_cidr"],
            service_cidr=data["service_cidr"],
            guard_cidr=data["guard_cidr"],
            network=NetworkState.from_json(data.get("network", {})),
            processes=[ProcessRecord(**p) for p in data.get("processes", [])],
            server=data.get("server", ""),
            kubeconfig=data.get("kubeconfig", ""),
            owner_pid=data.get("owner_pid", 0),
            settings=data.get("settings", {}),
            tools_dir=data.get("tools_dir", ""),
        )

    def plan(self) -> NetworkPlan:
        return NetworkPlan.from_strings(
            self.pod_cidr, self.service_cidr, self.guard_cidr, self.bridge
        )

    def alive(self) -> list[ProcessRecord]:
        """The recorded processes that still run."""
        return [p for p in self.processes if p.alive()]


def read_state(work_dir: Path) -> ClusterState | None:
    """The state of the cluster in ``work_dir``, if one is recorded."""
    path = work_dir / STATE_FILE
    if not path.is_file():
        return None
    return ClusterState.from_json(json.loads(path.read_text()))


def write_state(work_dir: Path, state: ClusterState) -> None:
    """Replace ``state.json`` in ``work_dir`` at once: a reader never sees half a record."""
    path = work_dir / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state.to_json(), indent=2))
    tmp.replace(path)


@contextlib.contextmanager
def machine_lock(state_root: Path) -> Iterator[None]:
    """Held while a cluster starts or stops: starts and stops on one machine never interleave."""
    state_root.mkdir(parents=True, exist_ok=True)
    with (state_root / ".lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
