"""Every kernel against the torch reference: the case matrices and the comparisons.

Shared by ``tests/kernels`` (pytest, CPU tensors under ``TRITON_INTERPRET=1``,
or CUDA) and ``conveyor bench gpu`` (whose machine has no pytest). Each
``check_*`` builds its inputs from a seed, runs the kernel and the reference,
and raises ``AssertionError`` when they differ beyond the dtype's tolerance;
it returns the largest absolute difference.

Every kernel is compared with the reference computed in float32 on the same
(rounded) inputs, so the tolerance measures only the kernel's own rounding.
Attention casts the softmax weights to the activation dtype for the P @ V
product and rounds its output once; the elementwise kernels compute in float32
and round an intermediate (as the unfused ops do) and the output.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

# (atol, rtol) per activation dtype, against float32 attention on the same inputs: the P @ V
# product takes P rounded to the activation dtype, and the output is rounded once (bfloat16:
# under the interpreter both are truncations, a unit of 2**-7 each). float32 differs only in
# summation order (measured under the interpreter: below 1e-6; the bound leaves room for the
# reference's own CUDA kernels).
ATTENTION_TOL = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
# Elementwise kernels against the reference in float32: they round at most twice, each time
# by half a unit in the last place (2**-11 relative for float16, 2**-8 for bfloat16) on a GPU.
# Triton's interpreter truncates float32 -> bfloat16 instead (a whole unit, 2**-7), and the
# fused residual add is one more truncation, so the bfloat16 bound is three units.
ELEMENTWISE_TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-4, 1e-3),
    torch.bfloat16: (1e-3, 2.4e-2),
}


@dataclass(frozen=True)
class AttentionCase:
    """One engine step over a paged cache: decodes first, then prefill chunks."""

    block_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    decode_lens: tuple[int, ...]
    """Context length of each decode, including its new token."""
    prefills: tuple[tuple[int, int], ...]
    """(cached prefix, chunk length) of each prefill."""
    window: int = 0
    """A sliding window (keys a query sees, its own included); 0: every key before it."""
    softcap: float = 0.0
    """Gemma 2's cap on the scores, ``softcap * tanh(s / softcap)``; 0: uncapped."""

    @property
    def scale(self) -> float:
        """``head_dim ** -0.5``, which makes the random scores about 1 in size; with a cap,
        ``softcap`` times that, so that the cap bends most scores (uncapped, the softmax
        would be close to one-hot)."""
        return (self.softcap or 1.0) * self.head_dim**-0.5

    @property
    def id(self) -> str:
        return (
            f"bs{self.block_size}-h{self.num_q_heads}kv{self.num_kv_heads}-d{self.head_dim}"
            f"-dec{len(self.decode_lens)}-pre{len(self.prefills)}"
            + (f"-w{self.window}" if self.window else "")
            + (f"-cap{self.softcap:g}" if self.softcap else "")
        )


def _lengths(bs: int) -> tuple[int, ...]:
    """Ragged context lengths around the block boundaries of block size ``bs``, and 1."""
    return tuple(
        n for n in dict.fromkeys((1, bs - 1, bs, bs + 1, 2 * bs, 3 * bs + 5, 130)) if n >= 1
    )


def _prefills(bs: int) -> tuple[tuple[int, int], ...]:
    return (
        (0, 1),  # a one-token prompt
        (0, 2 * bs + 3),  # nothing cached
        (bs, bs),  # a block-aligned cached prefix, a one-block chunk
        (bs + 5, 70),  # prefix ends mid-block: the chunk starts inside a partly cached block
        (3, 1),  # a one-token chunk after a cached prefix
    )


def attention_cases(gpu_sweep: bool = False) -> list[AttentionCase]:
    """The CI matrix (block sizes 16 and 32, GQA ratios 1, 4 and 8, head dims 64 and 128, plus
    one case of block size 1 and GQA ratio 7), or the larger GPU sweep (block sizes 1 to 64,
    GQA ratios 1, 2, 4, 7 and 8, contexts past 4k tokens, a 2k-token chunk, and Gemma 2's
    soft-capped shapes). The CI matrix's soft-capped cases are ``softcap_attention_cases``."""
    if not gpu_sweep:
        cases = []
        for bs in (16, 32):
            for hq, hkv in ((4, 4), (8, 2), (8, 1)):
                cases.append(AttentionCase(bs, hq, hkv, 64, _lengths(bs), _prefills(bs)))
        cases.append(AttentionCase(16, 8, 2, 128, (1, 17, 64), ((5, 40),)))
        cases.append(AttentionCase(1, 28, 4, 64, (1, 2, 9), ((0, 5), (6, 7))))  # page size 1, GQA 7
        # Sliding windows: one token, one inside a block, one past a block and a prefill's
        # 64-query task, each shorter than some contexts and chunks and longer than others.
        for window in (1, 7, 70):
            cases.append(AttentionCase(16, 8, 2, 64, _lengths(16), _prefills(16), window))
        return cases
    cases = []
    for bs in (1, 16, 32, 64):
        for hq, hkv in ((8, 8), (8, 4), (16, 4), (32, 8), (28, 4), (8, 1)):
            for d in (64, 128):
                lens = (*_lengths(bs), 1000, 4097)
                pre = (*_prefills(bs), (1000, 333), (0, 2048))
                cases.append(AttentionCase(bs, hq, hkv, d, lens, pre))
                cases.append(AttentionCase(bs, hq, hkv, d, lens, pre, window=1000))
    # Gemma 2 9B's and 27B's heads, capped at 50, every other layer with a sliding window.
    for bs in (16, 32):
        for hq, hkv, d in ((16, 8, 256), (32, 16, 128)):
            lens = (*_lengths(bs), 1000, 4097)
            pre = (*_prefills(bs), (1000, 333), (0, 2048))
            cases.append(AttentionCase(bs, hq, hkv, d, lens, pre, softcap=50.0))
            cases.append(AttentionCase(bs, hq, hkv, d, lens, pre, window=1000, softcap=50.0))
    return cases


def softcap_attention_cases() -> list[AttentionCase]:
    """Soft-capped scores (Gemma 2's cap, 50) for CI: GQA ratios 1 and 4, without a window and
    with one inside a block and one past a prefill's 64-query tile, and Gemma's head dim 256."""
    return [
        AttentionCase(16, 4, 4, 64, _lengths(16), _prefills(16), softcap=50.0),
        AttentionCase(16, 8, 2, 64, _lengths(16), _prefills(16), window=7, softcap=50.0),
        AttentionCase(32, 8, 2, 64, _lengths(32), _prefills(32), window=70, softcap=50.0),
        AttentionCase(16, 4, 2, 256, (1, 17, 64), ((5, 40),), softcap=50.0),
    ]


def _paged_step(case: AttentionCase, dtype: torch.dtype, device: torch.device, seed: int):
    """Random inputs for one step, each sequence's blocks scattered across the cache."""
    from conveyor.runtime.layers.attention_metadata import AttentionMetadata

    g = torch.Generator().manual_seed(seed)
    bs = case.block_size
    totals = list(case.decode_lens) + [p + c for p, c in case.prefills]
    need = [-(-n // bs) for n in totals]
    num_blocks = sum(need) + 7  # spare blocks nobody owns
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    slots, q_lens = [], []
    for ctx, table in zip(case.decode_lens, tables, strict=False):
        p = ctx - 1
        slots.append(table[p // bs] * bs + p % bs)
    for (prefix, chunk), table in zip(case.prefills, tables[len(case.decode_lens) :], strict=True):
        slots += [table[p // bs] * bs + p % bs for p in range(prefix, prefix + chunk)]
        q_lens.append(chunk)
    nd, t = len(case.decode_lens), len(slots)
    hq, hkv, d = case.num_q_heads, case.num_kv_heads, case.head_dim

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    def table_tensor(rows: list[list[int]]) -> torch.Tensor:
        width = max((len(r) for r in rows), default=0)
        return torch.tensor(
            [r + [0] * (width - len(r)) for r in rows], dtype=torch.int32, device=device
        )

    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    prefill_ctx = [p + c for p, c in case.prefills]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        num_decode_tokens=nd,
        decode_context_lens=torch.tensor(case.decode_lens, dtype=torch.int32, device=device),
        decode_block_tables=table_tensor(tables[:nd]),
        prefill_query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        prefill_context_lens=torch.tensor(prefill_ctx, dtype=torch.int32, device=device),
        prefill_block_tables=table_tensor(tables[nd:]),
        max_decode_context_len=max(case.decode_lens, default=0),
        max_prefill_query_len=max(q_lens, default=0),
        max_prefill_context_len=max(prefill_ctx, default=0),
        prefill_query_lens_host=tuple(q_lens),
        prefill_context_lens_host=tuple(prefill_ctx),
    )
    # q/k/v as views of one fused projection, as the model hands them over.
    qkv = randn(t, (hq + 2 * hkv) * d)  # (T, (Hq + 2 Hkv) D)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
    k_cache, v_cache = (
        randn(num_blocks, bs, hkv, d),
        randn(num_blocks, bs, hkv, d),
    )  # the cached context
    return q, k, v, k_cache, v_cache, meta


def _assert_close(
    actual: torch.Tensor, expected: torch.Tensor, tol: tuple[float, float], what: str
) -> float:
    actual, expected = actual.float(), expected.float()
    torch.testing.assert_close(
        actual, expected, atol=tol[0], rtol=tol[1], msg=lambda m: f"{what}: {m}"
    )
    return float((actual - expected).abs().max()) if actual.numel() else 0.0


def check_attention_backend(
    case: AttentionCase,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    backend: Any = None,
) -> float:
    """A backend's step (store K/V, decode, prefill; default the Triton backend's) against
    the torch backend's."""
    from conveyor.runtime.layers.attention import TorchAttentionBackend

    if backend is None:
        from conveyor.runtime.kernels.backend import TritonAttentionBackend

        backend = TritonAttentionBackend()

    q, k, v, k_cache, v_cache, meta = _paged_step(case, dtype, device, seed)
    ref_k, ref_v = k_cache.float(), v_cache.float()
    expected = TorchAttentionBackend().forward(
        q.float(), k.float(), v.float(), ref_k, ref_v, meta, case.scale,
        window=case.window, softcap=case.softcap,
    )  # fmt: skip
    out = backend.forward(
        q, k, v, k_cache, v_cache, meta, case.scale, window=case.window, softcap=case.softcap
    )
    # The cache writes are copies: exact.
    _assert_close(k_cache, ref_k, (0.0, 0.0), f"{case.id} {dtype} k_cache")
    _assert_close(v_cache, ref_v, (0.0, 0.0), f"{case.id} {dtype} v_cache")
    return _assert_close(out, expected, ATTENTION_TOL[dtype], f"{case.id} {dtype} attention")


def check_decode_splits(
    case: AttentionCase, dtype: torch.dtype, device: torch.device, num_splits: int, seed: int = 0
) -> float:
    """Decode with its context split ``num_splits`` ways (and merged), plus two padded slots
    (context length 0, as a CUDA graph's padding has), which must come out as zeros."""
    from conveyor.runtime.kernels.decode_attention import paged_decode_attention
    from conveyor.runtime.layers.attention import TorchAttentionBackend

    case = replace(case, prefills=())  # decodes only
    q, k, v, k_cache, v_cache, meta = _paged_step(case, dtype, device, seed)
    ref_k, ref_v = k_cache.float(), v_cache.float()
    expected = TorchAttentionBackend().forward(
        q.float(), k.float(), v.float(), ref_k, ref_v, meta, case.scale,
        window=case.window, softcap=case.softcap,
    )  # fmt: skip
    n = q.shape[0]
    pad = torch.zeros(2, *q.shape[1:], dtype=dtype, device=device)
    q_padded = torch.cat([q, pad])  # (B + 2, Hq, D)
    tables = torch.cat([meta.decode_block_tables, meta.decode_block_tables[:2] * 0])
    lens = torch.cat([meta.decode_context_lens, torch.zeros(2, dtype=torch.int32, device=device)])
    out = paged_decode_attention(
        q_padded, ref_k.to(dtype), ref_v.to(dtype), tables, lens, case.scale,
        num_splits=num_splits, window=case.window, softcap=case.softcap,
    )  # fmt: skip
    _assert_close(out[n:], torch.zeros_like(out[n:]), (0.0, 0.0), f"{case.id} padded slots")
    return _assert_close(
        out[:n], expected, ATTENTION_TOL[dtype], f"{case.id} {dtype} splits={num_splits}"
    )


def check_store_kv(
    dtype: torch.dtype, device: torch.device, seed: int = 0, store_kv_cache: Any = None
) -> float:
    """One kernel for the step's K/V, padding slots (-1) skipped: exactly the reference's writes."""
    from conveyor.runtime.layers.attention import write_kv_cache

    if store_kv_cache is None:
        from conveyor.runtime.kernels.store_kv import store_kv_cache

    g = torch.Generator().manual_seed(seed)
    num_blocks, bs, hkv, d, t = 9, 16, 2, 64, 37
    kv = torch.randn(t, 2 * hkv * d, generator=g).to(dtype).to(device)
    k, v = (x.view(t, hkv, d) for x in kv.split(hkv * d, dim=-1))  # non-contiguous views
    slots = torch.randperm(num_blocks * bs, generator=g)[:t]
    slots[[3, 17, 36]] = -1
    slots = slots.to(device)
    caches = [
        torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype).to(device) for _ in range(2)
    ]
    ref = [c.clone() for c in caches]
    write_kv_cache(k, v, ref[0], ref[1], slots)
    store_kv_cache(k, v, caches[0], caches[1], slots)
    _assert_close(caches[0], ref[0], (0.0, 0.0), "k_cache")
    return _assert_close(caches[1], ref[1], (0.0, 0.0), "v_cache")


def check_rms_norm(
    rows: int,
    hidden: int,
    with_residual: bool,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    rms_norm: Any = None,
) -> float:
    from conveyor.runtime.layers.layernorm import RMSNorm

    if rms_norm is None:
        from conveyor.runtime.kernels.rmsnorm import rms_norm

    g = torch.Generator().manual_seed(seed)
    norm = RMSNorm(hidden, eps=1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.1 * torch.randn(hidden, generator=g))
    ref = RMSNorm(hidden, eps=1e-6).to(device)
    ref.load_state_dict({"weight": norm.weight.float()})
    x = torch.randn(rows, hidden, generator=g).to(dtype).to(device)
    tol = ELEMENTWISE_TOL[dtype]
    with torch.inference_mode():
        if not with_residual:
            return _assert_close(
                rms_norm(x, norm.weight, norm.eps), ref(x.float()), tol, "rms_norm"
            )
        residual = torch.randn(rows, hidden, generator=g).to(dtype).to(device)
        summed = x + residual  # the unfused add, in the activation dtype
        out, res = rms_norm(x.clone(), norm.weight, norm.eps, residual.clone())
        ref_out = ref(summed.float())
    # One rounding of the same float32 sum: bit-equal, except where the interpreter truncates.
    exact = dtype != torch.bfloat16 or device.type == "cuda"
    _assert_close(res, summed, (0.0, 0.0) if exact else (0.0, 2**-7), "residual")
    return _assert_close(out, ref_out, tol, "rms_norm(x + residual)")


def check_rotary(
    num_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    apply_rotary: Any = None,
) -> float:
    """In place on views of a fused qkv buffer, at scattered positions."""
    from conveyor.runtime.layers.rotary import RotaryEmbedding

    if apply_rotary is None:
        from conveyor.runtime.kernels.rotary import apply_rotary

    g = torch.Generator().manual_seed(seed)
    max_pos = 4096
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    rope = RotaryEmbedding(head_dim, max_pos, inv_freq).to(device)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=g).to(device)
    qkv = (
        torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=g)
        .to(dtype)
        .to(device)
    )
    q, k, _ = qkv.split(
        [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1
    )
    q, k = q.view(num_tokens, num_q_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim)
    with torch.inference_mode():
        ref_q, ref_k = rope(positions, q.float(), k.float())
        out_q, out_k = apply_rotary(positions, q, k, rope.cos, rope.sin)
    tol = ELEMENTWISE_TOL[dtype]
    assert out_q.data_ptr() == q.data_ptr(), "rotary must work in place"
    return max(
        _assert_close(out_q, ref_q, tol, "rotary q"), _assert_close(out_k, ref_k, tol, "rotary k")
    )


def check_silu_and_mul(
    num_tokens: int,
    intermediate: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    silu_and_mul: Any = None,
) -> float:
    from conveyor.runtime.layers.activation import SiluAndMul

    if silu_and_mul is None:
        from conveyor.runtime.kernels.silu_and_mul import silu_and_mul

    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(num_tokens, 2 * intermediate, generator=g)).to(dtype).to(device)
    with torch.inference_mode():
        return _assert_close(
            silu_and_mul(x), SiluAndMul()(x.float()), ELEMENTWISE_TOL[dtype], "silu_and_mul"
        )


def check_gelu_tanh_and_mul(
    num_tokens: int,
    intermediate: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    gelu_tanh_and_mul: Any = None,
) -> float:
    """Gates of twice a standard normal: through GELU's bend into both of its tails."""
    from conveyor.runtime.layers.activation import GeluAndMul

    if gelu_tanh_and_mul is None:
        from conveyor.runtime.kernels.gelu_and_mul import gelu_tanh_and_mul

    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(num_tokens, 2 * intermediate, generator=g)).to(dtype).to(device)
    with torch.inference_mode():
        return _assert_close(
            gelu_tanh_and_mul(x),
            GeluAndMul()(x.float()),
            ELEMENTWISE_TOL[dtype],
            "gelu_tanh_and_mul",
        )


ELEMENTWISE_CASES = {
    "rms_norm": [(1, 256, False), (7, 1000, True), (33, 4096, True), (5, 128, False)],
    "rotary": [(1, 8, 2, 64), (19, 8, 8, 128), (6, 32, 8, 128), (4, 8, 2, 32)],
    "silu_and_mul": [(1, 704), (9, 1000), (3, 14336)],
    # Gemma 2 2B's and Gemma 3 1B's intermediate sizes, and one past a 1024-wide block.
    "gelu_tanh_and_mul": [(1, 9216), (7, 6912), (3, 1000)],
}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
