"""Write one step's new keys and values into the paged KV cache: one kernel for all tokens."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_vt,
    ROW: tl.constexpr,  # num_kv_heads * head_dim: one token's K (or V) row
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)  # -1 = padding: nothing is written
    offs = tl.arange(0, BLOCK)
    mask = offs < tl.where(slot >= 0, ROW, 0)
    k = tl.load(k_ptr + t * stride_kt + offs, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v, mask=mask)


def store_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Scatter K/V (T, Hkv, D) into caches (num_blocks, block_size, Hkv, D) at ``slots`` (T,).

    Each token's heads must be contiguous (a view of the fused qkv projection is);
    the token stride may be anything.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    row = num_kv_heads * head_dim
    assert k.stride(2) == 1 and k.stride(1) == head_dim, "each token's K heads must be contiguous"
    assert v.stride(2) == 1 and v.stride(1) == head_dim, "each token's V heads must be contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    block = triton.next_power_of_2(row)
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slots,
        k.stride(0),
        v.stride(0),
        ROW=row,
        BLOCK=block,
        num_warps=4 if block <= 2048 else 8,
    )
