"""A benchmark's child limited to a share of the CPUs (``ChildProcess(cpu_limit=...)``), as a
pod's ``limits.cpu``: its own cgroup with a CFS quota while it runs, nothing left after it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from conveyor.bench.gateway.settings import BenchSettings, replica_cpu_limit
from conveyor.bench.procs import ChildProcess
from conveyor.cluster.cgroups import ClusterCgroup


def _writable_cgroups() -> bool:
    dirs = ClusterCgroup("probe").dirs
    return os.geteuid() == 0 and bool(dirs) and all(os.access(d.parent, os.W_OK) for d in dirs)


@pytest.mark.skipif(not _writable_cgroups(), reason="needs root and a writable cgroup hierarchy")
def test_a_limited_child_runs_in_its_own_quota_and_leaves_no_cgroup() -> None:
    child = ChildProcess(
        "spin",
        lambda port: [sys.executable, "-c", "while True: pass"],
        ready_path=None,
        cpu_limit=0.25,
    )
    child.start()
    try:
        cgroup = ClusterCgroup(f"bench-spin-{child.pid}")
        assert child.pid in cgroup.pids()
        cpu = [
            d for d in cgroup.dirs if (d / "cpu.cfs_quota_us").exists() or (d / "cpu.max").exists()
        ]
        assert cpu, cgroup.dirs
        quota = cpu[0] / "cpu.cfs_quota_us"
        if quota.exists():
            assert int(quota.read_text()) == 25_000
            assert int((cpu[0] / "cpu.cfs_period_us").read_text()) == 100_000
        else:
            assert (cpu[0] / "cpu.max").read_text().split() == ["25000", "100000"]
    finally:
        child.stop()
    assert not cgroup.exists()
    assert not any(Path(d).exists() for d in cgroup.dirs)


def test_replica_cpus_default_shares_out_most_of_the_machine() -> None:
    assert replica_cpu_limit(BenchSettings(replicas=4), cpus=2) == 0.4
    assert replica_cpu_limit(BenchSettings(replicas=4), cpus=16) == 1.0
    assert replica_cpu_limit(BenchSettings(replicas=4, replica_cpus=0.3), cpus=2) == 0.3
    assert replica_cpu_limit(BenchSettings(replicas=4, replica_cpus=-1), cpus=2) is None
