"""What a process may use, read from its own cgroup (v1 or v2) or, inside a container, the
hierarchy's root: its CPU quota (thread pools fit it) and its memory limit (a KV cache that
cannot fit is refused at start)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.runtime.engine import platform
from conveyor.runtime.engine.platform import (
    cgroup_cpu_quota,
    check_memory_for,
    memory_limit_bytes,
    resident_bytes,
)


def _cgroup(tmp_path: Path, proc: str, files: dict[str, str]) -> tuple[str, str]:
    (tmp_path / "cgroup").write_text(proc)
    for name, text in files.items():
        (tmp_path / "fs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / name).write_text(text)
    return str(tmp_path / "cgroup"), str(tmp_path / "fs")


@pytest.mark.parametrize(
    ("proc", "files", "limit"),
    [
        ("0::/pod/c\n", {"pod/c/memory.max": "1073741824\n"}, 1 << 30),
        ("0::/pod/c\n", {"pod/c/memory.max": "max\n"}, None),
        (
            "4:memory:/kubepods/p/c\n1:cpu,cpuacct:/x\n",
            {"memory/kubepods/p/c/memory.limit_in_bytes": "536870912\n"},
            1 << 29,
        ),
        # v1 inside a container: its path is the host's, its hierarchy's root is its own.
        ("4:memory:/kubepods/p/c\n", {"memory/memory.limit_in_bytes": "268435456\n"}, 1 << 28),
        ("4:memory:/\n", {"memory/memory.limit_in_bytes": "9223372036854771712\n"}, None),
        ("0::/\n", {}, None),
    ],
)
def test_the_memory_limit_is_read_from_the_process_own_cgroup(
    tmp_path: Path, proc: str, files: dict[str, str], limit: int | None
) -> None:
    assert memory_limit_bytes(*_cgroup(tmp_path, proc, files)) == limit


def test_a_kv_cache_over_the_memory_limit_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its pages are taken only as blocks fill: without the check, the container would be
    OOM-killed under load with requests in flight."""
    room = 64 << 20
    monkeypatch.setattr(platform, "memory_limit_bytes", lambda: resident_bytes() + room)
    check_memory_for("the KV cache", room // 2, "lower it")
    with pytest.raises(ValueError, match=r"the KV cache \(0\.12 GiB\) does not fit .*: lower it"):
        check_memory_for("the KV cache", 2 * room, "lower it")
    monkeypatch.setattr(platform, "memory_limit_bytes", lambda: None)
    check_memory_for("the KV cache", 1 << 50, "lower it")


@pytest.mark.parametrize(
    ("proc", "files", "quota"),
    [
        ("0::/pod/c\n", {"pod/c/cpu.max": "25000 100000\n"}, 0.25),
        ("0::/pod/c\n", {"pod/c/cpu.max": "max 100000\n"}, None),
        # a bench's cgroup of its own, on a v1 host
        (
            "3:cpu:/conveyor/pods/u/main\n",
            {
                "cpu/conveyor/pods/u/main/cpu.cfs_quota_us": "20000\n",
                "cpu/conveyor/pods/u/main/cpu.cfs_period_us": "100000\n",
            },
            0.2,
        ),
        # v1 inside a container: its path is the host's, its hierarchy's root is its own.
        (
            "3:cpu,cpuacct:/kubepods/p/c\n",
            {
                "cpu,cpuacct/cpu.cfs_quota_us": "50000\n",
                "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
            },
            0.5,
        ),
        ("3:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ("0::/\n", {}, None),
    ],
)
def test_the_cpu_quota_is_read_from_the_process_own_cgroup(
    tmp_path: Path, proc: str, files: dict[str, str], quota: float | None
) -> None:
    assert cgroup_cpu_quota(*_cgroup(tmp_path, proc, files)) == quota
