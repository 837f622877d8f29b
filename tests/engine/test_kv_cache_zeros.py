"""The KV cache's zeros: on a CPU from fresh anonymous pages, the same zeros as ``torch.zeros``
without writing every byte before the server is ready (as those pages are taken only when
used, a cache over the container's memory limit is refused at start: test_platform_limits)."""

from __future__ import annotations

import gc

import pytest
import torch

from conveyor.runtime.engine.model_runner import zeros


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
