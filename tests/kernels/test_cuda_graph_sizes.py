"""Which decode batch sizes get a CUDA graph, and how a batch is padded to one."""

from __future__ import annotations

import pytest

from conveyor.runtime.engine.cuda_graphs import capture_sizes, padded_size


def test_capture_sizes_cover_the_running_cap():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(5) == [1, 2, 4, 8]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(100)[-1] == 104


@pytest.mark.parametrize("max_batch", [1, 5, 32, 100, 256])
def test_every_batch_pads_to_the_smallest_captured_size_that_holds_it(max_batch):
    sizes = capture_sizes(max_batch)
    for batch in range(1, max_batch + 1):
        size = padded_size(batch, sizes)
        assert size is not None and size >= batch
        assert all(s < batch for s in sizes if s < size)
    assert padded_size(sizes[-1] + 1, sizes) is None
