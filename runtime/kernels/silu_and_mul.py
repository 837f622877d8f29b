"""The gated MLP's activation, silu(gate) * up, in one pass over the merged projection."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + N + offs, mask=mask).to(tl.float32)
    # Round silu(gate) to the activation dtype first, as the unfused ops do.
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * N + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up`` (T, 2 * I) -> (T, I)."""
    return launch_gated(_silu_and_mul_kernel, gate_up)


def launch_gated(kernel, gate_up: torch.Tensor) -> torch.Tensor:
    """Run a gated activation's ``kernel`` (this file's signature) over ``gate_up`` (T, 2 * I)
    -> (T, I): one program per row and block of columns."""
    num_tokens, n = gate_up.shape[0], gate_up.shape[1] // 2
    assert gate_up.stride(1) == 1
    out = torch.empty((num_tokens, n), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens:
        block = min(triton.next_power_of_2(n), 1024)
        kernel[(num_tokens, triton.cdiv(n, block))](
            gate_up, out, gate_up.stride(0), N=n, BLOCK=block, num_warps=4
        )
    return out
