"""Fused kernels for the decoder's elementwise layers, chosen per engine with its backend.

RMSNorm (with the residual add), rotary embeddings, SiLU- or GELU-and-mul and the experts of a
mixture-of-experts MLP run the torch reference
unless a backend hands the model faster kernels with the same signatures: Triton's on GPU
(``runtime/kernels/``), the C++ ops on CPU (``runtime/kernels/cpu/``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from conveyor.runtime.layers.activation import (
    GeluAndMul,
    GeluAndMulKernel,
    SiluAndMul,
    SiluAndMulKernel,
)
from conveyor.runtime.layers.layernorm import RMSNorm, RmsNormKernel
from conveyor.runtime.layers.moe import FusedMoEKernel, SparseMoeBlock
from conveyor.runtime.layers.rotary import RotaryEmbedding, RotaryKernel


@dataclass(frozen=True)
class LayerKernels:
    rms_norm: RmsNormKernel
    """(x, weight, eps, residual | None) -> out, or (out, x + residual) with a residual."""
    apply_rotary: RotaryKernel
    """(positions, q, k, cos, sin) -> (q, k), rotated (in place or not)."""
    silu_and_mul: SiluAndMulKernel
    """(gate_up) -> silu(gate) * up."""
    gelu_tanh_and_mul: GeluAndMulKernel | None = None
    """(gate_up) -> gelu_tanh(gate) * up (Gemma); None: the torch reference."""
    fused_moe: FusedMoEKernel | None = None
    """(block, x, topk_weights, topk_ids) -> the routed experts' sum (Mixtral, Qwen-MoE);
    None: the torch path (``layers/moe.py``)."""


def use_fused_layers(model: nn.Module, kernels: LayerKernels) -> None:
    """Switch the model's RMSNorm, rotary and SiLU/GELU-and-mul layers to ``kernels``."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.kernel = kernels.rms_norm
        elif isinstance(module, RotaryEmbedding):
            module.kernel = kernels.apply_rotary
        elif isinstance(module, SiluAndMul):
            module.kernel = kernels.silu_and_mul
        elif isinstance(module, GeluAndMul) and kernels.gelu_tanh_and_mul is not None:
            module.kernel = kernels.gelu_tanh_and_mul
        elif isinstance(module, SparseMoeBlock) and kernels.fused_moe is not None:
            module.kernel = kernels.fused_moe
