"""The CPU attention backend and layer kernels, on the C++ ops of ``ops.cpp``.

Same interface as ``TorchAttentionBackend`` (the reference): write the step's K/V into the
paged cache, then attend the leading decode tokens and the prefill chunks after them,
reading K/V where they lie in the cache. The layer kernels keep the reference's signatures;
RMSNorm with a residual works in place (the residual stream and the layer output are the
model's own temporaries), rotary rotates q and k in place.
"""

from __future__ import annotations

from types import ModuleType

import torch

from conveyor.runtime.layers.attention_metadata import AttentionMetadata
from conveyor.runtime.layers.fused import LayerKernels


class CpuAttentionBackend:
    name = "cpu"

    def __init__(self, ops: ModuleType):
        self.ops = ops
        self.layer_kernels = cpu_layer_kernels(ops)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q (T, Hq, D), k/v (T, Hkv, D), caches (num_blocks, block_size, Hkv, D) -> (T, Hq, D)."""
        ops = self.ops
        ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype)
        nd = meta.num_decode_tokens
        if nd:
            ops.paged_decode_attention(
                out[:nd], q[:nd], k_cache, v_cache,
                meta.decode_block_tables, meta.decode_context_lens, scale,
            )  # fmt: skip
        if meta.num_prefills:
            ops.paged_prefill_attention(
                out[nd:], q[nd:], k_cache, v_cache, meta.prefill_block_tables,
                meta.prefill_query_start_loc, meta.prefill_context_lens, scale,
            )  # fmt: skip
        return out


def cpu_layer_kernels(ops: ModuleType) -> LayerKernels:
    def rms_norm(x, weight, eps, residual=None):
        if x.dim() != 2 or not x.is_contiguous() or x.dtype != weight.dtype:
            return _reference_rms_norm(x, weight, eps, residual)  # e.g. Qwen3's per-head q/k norm
        if residual is None:
            return ops.rms_norm(x, weight, eps)
        ops.fused_add_rms_norm(x, residual, weight, eps)  # residual += x; x = norm(residual)
        return x, residual

    def apply_rotary(positions, q, k, cos, sin):
        ops.rotary_embedding(positions, q, k, cos, sin)
        return q, k

    return LayerKernels(rms_norm=rms_norm, apply_rotary=apply_rotary, silu_and_mul=ops.silu_and_mul)


def _reference_rms_norm(x, weight, eps, residual):
    from conveyor.runtime.layers.layernorm import RMSNorm

    return RMSNorm.reference(x, weight, eps, residual)
