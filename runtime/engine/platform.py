"""What this process may use: its CPU limit (cgroup quota), so thread pools fit it."""

from __future__ import annotations

import math
import os


def cpu_limit() -> int:
    """Cores this process may use: the cgroup CPU quota if any, else its affinity mask."""
    cores = len(os.sched_getaffinity(0))
    quota = _cgroup_quota()
    return max(1, min(cores, math.ceil(quota))) if quota else cores


def _cgroup_quota() -> float | None:
    try:  # cgroup v2: "max 100000" or "50000 100000"
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    for base in ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct"):
        try:  # cgroup v1
            with open(f"{base}/cpu.cfs_quota_us") as f:
                quota_us = int(f.read())
            with open(f"{base}/cpu.cfs_period_us") as f:
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
