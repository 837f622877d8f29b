"""Piecewise CUDA graphs: steps that hold a prefill, launched a graph per layer.

A decode step is captured whole (``cuda_graphs.py``), but a step that holds a prefill
chunk cannot be: its attention's work depends on how many sequences it holds and how long
each chunk is. Everything else in the forward pass depends only on how many tokens the
step has. So, as vLLM does, the forward pass is cut at each layer's attention
(``LlamaForCausalLM.begin``/``between``/``finish``) and each piece is captured once per
token count in ``token_buckets``; a step runs the pieces' graphs with the attention
launched eagerly between them. On a GPU a Python launch costs tens of microseconds, so
a 16-layer step goes from about 350 launches to 17 replays and the attention's few.

A step's tokens are padded up to the next captured count. Every piece works row by row
(projections, norms, rotary, MLP), so the padded rows, which hold whatever the last step
left there, affect nothing; attention runs on the real rows only. Each piece reads its
inputs from, and copies its outputs into, buffers shared by every piece and every
bucket, so the graphs' memory is a step's activations, not one copy per piece.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from conveyor.runtime.layers.attention_metadata import AttentionMetadata

if TYPE_CHECKING:
    from conveyor.runtime.model.llama import LlamaForCausalLM


def token_buckets(max_tokens: int, smallest: int = 16) -> list[int]:
    """16, 24, 32, 48, 64, 96, ...: powers of two and the halfway points between them (a
    step is padded by under half), below ``max_tokens``, then ``max_tokens`` itself (no
    step is longer: a bigger bucket would only take memory from the KV cache)."""
    sizes, size = [], smallest
    while size < max_tokens:
        sizes += [s for s in (size, size * 3 // 2) if s < max_tokens]
        size *= 2
    return [*sizes, max(max_tokens, 1)]


class Graph(Protocol):
    """What a piece is captured into: ``torch.cuda.CUDAGraph`` on a GPU."""

    def capture(self, fn: Callable[[], None]) -> None: ...

    def replay(self) -> None: ...


class CudaGraph:
    """One piece as a CUDA graph; every piece's graph shares one memory pool."""

    def __init__(self, pool: Any) -> None:  # torch.cuda.graph_pool_handle()
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], None]) -> None:
        fn()  # warm-up: compiles the kernels for this size, settles the allocator
        with torch.cuda.graph(self.graph, pool=self.pool):
            fn()

    def replay(self) -> None:
        self.graph.replay()


class PiecewiseCudaGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        max_tokens: int,
        device: torch.device,
        dtype: torch.dtype,
        new_graph: Callable[[object], Graph] | None = None,
    ) -> None:
        """``new_graph(pool)``: how a piece is captured (a CUDA graph; tests replay the
        pieces' Python on a CPU to check the buffers' plumbing)."""
        self.model = model
        self.sizes = token_buckets(max_tokens)
        self.device = device
        self.new_graph = new_graph or CudaGraph
        self.graphs: dict[int, list[Graph]] = {}
        """Per bucket: begin, between(1..L-1), finish."""
        self.replays = 0
        """Steps run through the graphs (the GPU bench checks that mixed steps do)."""
        s, n = model.shape, self.sizes[-1]

        def buffer(*shape: int, kind: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(n, *shape, dtype=kind, device=device)

        self.input_ids = buffer(kind=torch.int64)
        self.positions = buffer(kind=torch.int64)
        self.q = buffer(s.num_heads, s.head_dim)
        self.k = buffer(s.num_kv_heads, s.head_dim)
        self.v = buffer(s.num_kv_heads, s.head_dim)
        self.o = buffer(s.num_heads, s.head_dim)
        self.residual = buffer(s.hidden_size)
        self.hidden = buffer(s.hidden_size)

    def can_run(self, num_tokens: int) -> bool:
        return bool(self.graphs) and 0 < num_tokens <= self.sizes[-1]

    # -- the pieces, on the first ``t`` rows of the buffers ---------------------------------

    def _keep(
        self, t: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, residual: torch.Tensor
    ) -> None:
        self.q[:t].copy_(q)
        self.k[:t].copy_(k)
        self.v[:t].copy_(v)
        self.residual[:t].copy_(residual)

    def _pieces(self, t: int) -> list[Callable[[], None]]:
        model, positions = self.model, self.positions[:t]

        def begin() -> None:
            self._keep(t, *model.begin(self.input_ids[:t], positions))

        def between(i: int) -> Callable[[], None]:
            def piece() -> None:
                self._keep(t, *model.between(i, self.o[:t], self.residual[:t], positions))

            return piece

        def finish() -> None:
            self.hidden[:t].copy_(model.finish(self.o[:t], self.residual[:t]))

        return [begin, *(between(i) for i in range(1, len(model.layers))), finish]

    # -- capture and run ------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every piece at every size, largest first. The pieces hold no KV cache:
        a reallocated cache needs no new capture."""
        self.graphs.clear()
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        for t in sorted(self.sizes, reverse=True):
            graphs = []
            for i, piece in enumerate(self._pieces(t)):
                graph = self.new_graph(pool)
                try:
                    graph.capture(piece)
                except RuntimeError as exc:
                    raise RuntimeError(
                        f"capturing piece {i} of a {t}-token step's CUDA graphs failed "
                        f"({exc}); --enforce-eager runs without CUDA graphs"
                    ) from exc
                graphs.append(graph)
            self.graphs[t] = graphs
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def measure(self) -> int:
        """Bytes the pieces' memory pool takes: the largest size captured once, then
        released (smaller sizes reuse the pool; the buffers are the caller's to count)."""
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_reserved(self.device)
        sizes, self.sizes = self.sizes, self.sizes[-1:]
        try:
            self.capture()
        finally:
            self.sizes = sizes
        used = torch.cuda.memory_reserved(self.device) - before
        self.graphs.clear()
        torch.cuda.empty_cache()
        return max(0, used)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The forward pass over ``n`` tokens -> hidden (n, hidden): a view of a buffer the
        next step overwrites."""
        n = input_ids.shape[0]
        t = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        graphs = self.graphs[t]
        graphs[0].replay()
        q, k, v, o = self.q[:n], self.k[:n], self.v[:n], self.o[:n]
        for i, graph in enumerate(graphs[1:]):
            self.model.attend(i, q, k, v, kv_caches, meta, out=o)
            graph.replay()
        self.replays += 1
        return self.hidden[:n]
