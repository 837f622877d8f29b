"""A container's cgroups, below the cluster's: its CPU and memory limits, its accounting, its end.

cgroup v1 (the ``cpu``, ``cpuacct`` and ``memory`` hierarchies, as on the build machines) or
v2 (one unified hierarchy, ``cpu.max`` and ``memory.max``). Directories are
``<hierarchy>/conveyor-<cluster>/pods/<pod uid>/<container>``; the container's process
sees its own directories at ``/sys/fs/cgroup/...`` (the shim mounts them there), so the
runtime reads its CPU limit from ``/sys/fs/cgroup/cpu/cpu.cfs_quota_us`` as in a container.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from conveyor.cluster.cgroups import CGROUP_ROOT

CFS_PERIOD_US = 100_000
"""The CFS period a kubelet uses (100 ms)."""


def is_v2(root: Path = CGROUP_ROOT) -> bool:
    """True where only the unified hierarchy is mounted."""
    return not (root / "cpu" / "cgroup.procs").exists() and (root / "cgroup.controllers").exists()


class ContainerCgroup:
    """The cgroup directories of one container of one pod."""

    def __init__(
        self, cluster: str, pod_uid: str, container: str, *, root: Path = CGROUP_ROOT
    ) -> None:
        self.v2 = is_v2(root)
        rel = Path(f"conveyor-{cluster}") / "pods" / pod_uid / container
        if self.v2:
            self.dirs = {"unified": root / rel}
        else:
            self.dirs = {
                h: root / h / rel
                for h in ("memory", "cpu", "cpuacct")
                if (root / h / "cgroup.procs").exists()
            }

    def create(self, *, cpu_cores: float | None, memory_bytes: int | None) -> None:
        """Make the directories and set the limits (no limit: unlimited)."""
        for d in self.dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        if self.v2:
            d = self.dirs["unified"]
            parent = d.parent
            for p in (parent.parent.parent, parent.parent, parent):
                with contextlib.suppress(OSError):
                    (p / "cgroup.subtree_control").write_text("+cpu +memory")
            quota = "max" if cpu_cores is None else str(max(1000, int(cpu_cores * CFS_PERIOD_US)))
            (d / "cpu.max").write_text(f"{quota} {CFS_PERIOD_US}")
            (d / "memory.max").write_text("max" if memory_bytes is None else str(memory_bytes))
            return
        if "cpu" in self.dirs:
            cfs_quota = -1 if cpu_cores is None else max(1000, int(cpu_cores * CFS_PERIOD_US))
            (self.dirs["cpu"] / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
            (self.dirs["cpu"] / "cpu.cfs_quota_us").write_text(str(cfs_quota))
        if "memory" in self.dirs:
            limit = -1 if memory_bytes is None else memory_bytes
            (self.dirs["memory"] / "memory.limit_in_bytes").write_text(str(limit))

    def procs_files(self) -> list[str]:
        """The files the container's process writes its pid to."""
        return [str(d / "cgroup.procs") for d in self.dirs.values()]

    def oom_counter(self) -> str | None:
        """The file holding the OOM-kill count."""
        if self.v2:
            return str(self.dirs["unified"] / "memory.events")
        return str(self.dirs["memory"] / "memory.oom_control") if "memory" in self.dirs else None

    def mounts(self) -> list[tuple[str, str]]:
        """(host directory, path in the container) pairs: the container sees its own cgroups."""
        if self.v2:
            return [(str(self.dirs["unified"]), "/sys/fs/cgroup")]
        out = [(str(d), f"/sys/fs/cgroup/{h}") for h, d in self.dirs.items()]
        if "cpu" in self.dirs and "cpuacct" in self.dirs:
            for combined in ("cpu,cpuacct", "cpuacct,cpu"):
                if (CGROUP_ROOT / combined).exists() and not (CGROUP_ROOT / combined).is_symlink():
                    out.append((str(self.dirs["cpu"]), f"/sys/fs/cgroup/{combined}"))
        return out

    def cpu_usage_s(self) -> float | None:
        """CPU time the container's processes used, in seconds (cpuacct or ``cpu.stat``)."""
        if self.v2:
            for line in (self.dirs["unified"] / "cpu.stat").read_text().splitlines():
                if line.startswith("usage_usec "):
                    return int(line.split()[1]) / 1e6
            return None
        if "cpuacct" in self.dirs:
            return int((self.dirs["cpuacct"] / "cpuacct.usage").read_text()) / 1e9
        return None

    def pids(self) -> set[int]:
        """Processes in the container's cgroups."""
        found: set[int] = set()
        for d in self.dirs.values():
            with contextlib.suppress(FileNotFoundError):
                found.update(int(x) for x in (d / "cgroup.procs").read_text().split())
        return found

    def kill(self, timeout_s: float = 10.0) -> None:
        """SIGKILL every process left in the cgroups and wait until they are gone."""
        deadline = time.monotonic() + timeout_s
        while pids := self.pids():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"processes {sorted(pids)} survive SIGKILL in {list(self.dirs.values())}"
                )
            time.sleep(0.02)

    def remove(self) -> None:
        """Kill what is inside, then remove the container's directories (and the pod's when empty)."""
        self.kill()
        for d in self.dirs.values():
            if d.exists():
                d.rmdir()
            with contextlib.suppress(OSError):
                d.parent.rmdir()


def remove_pod_cgroups(cluster: str, pod_uid: str, *, root: Path = CGROUP_ROOT) -> None:
    """Remove every container cgroup of a pod (after killing what is inside)."""
    hierarchies = [root] if is_v2(root) else [root / h for h in ("memory", "cpu", "cpuacct")]
    for h in hierarchies:
        pod_dir = h / f"conveyor-{cluster}" / "pods" / pod_uid
        if not pod_dir.exists():
            continue
        for sub in pod_dir.iterdir():
            if sub.is_dir():
                ContainerCgroup(cluster, pod_uid, sub.name, root=root).remove()
        with contextlib.suppress(FileNotFoundError):
            pod_dir.rmdir()


def sweep_pod_cgroups(cluster: str, *, root: Path = CGROUP_ROOT) -> None:
    """Remove the cgroups of every pod of the cluster, and the ``pods`` directories themselves."""
    hierarchies = [root] if is_v2(root) else [root / h for h in ("memory", "cpu", "cpuacct")]
    for h in hierarchies:
        pods = h / f"conveyor-{cluster}" / "pods"
        if pods.exists():
            for pod_dir in pods.iterdir():
                if pod_dir.is_dir():
                    remove_pod_cgroups(cluster, pod_dir.name, root=root)
            pods.rmdir()
        base = h / f"conveyor-{cluster}"
        if h.name == "cpuacct" and base.exists() and not any(p.is_dir() for p in base.iterdir()):
            base.rmdir()
