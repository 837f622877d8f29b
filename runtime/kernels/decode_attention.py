"""Paged attention for decode: one query token per sequence against its cached context.

Split-KV ("flash decoding"): stage 1 gives each (sequence, KV head, split) its
own program, which attends the group of query heads sharing that KV head to
one slice of the context and writes a normalised partial output and its
log-sum-exp; stage 2 merges the splits. Splitting keeps the GPU busy when
the batch is small and the contexts long. The number of splits depends only
on the batch size and the device, never on context lengths, so a captured
CUDA graph stays valid as sequences grow; it is a runtime argument, so batch
sizes that split differently share one compiled kernel. A sliding window (``window`` > 0)
splits only the last ``window`` tokens of each context; it is a runtime argument too.
Soft-capped scores (``softcap`` > 0, Gemma 2) compile a kernel of their own (``SOFTCAP``), so
the uncapped one is unchanged; the cap itself is a runtime argument.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # keys per tile
MAX_SPLITS = 32  # stage 2 reads this many (masked) partial results per head


@triton.jit
def soft_cap(s, softcap):
    """``softcap * tanh(s / softcap)``, Gemma 2's attention-logit soft-capping. ``tl`` has no
    tanh (libdevice's is per backend), so it is built from one exp of a non-positive number,
    which cannot overflow, for any score (the interpreter's numpy would warn)."""
    e = tl.exp(-2.0 / softcap * tl.abs(s))  # in (0, 1]
    t = (1.0 - e) / (1.0 + e)  # tanh(|s| / softcap)
    return tl.where(s < 0, -t, t) * softcap


@triton.jit(do_not_specialize=["num_splits", "window"])
def _decode_stage1_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    o_part_ptr,
    lse_ptr,
    scale,
    softcap,
    stride_qt,
    stride_qh,
    stride_bt,
    stride_slot,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    num_splits,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + b)
    first = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)  # the window's first key
    per_split = (ctx - first + num_splits - 1) // num_splits
    per_split = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N  # whole tiles
    start = first + split * per_split
    end = tl.minimum(start + per_split, ctx)

    g = tl.arange(0, BLOCK_H)  # query heads of this KV head's group (padded to >= 16 for tl.dot)
    d = tl.arange(0, BLOCK_D)
    head = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # (BLOCK_H, BLOCK_D)
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    for n0 in range(start, end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)  # token positions in the context
        t_mask = t < end
        block = tl.load(block_tables_ptr + b * stride_bt + t // PAGE_SIZE, mask=t_mask, other=0)
        slot = block.to(tl.int64) * PAGE_SIZE + t % PAGE_SIZE  # (BLOCK_N,)
        kv_off = slot[:, None] * stride_slot + kv_head * HEAD_DIM + d[None, :]  # (BLOCK_N, BLOCK_D)
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BLOCK_H, BLOCK_N)
        if SOFTCAP:  # before the mask: a capped -inf would be -softcap, a weight > 0
            s = soft_cap(s, softcap)
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # An empty split (its slice starts past the context) leaves l_i == 0: weight 0 in stage 2.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]  # (BLOCK_H, BLOCK_D)
    lse = tl.where(l_i > 0, m_i + tl.log(l_safe), float("-inf"))
    tl.store(
        o_part_ptr + b * stride_ob + head[:, None] * stride_oh + split * stride_os + d[None, :],
        out,
        mask=g_mask[:, None] & d_mask[None, :],
    )
    tl.store(lse_ptr + b * stride_lb + head * stride_lh + split, lse, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_stage2_kernel(
    o_part_ptr,
    lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_outt,
    stride_outh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    lse = tl.load(lse_ptr + b * stride_lb + head * stride_lh + s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # context length 0 (a padded batch slot)
    w = tl.exp(lse - m)  # (BLOCK_S,)
    o = tl.load(
        o_part_ptr + b * stride_ob + head * stride_oh + s[:, None] * stride_os + d[None, :],
        mask=s_mask[:, None] & (d[None, :] < HEAD_DIM),
        other=0.0,
    )  # (BLOCK_S, BLOCK_D)
    total = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + b * stride_outt + head * stride_outh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def default_num_splits(batch_size: int, num_kv_heads: int, device: torch.device) -> int:
    """Enough (sequence, KV head, split) programs to fill the GPU about four times over."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_SPLITS, triton.cdiv(4 * sms, batch_size * num_kv_heads)))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q (B, Hq, D); caches (num_blocks, block_size, Hkv, D); block_tables (B, max_blocks) int32;
    context_lens (B,) int32, 0 for a padded slot (its output is zeros) -> (B, Hq, D).
    ``window`` > 0: each query sees only the last ``window`` tokens of its context.
    ``softcap`` > 0: each score ``s`` becomes ``softcap * tanh(s / softcap)``."""
    batch, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    assert (
        q.stride(2) == 1
        and out.stride(2) == 1
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )
    assert softcap >= 0, f"softcap {softcap}: 0 (none) or a positive cap"
    splits = num_splits or default_num_splits(batch, num_kv_heads, q.device)
    assert 1 <= splits <= MAX_SPLITS
    o_part = torch.empty(batch, num_q_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, num_q_heads, splits, dtype=torch.float32, device=q.device)
    # The interpreter's bf16 tl.dot is wrong (numpy has no bf16): run those dots in fp32 there.
    dot_fp32 = q.device.type == "cpu" and q.dtype == torch.bfloat16
    block_d = max(triton.next_power_of_2(head_dim), 16)
    _decode_stage1_kernel[(batch, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        o_part,
        lse,
        scale,
        softcap,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        k_cache.stride(1),
        o_part.stride(0),
        o_part.stride(1),
        o_part.stride(2),
        lse.stride(0),
        lse.stride(1),
        splits,
        window,
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_H=max(triton.next_power_of_2(group), 16),
        BLOCK_N=BLOCK_N,
        BLOCK_D=block_d,
        SOFTCAP=softcap > 0,
        DOT_FP32=dot_fp32,
        PRECISION="ieee" if q.dtype == torch.float32 or dot_fp32 else None,
        num_warps=4,
        num_stages=2,
    )
    _decode_stage2_kernel[(batch, num_q_heads)](
        o_part,
        lse,
        out,
        o_part.stride(0),
        o_part.stride(1),
        o_part.stride(2),
        lse.stride(0),
        lse.stride(1),
        out.stride(0),
        out.stride(1),
        splits,
        HEAD_DIM=head_dim,
        BLOCK_S=MAX_SPLITS,
        BLOCK_D=block_d,
        num_warps=1 if block_d <= 64 else 2,
    )
    return out
