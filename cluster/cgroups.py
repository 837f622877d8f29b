"""The cluster's own cgroup: every component (the nodes' containerd and kubelets too) joins it.

cgroup v1 (the ``memory`` and ``cpu`` hierarchies, as on the build machines) or v2 (one
unified hierarchy). Stopping the cluster kills whatever is still inside and removes the
directories, children first.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _hierarchies(root: Path) -> list[Path]:
    """The hierarchy roots this machine offers: the v1 memory and cpu ones, or the v2 one."""
    v1 = [root / "memory", root / "cpu"]
    if all((p / "cgroup.procs").exists() for p in v1):
        return v1
    if (root / "cgroup.controllers").exists():
        return [root]
    return []


class ClusterCgroup:
    """The directories ``conveyor-<name>`` in each hierarchy."""

    def __init__(self, name: str, *, root: Path = CGROUP_ROOT) -> None:
        self.root = root
        self.dirs = [h / f"conveyor-{name}" for h in _hierarchies(root)]

    def create(self) -> None:
        """Make the directories (no limits: the control plane may use the whole machine)."""
        for d in self.dirs:
            d.mkdir(exist_ok=True)

    def limit_cpu(self, cores: float) -> None:
        """Cap everything inside at ``cores`` CPUs: a CFS quota over a 100 ms period (v1
        ``cpu.cfs_quota_us``, v2 ``cpu.max``), as a kubelet applies ``limits.cpu``."""
        period = 100_000
        quota = max(1000, int(cores * period))
        for d in self.dirs:
            if (d / "cpu.cfs_quota_us").exists():
                (d / "cpu.cfs_period_us").write_text(str(period))
                (d / "cpu.cfs_quota_us").write_text(str(quota))
            elif d.parent == self.root:  # v2: the controller must be on for the root's children
                with contextlib.suppress(OSError):
                    (self.root / "cgroup.subtree_control").write_text("+cpu")
                (d / "cpu.max").write_text(f"{quota} {period}")

    def procs_files(self) -> tuple[Path, ...]:
        """The files a process writes its pid to in order to join."""
        return tuple(d / "cgroup.procs" for d in self.dirs if d.exists())

    def pids(self) -> set[int]:
        """Every process in the cgroup or below it."""
        found: set[int] = set()
        for d in self.dirs:
            if not d.exists():
                continue
            for procs in d.rglob("cgroup.procs"):
                with contextlib.suppress(FileNotFoundError):
                    found.update(int(x) for x in procs.read_text().split())
        return found

    def memory_bytes(self) -> int | None:
        """Memory charged to the cgroup (v1 ``memory.usage_in_bytes`` or v2 ``memory.current``)."""
        for d in self.dirs:
            for name in ("memory.usage_in_bytes", "memory.current"):
                with contextlib.suppress(FileNotFoundError):
                    return int((d / name).read_text())
        return None

    def exists(self) -> bool:
        """True while any of the directories exists."""
        return any(d.exists() for d in self.dirs)

    def remove(self, grace_s: float = 5.0) -> None:
        """Kill what is left inside (SIGKILL: its owners had their SIGTERM), then rmdir, deepest first."""
        deadline = time.monotonic() + max(grace_s, 1.0)
        while pids := self.pids():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {sorted(pids)} stay in {self.dirs} after SIGKILL")
            time.sleep(0.05)
        for d in self.dirs:
            if not d.exists():
                continue
            for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                sub.rmdir()
            d.rmdir()
