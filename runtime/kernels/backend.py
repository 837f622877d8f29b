"""The Triton attention backend: the engine's ``AttentionBackend`` on GPU kernels.

Same interface as ``TorchAttentionBackend`` (the reference): write the step's
K/V into the paged cache with one kernel, then run the decode kernel over the
leading decode tokens and the prefill kernel over the chunks after them. It
reads no host copy of the batch's lengths on the decode path, so a decode step
can be captured in a CUDA graph and replayed with new lengths.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from conveyor.runtime.kernels.decode_attention import paged_decode_attention
from conveyor.runtime.kernels.fused_moe import fused_moe
from conveyor.runtime.kernels.gelu_and_mul import gelu_tanh_and_mul
from conveyor.runtime.kernels.prefill_attention import paged_prefill_attention
from conveyor.runtime.kernels.rmsnorm import rms_norm
from conveyor.runtime.kernels.rotary import apply_rotary
from conveyor.runtime.kernels.silu_and_mul import silu_and_mul
from conveyor.runtime.kernels.store_kv import store_kv_cache
from conveyor.runtime.layers.attention_metadata import AttentionMetadata
from conveyor.runtime.layers.fused import LayerKernels


def check_triton_device(device: torch.device) -> None:
    """Triton runs on CUDA; on CPU only under its interpreter (``TRITON_INTERPRET=1``, tests)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"the triton attention backend needs a CUDA device (got {device.type}); use "
            "--attention-backend torch, or set TRITON_INTERPRET=1 to run the kernels in "
            "Triton's interpreter (slow: for tests)"
        )


TRITON_LAYER_KERNELS = LayerKernels(
    rms_norm=rms_norm,
    apply_rotary=apply_rotary,
    silu_and_mul=silu_and_mul,
    gelu_tanh_and_mul=gelu_tanh_and_mul,
    fused_moe=lambda block, x, weights, ids: fused_moe(
        x, block.w13, block.w2, weights, ids, block.activation
    ),
)


class TritonAttentionBackend:
    name = "triton"
    layer_kernels = TRITON_LAYER_KERNELS

    def decoder_layers(self, model: nn.Module) -> None:
        return None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """q (T, Hq, D), k/v (T, Hkv, D), caches (num_blocks, block_size, Hkv, D) -> (T, Hq, D);
        ``window`` > 0: a sliding-window layer's; ``softcap`` > 0: soft-capped scores, a
        per-model constant, so a captured decode graph keeps it (``AttentionBackend.forward``)."""
        store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (T, Hq, D), contiguous
        nd = meta.num_decode_tokens
        if nd:
            paged_decode_attention(
                q[:nd],
                k_cache,
                v_cache,
                meta.decode_block_tables,
                meta.decode_context_lens,
                scale,
                out=out[:nd],
                window=window,
                softcap=softcap,
            )
        if meta.num_prefills:
            paged_prefill_attention(
                q[nd:],
                k_cache,
                v_cache,
                meta.prefill_block_tables,
                meta.prefill_query_start_loc,
                meta.prefill_context_lens,
                meta.max_prefill_query_len,
                scale,
                out=out[nd:],
                window=window,
                softcap=softcap,
            )
        return out
