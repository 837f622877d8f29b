"""The gated MLP's activation: silu(gate) * up over a merged gate_up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    use_triton = False
    """Run the fused Triton kernel (set by the model runner with the triton backend)."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gate_up`` (num_tokens, 2 * intermediate) -> (num_tokens, intermediate)."""
        if self.use_triton:
            from conveyor.runtime.kernels.silu_and_mul import silu_and_mul

            return silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
