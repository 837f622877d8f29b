"""RMSNorm, optionally fused with the residual add that precedes it."""

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

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

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
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        out = weight * xf.to(dtype)
        return out if residual is None else (out, residual)
