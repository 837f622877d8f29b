"""Linear layers on CPU with weights prepacked for oneDNN, for every step of two rows or more.

oneDNN's matmul on a weight reordered once into its blocked layout beats torch's ``F.linear``
on the plain weight (MKL's sgemm) for decode steps everywhere it was measured (2 Sapphire
Rapids cores, float32, SmolLM2's shapes: 1.35x at 32 rows, the LM head 1.5-2.7x), and on
AMD CPUs for prefill chunks too, where MKL takes a slower path than oneDNN's AVX-512 kernels
(2 Zen 4 cores, 2,048 rows: 1.6-2.8x per layer; on Sapphire Rapids the two were level
there). For one row (a lone decode, a matrix-vector product bound by reading the weight) the
plain matmul is as fast or faster. So each linear keeps both and picks by the number of rows.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("conveyor.runtime")

PACKED_MIN_ROWS = 2
"""Rows (tokens in the step) from which the packed weight is used."""


def packing_supported(dtype: torch.dtype) -> bool:
    return (
        dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x (rows, in), on ``packed`` from two rows up."""
    if packed is not None and x.shape[0] >= PACKED_MIN_ROWS:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose forward also has the weight in oneDNN's layout."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = pack(linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.weight, self.packed, self.bias)


def expert_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s experts' weights (what ``pack_experts`` copies)."""
    from conveyor.runtime.layers.moe import SparseMoeBlock

    return sum(b.w13.nbytes + b.w2.nbytes for b in model.modules() if isinstance(b, SparseMoeBlock))


def pack_experts(model: nn.Module) -> int:
    """Pack every expert of ``model``'s mixture-of-experts layers (``layers/moe.py``), for
    the CPU kernel's experts with many tokens; returns how many weights."""
    from conveyor.runtime.layers.moe import SparseMoeBlock

    count = 0
    for block in model.modules():
        if isinstance(block, SparseMoeBlock) and packing_supported(block.w13.dtype):
            block.packed = ([pack(w) for w in block.w13], [pack(w) for w in block.w2])
            count += 2 * block.w13.shape[0]
    return count


def pack_linear_layers(model: nn.Module) -> int:
    """Replace every 2-D-input ``nn.Linear`` of ``model`` by a ``PackedLinear``; returns how
    many. A layer whose weight oneDNN cannot reorder is left as it is."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and packing_supported(child.weight.dtype):
                try:
                    setattr(parent, name, PackedLinear(child))
                    count += 1
                except RuntimeError as exc:
                    log.info("not packing %s for oneDNN (%s)", name, exc)
    return count
