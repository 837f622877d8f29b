"""CUDA graphs for decode steps: one launch instead of a few hundred kernel launches.

A decode step of a large model is a few hundred small kernels; launching them
one by one from Python costs more than running them at small batch sizes. So
the model's forward over a decode-only batch is captured once per batch size
in ``capture_sizes`` (after a warm-up run that compiles the Triton kernels),
all graphs sharing one memory pool, and replayed with the step's inputs
copied into static buffers. A batch is padded up to the next captured size:
padded slots have context length 0 and slot -1, so they write nothing and
attend to nothing. Only the Triton backend is captured: its decode path reads
no host copy of the lengths, so one graph serves every context length.
Sampling stays outside the graph.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch

from conveyor.runtime.layers.attention_metadata import AttentionMetadata

if TYPE_CHECKING:
    from conveyor.runtime.model.llama import LlamaForCausalLM


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, then multiples of 8, up to the first of them that holds ``max_batch``."""
    candidates = [1, 2, 4, *range(8, max_batch + 8, 8)]
    top = next(s for s in candidates if s >= max_batch)
    return [s for s in candidates if s <= top]


def padded_size(batch: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``batch``, or None (run eagerly)."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


class DecodeCudaGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        max_batch: int,
        max_blocks_per_seq: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.sizes = capture_sizes(max_batch)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        n, dev = self.sizes[-1], device
        # Static inputs: every graph reads its leading rows.
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)

    def can_run(self, num_decodes: int, num_tokens: int) -> bool:
        return bool(self.graphs) and num_decodes == num_tokens and num_decodes <= self.sizes[-1]

    def static_meta(self, batch: int) -> AttentionMetadata:
        """The metadata a graph of ``batch`` sequences is captured with: views of the buffers."""
        empty = torch.zeros(0, dtype=torch.int32, device=self.device)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            num_decode_tokens=batch,
            decode_context_lens=self.context_lens[:batch],
            decode_block_tables=self.block_tables[:batch],
            prefill_query_start_loc=torch.zeros(1, dtype=torch.int32, device=self.device),
            prefill_context_lens=empty,
            prefill_block_tables=empty.view(0, 0),
        )

    @torch.inference_mode()
    def capture(self, kv_cache: torch.Tensor, sizes: list[int] | None = None) -> None:
        """Capture the decode forward at each size, largest first, against ``kv_cache``
        (the graphs hold its address: capture again if the cache is reallocated)."""
        self.graphs.clear()
        pool = None
        for batch in sorted(sizes or self.sizes, reverse=True):
            args = (
                self.input_ids[:batch],
                self.positions[:batch],
                kv_cache,
                self.static_meta(batch),
            )
            self.model(*args)  # warm-up: compiles the kernels, settles allocator state
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool):
                    hidden = self.model(*args)  # (batch, hidden)
            except RuntimeError as exc:
                raise RuntimeError(
                    f"capturing the decode step's CUDA graph at batch size {batch} failed "
                    f"({exc}); --enforce-eager runs without CUDA graphs"
                ) from exc
            pool = graph.pool()
            self.graphs[batch] = (graph, hidden)
        torch.cuda.synchronize(self.device)

    def measure(self, kv_cache: torch.Tensor) -> int:
        """Bytes the graphs' memory pool takes: the largest size captured once against a
        temporary cache, then released. Smaller graphs reuse the same pool."""
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_reserved(self.device)
        self.capture(kv_cache, sizes=[self.sizes[-1]])
        used = torch.cuda.memory_reserved(self.device) - before
        self.graphs.clear()
        torch.cuda.empty_cache()
        return max(0, used)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Replay the graph for a decode-only batch of ``n`` sequences -> hidden (n, hidden)."""
        batch = self.stage(input_ids, positions, meta)
        graph, hidden = self.graphs[batch]
        graph.replay()
        return hidden[: input_ids.shape[0]]

    def stage(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> int:
        """Copy a decode batch of ``n`` into the static inputs, padded up to the next captured
        size, and return that size: padded slots write nothing (slot -1) and attend to nothing
        (context length 0)."""
        n = input_ids.shape[0]
        batch = padded_size(n, self.sizes)
        assert batch is not None
        width = meta.decode_block_tables.shape[1]
        assert width <= self.max_blocks_per_seq
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[n:batch].fill_(-1)
        self.context_lens[:n].copy_(meta.decode_context_lens, non_blocking=True)
        self.context_lens[n:batch].zero_()
        self.block_tables[:n, :width].copy_(meta.decode_block_tables, non_blocking=True)
        return batch
