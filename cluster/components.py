"""The cluster's components as processes, by name: started, waited for, restarted.

Each component (etcd, kube-apiserver, ..., each node's containerd and kubelet) is one ``ManagedProcess`` that
starts inside the cluster's cgroup, with its own log file, and is written down in the
cluster's state as soon as it runs (``on_start``), so another process can stop it. A wait
for a component to serve fails as soon as it exits, with the end of its log.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conveyor.cluster.api import wait_for
from conveyor.cluster.cgroups import ClusterCgroup
from conveyor.cluster.process import ManagedProcess, ProcessRecord, component_env


@dataclass
class Components:
    """The cluster's processes by component name (in the order they started)."""

    logs_dir: Path
    cgroup: ClusterCgroup
    timeout_s: float
    """How long ``wait`` waits for a component to serve."""
    on_start: Callable[[ProcessRecord], None]
    """Called with each process's record once it runs (the cluster writes its state)."""
    processes: dict[str, ManagedProcess] = field(default_factory=dict)

    def log_path(self, name: str) -> Path:
        """The component's log file (appended to at each start)."""
        return self.logs_dir / f"{name}.log"

    def adopt(self, record: ProcessRecord) -> ManagedProcess:
        """A handle on a component started by another process, known by its record."""
        proc = ManagedProcess.adopt(record, self.log_path(record.name))
        self.processes[record.name] = proc
        return proc

    def start(self, name: str, argv: list[str]) -> ManagedProcess:
        """Start the component ``name`` with the command line ``argv``."""
        proc = ManagedProcess(
            name,
            argv,
            self.log_path(name),
            env=component_env(),
            cgroup_procs=self.cgroup.procs_files(),
        )
        self.processes[name] = proc
        self.on_start(proc.start())
        return proc

    def wait(self, name: str, what: str, check: Callable[[], Any]) -> Any:
        """Wait for ``check`` while the component ``name`` runs; its log tail comes with a failure."""
        proc = self.processes[name]

        def still_running() -> None:
            if not proc.alive():
                raise RuntimeError(
                    f"{name} exited (code {proc.exit_code()}) before {what}; "
                    f"log {proc.log_path}:\n{proc.tail()}"
                )

        return wait_for(
            what,
            check,
            timeout_s=self.timeout_s,
            interval_s=0.1,
            guard=still_running,
            context=lambda: f"; log {proc.log_path}:\n{proc.tail()}",
        )

    def restart(self, name: str, *, down_s: float = 0.0) -> ManagedProcess:
        """Kill the component ``name`` (SIGKILL: a crash) and start it again with the same
        command line ``down_s`` later. Returns once it runs."""
        old = self.processes[name]
        # A component adopted from another process is known by its pid only.
        argv = old.argv or old.command_line()
        old.kill()
        time.sleep(down_s)
        return self.start(name, argv)
