"""Gemma's gated MLP activation, gelu_tanh(gate) * up, in one pass over the merged projection."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from conveyor.runtime.kernels.silu_and_mul import launch_gated

SQRT_2_OVER_PI = tl.constexpr(math.sqrt(2 / math.pi))  # a kernel reads only constexpr globals


@triton.jit
def _gelu_tanh_and_mul_kernel(x_ptr, out_ptr, stride_x, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + N + offs, mask=mask).to(tl.float32)
    # gelu_tanh(x) = x (1 + tanh(u)) / 2 with u = sqrt(2/pi) (x + 0.044715 x^3), and
    # (1 + tanh(u)) / 2 = sigmoid(2u): one exp and no tanh (``tl`` has none). The exp is of
    # -2|u|, in (0, 1], so that it cannot overflow (the interpreter's numpy would warn).
    u = SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
    e = tl.exp(-2.0 * tl.abs(u))
    sigmoid_2u = tl.where(u >= 0, 1.0, e) / (1.0 + e)
    # Round gelu(gate) to the activation dtype first, as the unfused ops do.
    act = (gate * sigmoid_2u).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * N + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up`` (T, 2 * I) -> (T, I): ``F.gelu(gate, approximate="tanh") * up``."""
    return launch_gated(_gelu_tanh_and_mul_kernel, gate_up)
