"""Rotary position embeddings (rotate-half layout), applied to q and k in place."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    h = tl.arange(0, BLOCK_H)
    # The tables hold cat(freqs, freqs): the first half serves both halves.
    c = tl.load(cos_ptr + pos * stride_cos + d, mask=d < HALF)[None, :]  # (1, BLOCK_HALF) float32
    s = tl.load(sin_ptr + pos * stride_cos + d, mask=d < HALF)[None, :]
    for which in tl.static_range(2):  # q, then k
        x_ptr = q_ptr + t * stride_qt if which == 0 else k_ptr + t * stride_kt
        stride_h = stride_qh if which == 0 else stride_kh
        num_heads = NUM_Q_HEADS if which == 0 else NUM_KV_HEADS
        first = x_ptr + h[:, None] * stride_h + d[None, :]  # (BLOCK_H, BLOCK_HALF)
        mask = (h[:, None] < num_heads) & (d[None, :] < HALF)
        x1 = tl.load(first, mask=mask).to(tl.float32)
        x2 = tl.load(first + HALF, mask=mask).to(tl.float32)
        tl.store(first, (x1 * c - x2 * s).to(x_ptr.dtype.element_ty), mask=mask)
        tl.store(first + HALF, (x2 * c + x1 * s).to(x_ptr.dtype.element_ty), mask=mask)


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` (T, Hq, D) and ``k`` (T, Hkv, D) in place at ``positions`` (T,).

    ``cos``/``sin`` are the float32 tables (max_position, D); returns (q, k).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0:
        return q, k
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.is_contiguous() and sin.is_contiguous()
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        cos,
        sin,
        positions,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        BLOCK_H=triton.next_power_of_2(max(num_q_heads, num_kv_heads)),
        BLOCK_HALF=triton.next_power_of_2(half),
    )
    return q, k
