"""The gated MLP's activations over a merged gate_up projection: silu(gate) * up (Llama,
Qwen, Mistral, Phi-3) and gelu_tanh(gate) * up (Gemma's ``gelu_pytorch_tanh``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

SiluAndMulKernel = Callable[[torch.Tensor], torch.Tensor]
"""(gate_up) -> silu(gate) * up."""
GeluAndMulKernel = Callable[[torch.Tensor], torch.Tensor]
"""(gate_up) -> gelu_tanh(gate) * up, GELU's tanh approximation."""


class SiluAndMul(nn.Module):
    kernel: SiluAndMulKernel | None = None
    """A fused kernel with this forward's signature (``layers/fused.py``); None = torch."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gate_up`` (num_tokens, 2 * intermediate) -> (num_tokens, intermediate)."""
        if self.kernel is not None:
            return self.kernel(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    kernel: GeluAndMulKernel | None = None
    """A fused kernel with this forward's signature (``layers/fused.py``); None = torch."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gate_up`` (num_tokens, 2 * intermediate) -> (num_tokens, intermediate)."""
        if self.kernel is not None:
            return self.kernel(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
