"""What this process may use: its CPU limit (cgroup quota), so thread pools fit it, and its
memory limit, so a KV cache that cannot fit is refused at start."""

from __future__ import annotations

import math
import os


def cpu_limit() -> int:
    """Cores this process may use: the cgroup CPU quota if any, else its affinity mask."""
    cores = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota()
    return max(1, min(cores, math.ceil(quota))) if quota else cores


def cgroup_dirs(
    controller: str, proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup"
) -> list[str]:
    """Where this process's cgroup files for ``controller`` may be, its own cgroup first (a
    process a bench put in a cgroup of its own sees the host's hierarchy),
    then the hierarchy's root (inside a container, the container's own cgroup)."""
    dirs = []
    try:  # "0::/path" (v2) or "4:memory:/path", "3:cpu,cpuacct:/path" (v1)
        with open(proc_cgroup) as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":
                    dirs.append(f"{root}/{path.lstrip('/')}".rstrip("/"))
                elif controller in controllers.split(","):
                    dirs.append(f"{root}/{controllers}/{path.lstrip('/')}".rstrip("/"))
    except (OSError, ValueError):
        pass
    return [*dirs, root, f"{root}/{controller}", f"{root}/cpu,cpuacct"]


def cgroup_cpu_quota(
    proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup"
) -> float | None:
    """This process's CPU quota in cores (its own cgroup's, else its container's), or None."""
    for d in cgroup_dirs("cpu", proc_cgroup, root):
        try:  # cgroup v2: "max 100000" or "50000 100000"
            with open(f"{d}/cpu.max") as f:
                quota, period = f.read().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        except (OSError, ValueError):
            pass
        try:  # cgroup v1
            with open(f"{d}/cpu.cfs_quota_us") as f:
                quota_us = int(f.read())
            with open(f"{d}/cpu.cfs_period_us") as f:
                period_us = int(f.read())
        except (OSError, ValueError):
            continue
        return None if quota_us <= 0 else quota_us / period_us
    return None


def configure_threads(requested: int | None, ranks: int = 1) -> int:
    """Size torch's intra-op pool to the CPU limit (or the requested count), shared evenly
    by ``ranks`` tensor-parallel processes (at least one thread each); returns one rank's."""
    import torch

    threads = max(1, (requested or cpu_limit()) // ranks)
    torch.set_num_threads(threads)
    return threads


_NO_LIMIT = 1 << 60
"""cgroup v1 writes "no limit" as a page-rounded 2**63 - 1."""


def memory_limit_bytes(
    proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup"
) -> int | None:
    """This process's cgroup memory limit (its own cgroup's, else its container's), or None."""
    for d in cgroup_dirs("memory", proc_cgroup, root):
        for name in ("memory.max", "memory.limit_in_bytes"):  # v2, v1
            try:
                with open(f"{d}/{name}") as f:
                    text = f.read().strip()
            except OSError:
                continue
            if text == "max":
                return None
            limit = int(text)
            return None if limit >= _NO_LIMIT else limit
    return None


def physical_memory_bytes() -> int:
    """The machine's memory (where no cgroup limits this process's)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resident_bytes() -> int:
    """This process's anonymous resident memory: what the kernel cannot reclaim under a memory
    limit (the mapped libraries and weights files it can drop and read again)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def check_memory_for(what: str, nbytes: int, fix: str) -> None:
    """Refuse, saying what to change, ``nbytes`` more than this process's memory limit allows:
    memory the kernel gives on first touch (a KV cache's pages) would otherwise be found
    missing under load, when the container is OOM-killed with requests in flight."""
    limit = memory_limit_bytes()
    if limit is None:
        return
    resident = resident_bytes()
    if resident + nbytes > limit:
        gib = 1 << 30
        raise ValueError(
            f"{what} ({nbytes / gib:.2f} GiB) does not fit in this container's memory limit "
            f"({limit / gib:.2f} GiB, {resident / gib:.2f} GiB of it already taken): {fix}"
        )
