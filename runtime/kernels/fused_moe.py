"""A mixture-of-experts MLP: each token through its top-k experts' gated MLPs, weighted and summed.

The T * k (token, choice) pairs, the *slots*, are sorted by expert and each
expert's group is padded to a multiple of ``BLOCK_M`` (``sort_slots_by_expert``),
so that a block of ``BLOCK_M`` sorted rows belongs to one expert. A grouped GEMM
then gives each block one program per tile of output columns: it reads the
block's expert id and its slots' rows, and multiplies them by that expert's
weights. Three kernels: the gate/up GEMM into (T * k, 2I), the gated
activation (``silu_and_mul`` / ``gelu_tanh_and_mul``) into (T * k, I), the down
GEMM into (T * k, H), scaled by each slot's routing weight; a sum over the k
choices gives (T, H). The same idea as vLLM's ``fused_moe``.

Graph-safe: nothing reads the routing on the host. The sort is done with
torch ops on the device, and every intermediate and grid has a size fixed by
T, k, E and ``BLOCK_M`` (a bound on the padded total, never the total itself):
blocks past the last expert's group exit at once, and padding rows are masked.
So one call can be captured in a CUDA graph and replayed with any routing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.runtime.kernels.gelu_and_mul import gelu_tanh_and_mul
from conveyor.runtime.kernels.silu_and_mul import silu_and_mul

ACTIVATIONS = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}
# Weight tiles of 64 output columns by 32 of the reduction: the weights are the large read
# (a block has few rows), and 4 warps' tensor-core dots on 64 x 32 tiles, 3 stages deep,
# stay in a few KiB of shared memory on sm_80/sm_90 (vLLM's untuned default for large
# batches is the same 64 x 32).
BLOCK_N = 64
BLOCK_K = 32


def block_m_for(num_slots: int, num_experts: int) -> int:
    """Rows per block: about the average group, ``num_slots / num_experts``, in 16..64. A
    block is padded up to ``BLOCK_M`` rows for every expert picked, so decode (a few slots
    per expert) wants small blocks; prefill wants large ones, each weight tile reused by
    more rows. ``tl.dot`` needs at least 16."""
    return min(max(triton.next_power_of_2(-(-num_slots // num_experts)), 16), 64)


def sort_slots_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids (T, k) -> sorted_slots (num_blocks * block_m,) int32, block_experts
    (num_blocks,) int32, with num_blocks fixed by T * k, E and ``block_m``.

    ``sorted_slots`` holds each slot ``t * k + j`` once, grouped by expert in expert order
    (by slot inside a group), each group padded with ``T * k`` to a multiple of ``block_m``;
    ``block_experts[b]`` is the expert of rows ``b * block_m ..``, or ``num_experts`` for a
    block past the last group. Device ops only, no host sync."""
    flat = topk_ids.reshape(-1).long()  # (S,) the expert of each slot
    num_slots = flat.shape[0]
    # Each picked expert pads at most block_m - 1 rows, and at most min(E, S) are picked.
    num_blocks = triton.cdiv(num_slots + min(num_experts, num_slots) * (block_m - 1), block_m)

    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # (E,) bincount, which syncs on CUDA
    padded = (counts + block_m - 1) // block_m * block_m  # (E,)
    padded_end = padded.cumsum(0)  # (E,)
    group_start = counts.cumsum(0) - counts  # (E,) each group's first index in sorted order
    experts, order = torch.sort(flat, stable=True)  # (S,), (S,)
    rank = torch.arange(num_slots, device=flat.device) - group_start.index_select(0, experts)
    dest = (padded_end - padded).index_select(0, experts) + rank  # (S,) row in sorted_slots
    sorted_slots = torch.full(
        (num_blocks * block_m,), num_slots, dtype=torch.int32, device=flat.device
    ).scatter_(0, dest, order.int())
    block_start = torch.arange(num_blocks, device=flat.device) * block_m  # (num_blocks,)
    block_experts = torch.searchsorted(padded_end, block_start, right=True, out_int32=True)
    return sorted_slots, block_experts


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    topk_weights_ptr,
    sorted_slots_ptr,
    block_experts_ptr,
    num_slots,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    N: tl.constexpr,
    K: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    SLOTS_PER_ROW: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """out[slot, n] = a[slot // SLOTS_PER_ROW] . w[expert, n] for a block's slots and a tile
    of n, rounded to a's dtype; ``WEIGHTED``: times the slot's routing weight, in float32."""
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert >= NUM_EXPERTS:  # past the last group: padding only
        return
    slots = tl.load(sorted_slots_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # (BLOCK_M,)
    slot_mask = slots < num_slots  # False on a group's padding rows
    rows = (slots // SLOTS_PER_ROW).to(tl.int64)  # a's row: the token, or the slot itself
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + k[None, :]  # (BLOCK_M, BLOCK_K)
    w_ptrs = (
        w_ptr + expert.to(tl.int64) * stride_we + n[None, :].to(tl.int64) * stride_wn + k[:, None]
    )  # (BLOCK_K, BLOCK_N): the tile of w[expert] transposed

    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k < K - k0
        a = tl.load(a_ptrs, mask=slot_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    out = acc.to(a_ptr.dtype.element_ty)  # the GEMM's result in the activation dtype
    if WEIGHTED:
        weight = tl.load(topk_weights_ptr + slots, mask=slot_mask, other=0.0)  # (BLOCK_M,)
        out = out.to(tl.float32) * weight[:, None]
    tl.store(
        out_ptr + slots.to(tl.int64)[:, None] * stride_om + n[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=slot_mask[:, None] & n_mask[None, :],
    )


def moe_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    sorted_slots: torch.Tensor,
    block_experts: torch.Tensor,
    block_m: int,
    slots_per_row: int,
    topk_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """a (S / slots_per_row, K), w (E, N, K), out (S, N) -> out: row s of out is a's row
    ``s // slots_per_row`` times the transpose of w[expert of s], rounded to a's dtype;
    ``topk_weights`` (S,) float32: then times ``topk_weights[s]`` (out float32).
    ``sorted_slots`` and ``block_experts`` from ``sort_slots_by_expert(.., block_m)``."""
    num_slots, n = out.shape
    num_experts, _, k = w.shape
    assert a.stride(1) == 1 and w.stride(2) == 1 and out.stride(1) == 1
    # The interpreter's bfloat16 tl.dot is wrong (numpy has no bfloat16): float32 there.
    dot_fp32 = a.device.type == "cpu" and a.dtype == torch.bfloat16
    # Blocks on the first axis, which varies fastest: an expert's blocks run side by side
    # and share each weight tile in L2.
    grid = (block_experts.shape[0], triton.cdiv(n, BLOCK_N))
    _moe_gemm_kernel[grid](
        a,
        w,
        out,
        topk_weights,
        sorted_slots,
        block_experts,
        num_slots,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        N=n,
        K=k,
        NUM_EXPERTS=num_experts,
        SLOTS_PER_ROW=slots_per_row,
        WEIGHTED=topk_weights is not None,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        DOT_FP32=dot_fp32,
        PRECISION="ieee" if a.dtype == torch.float32 or dot_fp32 else None,
        num_warps=4,
        num_stages=3,
    )
    return out


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """x (T, H); w13 (E, 2I, H), each expert's gate (rows :I) and up (rows I:) projections;
    w2 (E, H, I), its down projection; topk_weights (T, k) float32; topk_ids (T, k) int32 or
    int64 in [0, E); ``activation`` "silu" or "gelu_tanh" -> (T, H) in x's dtype:
    ``out[t] = sum_j topk_weights[t, j] * w2[e] @ (act(gate) * up)`` with ``e = topk_ids[t, j]``
    and ``gate, up = w13[e] @ x[t]``. The GEMMs and the activation round to x's dtype; the
    weighted sum is in float32, rounded once."""
    gated = ACTIVATIONS.get(activation)
    if gated is None:
        raise ValueError(f"activation {activation!r}: one of {sorted(ACTIVATIONS)}")
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    assert w13.dtype == w2.dtype == x.dtype and w2.shape == (num_experts, hidden, two_i // 2)
    if num_tokens == 0:
        return x.new_empty((0, hidden))
    num_slots = num_tokens * top_k
    block_m = block_m_for(num_slots, num_experts)
    sorted_slots, block_experts = sort_slots_by_expert(topk_ids, num_experts, block_m)
    route = (sorted_slots, block_experts, block_m)

    gate_up = x.new_empty((num_slots, two_i))  # (S, 2I), slot t * k + j of token t
    moe_gemm(x, w13, gate_up, *route, slots_per_row=top_k)
    act = gated(gate_up)  # (S, I)
    down = torch.empty((num_slots, hidden), dtype=torch.float32, device=x.device)  # (S, H)
    weights = topk_weights.reshape(-1).float().contiguous()  # (S,)
    moe_gemm(act, w2, down, *route, slots_per_row=1, topk_weights=weights)
    return down.view(num_tokens, top_k, hidden).sum(1).to(x.dtype)  # (T, H)
