"""RMSNorm, optionally fused with the residual add that precedes it.

Llama's norm rounds the normalised x to the activation dtype, then scales it by its weight
(in that dtype). Gemma's scales by ``1 + weight`` in float32 and rounds once: its norms keep
a float32 weight (``1 + weight``, offset at load), which every kernel reads as "scale in
float32, round once" -- in float32 models the two are the same. OLMo 2/3's norms scale in
float32 and round once too (a float32 weight, no offset).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

RmsNormKernel = Callable[
    [torch.Tensor, torch.Tensor, float, torch.Tensor | None],
    torch.Tensor | tuple[torch.Tensor, torch.Tensor],
]
"""(x, weight, eps, residual | None) -> out, or (out, x + residual) with a residual."""


class RMSNorm(nn.Module):
    kernel: RmsNormKernel | None = None
    """A fused kernel with this forward's signature (``layers/fused.py``); None = torch."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        """``dtype``: the weight's (float32 for Gemma's); None: the model's."""
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x`` (..., hidden). With ``residual``: returns (norm(x + residual), x + residual)."""
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.eps, residual)
        return self.reference(x, self.weight, self.eps, residual)

    @staticmethod
    def reference(
        x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The torch reference of ``forward``."""
        if residual is not None:
            x = x + residual
            residual = x
        xf = x.float()
        out = RMSNorm.scaled(
            xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps), weight, x.dtype
        )
        return out if residual is None else (out, residual)

    @staticmethod
    def scaled(normed: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The float32 normalised rows times the weight, in ``dtype``: Llama's rounds the rows
        first, a float32 weight beside half-precision rows (Gemma's, OLMo's) rounds once."""
        if weight.dtype == torch.float32 and dtype != torch.float32:
            return (weight * normed).to(dtype)
        return weight * normed.to(dtype)
