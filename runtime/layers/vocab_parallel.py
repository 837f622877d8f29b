"""The embedding and the LM head split by vocabulary rows across tensor-parallel ranks.

As vLLM's ``VocabParallelEmbedding`` and ``ParallelLMHead`` do it: the vocabulary is padded
to a multiple of the rank count and each rank holds one run of ``padded / size`` rows (the
last rank's tail is padding, zeros that no token id reaches). The embedding looks up the ids
that fall in its rows, writes zeros for the others, and one all-reduce sums the ranks' rows
into every token's embedding (exactly: each sum has one term that is not zero). The LM head
multiplies the hidden states by its rows, giving this rank's columns of the logits; rank 0,
which samples, gathers them and drops the padding, so sampling and structured output see the
model's whole vocabulary and nothing else. A tied head is the embedding's own shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.runtime.layers.parallel import SINGLE, Shard, TensorParallel


@dataclass(frozen=True)
class VocabSplit:
    """The vocabulary rows one rank holds."""

    vocab_size: int
    """The model's vocabulary (the logits' width on rank 0)."""
    start: int
    """This rank's first row (a token id)."""
    rows: int
    """Rows this rank holds: the padded vocabulary over the ranks, the same on every rank."""
    loaded: int
    """Of ``rows``, those a checkpoint fills; the rest (the last rank's tail) are padding."""

    @classmethod
    def of(cls, vocab_size: int, tp: TensorParallel = SINGLE) -> VocabSplit:
        rows = -(-vocab_size // tp.size)  # the vocabulary padded to a multiple of the ranks
        start = tp.rank * rows
        return cls(vocab_size, start, rows, max(0, min(rows, vocab_size - start)))

    @property
    def shard(self) -> Shard:
        """The checkpoint's rows this rank loads (the embedding's, and an untied LM head's)."""
        return Shard(0, self.start, self.loaded)


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` over this rank's vocabulary rows; the output is the whole embedding."""

    def __init__(self, hidden_size: int, split: VocabSplit, tp: TensorParallel = SINGLE):
        super().__init__()
        self.split, self.tp = split, tp
        self.weight = nn.Parameter(torch.empty(split.rows, hidden_size), requires_grad=False)
        self.weight.data[split.loaded :].zero_()  # the padding: no checkpoint row lands there

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (T,) -> (T, hidden)."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.split.start  # (T,) row in this shard, where it is in it
        outside = (local < 0) | (local >= self.split.rows)  # (T,) ids other ranks hold
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # (T, hidden)
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(x)


def gather_logits(
    local: torch.Tensor, split: VocabSplit, tp: TensorParallel
) -> torch.Tensor | None:
    """This rank's logits (N, rows) -> the model's (N, vocab) float32 on rank 0; None on the
    others (only rank 0 samples, so the others send theirs and keep nothing)."""
    local = local.float()
    if tp.size == 1:
        return local
    parts = tp.gather(local)
    if parts is None:
        return None
    return torch.cat(parts, dim=-1)[:, : split.vocab_size]  # (N, vocab), the padding dropped
