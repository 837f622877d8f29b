"""What the piecewise CUDA graphs compute, checked without a GPU.

A graph replays the work its piece did while captured, on the same buffers. So
replaying each piece's Python instead (``RerunGraph``) checks everything but
the capture itself: the buffers each piece reads and fills, the padding up to a
bucket, the attention between pieces on the real rows only. Capture and replay
run on a GPU (``bench/gpu.sh``: the engine's greedy output with graphs against
the torch backend's).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from conveyor.runtime import LLM
from conveyor.runtime.engine.piecewise_graphs import PiecewiseCudaGraphs, token_buckets
from conveyor.runtime.engine.scheduler import ScheduledBatch
from conveyor.runtime.engine.sequence import Sequence
from conveyor.runtime.sampling_params import SamplingParams


class RerunGraph:
    """A piece "captured" as its Python, run again at each replay."""

    def __init__(self, pool) -> None:
        self.fn: Callable[[], None] | None = None

    def capture(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def replay(self) -> None:
        assert self.fn is not None
        self.fn()


def _mixed_batch(decode_lens: list[int], chunks: list[tuple[int, int]], bs: int) -> ScheduledBatch:
    """Decodes at context ``decode_lens``, then prefill chunks (cached, new) tokens."""
    seqs, new, next_block = [], [], 0
    for i, (done, n) in enumerate([(c - 1, 1) for c in decode_lens] + chunks):
        total = done + n
        seq = Sequence(f"s{i}", list(range(3, total + 3)), total, SamplingParams(), 0.0)
        seq.num_computed_tokens = done
        blocks = -(-total // bs)
        seq.block_table = list(range(next_block + blocks - 1, next_block - 1, -1))  # scattered
        next_block += blocks
        seqs.append(seq)
        new.append(n)
    return ScheduledBatch(seqs=seqs, num_new_tokens=new, num_decodes=len(decode_lens))


def test_token_buckets_pad_by_under_half_and_hold_the_budget():
    assert token_buckets(64) == [16, 24, 32, 48, 64]
    assert token_buckets(2048)[-1] == 2048 and token_buckets(2049)[-2:] == [2048, 2049]
    assert token_buckets(100) == [16, 24, 32, 48, 64, 96, 100]
    sizes = token_buckets(4096)
    assert all(a < b <= 1.5 * a for a, b in itertools.pairwise(sizes))
    assert token_buckets(3) == [3]


@torch.inference_mode()
def test_pieces_with_attention_between_equal_the_forward_pass(device):
    llm = LLM(
        "conveyor-tiny",
        attention_backend="triton",
        device=device.type,
        dtype="float32",
        max_total_tokens=2048,
        max_running_requests=8,
    )
    runner = llm.engine.runner
    runner.kv_cache.normal_(generator=torch.Generator(device=device).manual_seed(0))  # a context
    graphs = PiecewiseCudaGraphs(runner.model, 64, device, runner.dtype, new_graph=RerunGraph)
    graphs.capture()
    assert sorted(graphs.graphs) == [16, 24, 32, 48, 64]
    assert all(len(g) == len(runner.model.layers) + 1 for g in graphs.graphs.values())

    # 40 tokens first (bucket 48), so that the 21 after it (bucket 24) pad over stale rows.
    for decodes, chunks in (([9, 30, 17], [(0, 20), (16, 17)]), ([5, 40, 2], [(0, 7), (32, 11)])):
        batch = _mixed_batch(decodes, chunks, runner.block_size)
        input_ids, positions, meta, _ = runner._prepare(batch)
        before = runner.kv_cache.clone()
        expected = runner.model(input_ids, positions, runner.kv_cache, meta)  # (n, hidden)
        written = runner.kv_cache.clone()
        runner.kv_cache.copy_(before)

        assert graphs.can_run(len(input_ids))
        hidden = graphs.run(input_ids, positions, runner.kv_cache, meta)
        torch.testing.assert_close(hidden, expected)
        # The real tokens' K/V as the forward pass wrote them, and no other slot touched.
        torch.testing.assert_close(runner.kv_cache, written)
        others = torch.ones(runner.kv_cache[0, 0].shape[:2], dtype=torch.bool)
        others.view(-1)[meta.slot_mapping.cpu()] = False
        assert torch.equal(runner.kv_cache[:, :, others], before[:, :, others]), (
            "a padded row wrote"
        )
    assert graphs.replays == 2
    assert not graphs.can_run(65) and not graphs.can_run(0)
