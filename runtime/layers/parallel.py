"""Tensor parallelism: which slice of each weight a rank holds, and the all-reduce that joins them.

Megatron's split of a decoder layer, as vLLM and SGLang run it: the q/k/v and gate/up
projections are column-parallel (each rank computes its own attention heads and its own
columns of the MLP, no communication), the output and down projections are row-parallel
(each rank multiplies its slice of the input by its rows of the weight, and one all-reduce
sums the partial results). Two all-reduces a layer. KV heads are split like the query heads
when their count divides by the ranks; with fewer KV heads than ranks (grouped-query
attention) each rank keeps the one KV head its query heads read, so a KV head is held by
``size / num_kv_heads`` ranks. The embedding and the LM head are split by vocabulary rows
(``vocab_parallel.py``); the norms are replicated.

A bias of a row-parallel projection is added once: rank 0 holds it and every other rank
holds zeros, so the all-reduce's sum carries it exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


class Collectives(Protocol):
    """What the layers need from the ranks' communication (``engine/tensor_parallel.py``)."""

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum ``x`` over the ranks, in place."""

    def gather(self, parts: list[torch.Tensor], x: torch.Tensor) -> None:
        """Every rank's ``x`` into ``parts`` on rank 0 (``parts`` empty on the others)."""

    def abort(self) -> None:
        """Make a waiting collective fail (a peer is gone); a no-op where a closed socket
        already does that."""


class ProcessGroupCollectives:
    """A torch process group's own collectives (NCCL)."""

    def __init__(self, group: Any) -> None:  # a ProcessGroupNCCL (a torch backend object)
        self.group = group

    def all_reduce(self, x: torch.Tensor) -> None:
        self.group.allreduce([x]).wait()

    def gather(self, parts: list[torch.Tensor], x: torch.Tensor) -> None:
        self.group.gather(parts, x, 0).wait()

    def abort(self) -> None:
        pass


@dataclass(frozen=True)
class TensorParallel:
    """This process's place among the ranks of one replica."""

    rank: int = 0
    size: int = 1
    group: Collectives | None = None
    """The ranks' own collectives (``engine/tensor_parallel.py``); None at size 1."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it (as is at size 1)."""
        if self.group is not None:
            self.group.all_reduce(x)
        return x

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``x`` (all of one shape), in rank order, on rank 0; None on the others."""
        if self.group is None:
            return [x]
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else []
        self.group.gather(parts, x)
        return parts if self.rank == 0 else None


SINGLE = TensorParallel()
"""One rank: nothing is split, nothing communicated."""


@dataclass(frozen=True)
class Shard:
    """The part of a checkpoint tensor one rank loads: ``size`` entries from ``start`` along
    ``dim``; ``zero``: a tensor of zeros of the full shape (a row-parallel bias off rank 0)."""

    dim: int
    start: int
    size: int
    zero: bool = False

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This shard of the whole tensor."""
        if self.zero:
            return torch.zeros_like(tensor)
        return tensor.narrow(self.dim, self.start, self.size)


@dataclass(frozen=True)
class HeadSplit:
    """How a model's heads and MLP columns fall to one rank."""

    num_heads: int
    """Query heads on this rank."""
    head_start: int
    num_kv_heads: int
    """KV heads on this rank (1 when the model has fewer KV heads than ranks)."""
    kv_head_start: int
    intermediate_size: int
    """MLP columns on this rank."""
    intermediate_start: int

    @classmethod
    def of(
        cls, num_heads: int, num_kv_heads: int, intermediate_size: int, tp: TensorParallel
    ) -> HeadSplit:
        """ValueError, with the numbers, when the model cannot be split ``tp.size`` ways."""
        check_split(num_heads, num_kv_heads, intermediate_size, tp.size)
        n, r = tp.size, tp.rank
        if num_kv_heads % n == 0:
            kv, kv_start = num_kv_heads // n, r * (num_kv_heads // n)
        else:  # fewer KV heads than ranks: size / num_kv_heads ranks share each one
            kv, kv_start = 1, r // (n // num_kv_heads)
        heads, inter = num_heads // n, intermediate_size // n
        return cls(heads, r * heads, kv, kv_start, inter, r * inter)


def check_split(num_heads: int, num_kv_heads: int, intermediate_size: int, size: int) -> None:
    """Refuse a tensor-parallel size the model's shape does not divide by, saying why."""
    if size < 1:
        raise ValueError(f"tensor parallel size must be at least 1, got {size}")
    if size == 1:
        return
    fits = [
        n for n in range(1, num_heads + 1) if _fits(num_heads, num_kv_heads, intermediate_size, n)
    ]
    sizes = ", ".join(map(str, fits))
    if num_heads % size:
        raise ValueError(
            f"--tensor-parallel-size {size} does not divide the model's {num_heads} attention "
            f"heads; sizes this model can run: {sizes}"
        )
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(
            f"--tensor-parallel-size {size} and the model's {num_kv_heads} KV heads: one must "
            f"divide the other; sizes this model can run: {sizes}"
        )
    if intermediate_size % size:
        raise ValueError(
            f"--tensor-parallel-size {size} does not divide the model's MLP width "
            f"{intermediate_size}; sizes this model can run: {sizes}"
        )


def _fits(num_heads: int, num_kv_heads: int, intermediate_size: int, size: int) -> bool:
    return (
        num_heads % size == 0
        and (num_kv_heads % size == 0 or size % num_kv_heads == 0)
        and intermediate_size % size == 0
    )
