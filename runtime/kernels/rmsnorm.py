"""RMSNorm fused with the residual add before it: one read of x and residual, one write each."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_res,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ROUND_NORMED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0).to(tl.float32)
        # Round the sum to the activation dtype, as the unfused add does, before normalising it.
        summed = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * N + offs, summed, mask=mask)
        x = summed.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    normed = x * rstd
    if ROUND_NORMED:  # Llama's norm rounds x to its dtype before the weight; Gemma's does not
        normed = normed.to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + row * N + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x`` (..., N). With ``residual``: returns (norm(x + residual), x + residual). A float32
    ``weight`` beside a half-precision ``x`` scales in float32 and rounds once (Gemma's)."""
    shape, n = x.shape, x.shape[-1]
    x2 = x.reshape(-1, n)  # (rows, N); a copy only when the rows are not evenly strided
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    res2: torch.Tensor | None = None
    res_out: torch.Tensor | None = None
    if residual is not None:
        res2 = residual.reshape(-1, n)
        if res2.stride(-1) != 1:
            res2 = res2.contiguous()
        res_out = torch.empty_like(out)
    if rows:
        block = triton.next_power_of_2(n)
        _rmsnorm_kernel[(rows,)](
            x2,
            res2 if res2 is not None else x2,
            weight,
            out,
            res_out if res_out is not None else out,
            x2.stride(0),
            res2.stride(0) if res2 is not None else 0,
            eps,
            N=n,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            ROUND_NORMED=weight.dtype == x.dtype,
            num_warps=min(max(block // 256, 1), 16),
        )
    if res_out is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)
