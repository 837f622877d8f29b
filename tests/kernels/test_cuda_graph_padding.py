"""What a decode CUDA graph computes, checked without a GPU.

A graph replays exactly the forward it captured over its static buffers. So
running that forward eagerly over the buffers, staged as ``DecodeCudaGraphs``
stages a real batch (on CPU: the Triton kernels in the interpreter), checks
what padding could break: padded slots write no KV, and the real rows come
out as they do unpadded. Capture and replay themselves run on a GPU
(``test_cuda_graphs_greedy_equals_torch``, ``bench/gpu.sh``).
"""

from __future__ import annotations

import torch

from conveyor.runtime import LLM
from conveyor.runtime.engine.cuda_graphs import DecodeCudaGraphs
from conveyor.runtime.engine.scheduler import ScheduledBatch
from conveyor.runtime.engine.sequence import Sequence
from conveyor.runtime.sampling_params import SamplingParams


def _decode_batch(context_lens: list[int], block_size: int) -> ScheduledBatch:
    seqs, next_block = [], 0
    for i, n in enumerate(context_lens):
        seq = Sequence(f"s{i}", list(range(1, n + 1)), n - 1, SamplingParams(), arrival_time=0.0)
        seq.num_computed_tokens = n - 1
        blocks = -(-n // block_size)
        seq.block_table = list(range(next_block + blocks - 1, next_block - 1, -1))  # scattered
        next_block += blocks
        seqs.append(seq)
    return ScheduledBatch(seqs=seqs, num_new_tokens=[1] * len(seqs), num_decodes=len(seqs))


@torch.inference_mode()
def test_padded_static_forward_equals_unpadded(device):
    llm = LLM(
        "conveyor-tiny",
        attention_backend="triton",
        device=device.type,
        dtype="float32",
        max_total_tokens=1024,
        max_running_requests=8,
    )
    runner = llm.engine.runner
    runner.kv_cache.normal_(generator=torch.Generator(device=device).manual_seed(0))  # a context
    graphs = DecodeCudaGraphs(runner.model, max_batch=8, max_blocks_per_seq=16, device=device)

    # A batch of 4 first, so that the batch of 3 finds a stale row to pad over.
    for lens in ([5, 17, 33, 40], [16, 2, 9]):
        batch = _decode_batch(lens, runner.block_size)
        input_ids, positions, meta, _ = runner._prepare(batch)
        before = runner.kv_cache.clone()
        expected = runner.model(input_ids, positions, runner.kv_cache, meta)  # (n, hidden)
        written = runner.kv_cache.clone()
        runner.kv_cache.copy_(before)

        size = graphs.stage(input_ids, positions, meta)
        n = len(lens)
        assert size == 4
        assert graphs.slot_mapping[n:size].eq(-1).all() and graphs.context_lens[n:size].eq(0).all()
        hidden = runner.model(
            graphs.input_ids[:size],
            graphs.positions[:size],
            runner.kv_cache,
            graphs.static_meta(size),
        )  # (size, hidden)
        torch.testing.assert_close(hidden[:n], expected)
        assert torch.isfinite(hidden).all()
        # The real tokens' K/V as unpadded (a matmul over 4 rows instead of 3 may round
        # differently), and not one other slot touched.
        torch.testing.assert_close(runner.kv_cache, written)
        others = torch.ones(
            runner.kv_cache[0, 0].shape[:2], dtype=torch.bool
        )  # (blocks, block_size)
        others.view(-1)[meta.slot_mapping.cpu()] = False
        assert torch.equal(runner.kv_cache[:, :, others], before[:, :, others]), (
            "a padded slot wrote"
        )
