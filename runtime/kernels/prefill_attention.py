"""Paged attention for prefill: each chunk of new tokens against its sequence's cached prefix.

A chunk of ``q_len`` tokens ends at context length ``ctx`` (cached prefix +
chunk); query ``i`` sits at position ``ctx - q_len + i`` and sees every key up
to and including its own, so attention is causal inside the chunk and full
over the prefix. Keys and values are read from the paged cache, where the
step's own tokens were written first. One program per (tile of queries,
sequence, query head), with an online softmax over tiles of keys. With a sliding window
(``window`` > 0) query ``i`` sees only the keys ``pos - window + 1 .. pos`` of its position
``pos``: a tile's loop starts at its first query's window. Soft-capped scores (``softcap`` > 0)
compile a kernel of their own, as in ``decode_attention.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.runtime.kernels.decode_attention import soft_cap

BLOCK_M = 64  # queries per program
BLOCK_N = 64  # keys per tile


@triton.jit(do_not_specialize=["window"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_ptr,
    context_lens_ptr,
    out_ptr,
    scale,
    softcap,
    stride_qt,
    stride_qh,
    stride_bt,
    stride_slot,
    stride_ot,
    stride_oh,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    ctx = tl.load(context_lens_ptr + seq)

    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the chunk
    d = tl.arange(0, BLOCK_D)
    i_mask = i < q_len
    d_mask = d < HEAD_DIM
    q_pos = ctx - q_len + i  # (BLOCK_M,) position of each query in its sequence
    q = tl.load(
        q_ptr + (q_start + i)[:, None].to(tl.int64) * stride_qt + head * stride_qh + d[None, :],
        mask=i_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # (BLOCK_M, BLOCK_D)
    if DOT_FP32:
        q = q.to(tl.float32)

    # Keys past this tile's last query are masked for every row: stop there. A tile
    # wholly past the chunk has no keys to read. Keys before its first query's window are
    # masked for every row: start at the tile of keys that holds the first one seen.
    last = tl.minimum(ctx - q_len + (tile + 1) * BLOCK_M, ctx)
    end = tl.where(tile * BLOCK_M < q_len, last, 0)
    first_pos = ctx - q_len + tile * BLOCK_M
    begin = tl.where(window > 0, tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N, 0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for n0 in range(begin, end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)  # key positions
        t_mask = t < end
        block = tl.load(block_tables_ptr + seq * stride_bt + t // PAGE_SIZE, mask=t_mask, other=0)
        slot = block.to(tl.int64) * PAGE_SIZE + t % PAGE_SIZE
        kv_off = slot[:, None] * stride_slot + kv_head * HEAD_DIM + d[None, :]  # (BLOCK_N, BLOCK_D)
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BLOCK_M, BLOCK_N)
        if SOFTCAP:  # before the mask: a capped -inf would be -softcap, a weight > 0
            s = soft_cap(s, softcap)
        seen = (t[None, :] <= q_pos[:, None]) & t_mask[None, :]
        seen &= (window <= 0) | (t[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        # A row whose window starts after this tile has seen no key yet: its max stays -inf,
        # and is taken as 0 so that its weights come out 0, not NaN.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + (q_start + i)[:, None].to(tl.int64) * stride_ot + head * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=i_mask[:, None] & d_mask[None, :],
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q (T, Hq, D): the chunks back to back; caches (num_blocks, block_size, Hkv, D) already
    holding the chunks' K/V; block_tables (P, max_blocks) int32; query_start_loc (P + 1,) int32;
    context_lens (P,) int32 = cached prefix + chunk -> (T, Hq, D). ``window`` > 0: a query
    sees only the last ``window`` positions up to its own. ``softcap`` > 0: each score ``s``
    becomes ``softcap * tanh(s / softcap)``."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    num_seqs = context_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    assert (
        q.stride(2) == 1
        and out.stride(2) == 1
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )
    assert softcap >= 0, f"softcap {softcap}: 0 (none) or a positive cap"
    dot_fp32 = q.device.type == "cpu" and q.dtype == torch.bfloat16  # see decode_attention.py
    grid = (triton.cdiv(max_query_len, BLOCK_M), num_seqs, num_q_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        context_lens,
        out,
        scale,
        softcap,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        k_cache.stride(1),
        out.stride(0),
        out.stride(1),
        window,
        GROUP=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_D=max(triton.next_power_of_2(head_dim), 16),
        SOFTCAP=softcap > 0,
        DOT_FP32=dot_fp32,
        PRECISION="ieee" if q.dtype == torch.float32 or dot_fp32 else None,
        num_warps=4,
        num_stages=2,
    )
    return out
