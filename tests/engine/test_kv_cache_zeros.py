"""The KV cache's zeros: on a CPU from fresh anonymous pages, the same zeros as ``torch.zeros``
without writing every byte before the server is ready; as those pages are taken only when
used, a cache over the container's memory limit is refused at start."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from conveyor.runtime.engine import platform
from conveyor.runtime.engine.model_runner import zeros
from conveyor.runtime.engine.platform import check_memory_for, memory_limit_bytes, resident_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_zeros_are_zeros_that_outlive_their_pages_object(dtype: torch.dtype) -> None:
    shape = (2, 2, 3, 16, 2, 8)
    cache = zeros(shape, dtype, torch.device("cpu"))
    gc.collect()  # the pages stay mapped while the tensor lives
    assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
    assert torch.equal(cache, torch.zeros(shape, dtype=dtype))
    cache[1, 0, 2] = 1.5
    assert cache.sum().item() == 1.5 * 16 * 2 * 8
    assert cache.data_ptr() % 64 == 0  # page-aligned, for the vectorised kernels


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
