"""The CPU attention backend and layer kernels, on the C++ ops of ``ops.cpp``.

Same interface as ``TorchAttentionBackend`` (the reference): write the step's K/V into the
paged cache, then attend the leading decode tokens and the prefill chunks after them,
reading K/V where they lie in the cache. The layer kernels keep the reference's signatures;
RMSNorm with a residual works in place (the residual stream and the layer output are the
model's own temporaries), rotary rotates q and k in place.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import nn

from conveyor.runtime.layers.attention import DecoderLayers
from conveyor.runtime.layers.attention_metadata import AttentionMetadata
from conveyor.runtime.layers.fused import LayerKernels
from conveyor.runtime.layers.layernorm import RMSNorm
from conveyor.runtime.layers.linear import PackedLinear


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
        out: torch.Tensor | None = None,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """q (T, Hq, D), k/v (T, Hkv, D), caches (num_blocks, block_size, Hkv, D) -> (T, Hq, D);
        ``window`` > 0: a sliding-window layer's, ``softcap`` > 0: soft-capped scores
        (``AttentionBackend.forward``)."""
        ops = self.ops
        ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype)
        nd = meta.num_decode_tokens
        if nd:
            ops.paged_decode_attention(
                out[:nd], q[:nd], k_cache, v_cache,
                meta.decode_block_tables, meta.decode_context_lens, scale, window, softcap,
            )  # fmt: skip
        if meta.num_prefills:
            ops.paged_prefill_attention(
                out[nd:], q[nd:], k_cache, v_cache, meta.prefill_block_tables,
                meta.prefill_query_start_loc, meta.prefill_context_lens, scale, window, softcap,
            )  # fmt: skip
        return out

    def decoder_layers(self, model: nn.Module) -> DecoderLayers | None:
        """``model``'s layers as one C++ call (``decoder.cpp``: the same kernels, matmuls and
        order as the Python loop, so the same bits, without a dozen Python calls a layer), or
        None when the model does not fit it: every linear packed for oneDNN, every norm's weight
        in the model's dtype, float32 rotary tables. Every kind of layer ``model/llama.py``
        builds fits: Qwen3's and Gemma 3's q/k norms, Gemma's GELU gate, Gemma 2/3's sandwich
        norms, a rope table per layer type (Gemma 3). Epsilon, scale and the score soft cap
        come from the shape, as the layers' own do."""
        ops = self.ops
        # The Llama family's submodules, read by name (``runtime/model/llama.py``); torch types
        # each as Tensor | Module, so the walk reads the model as Any.
        llama: Any = model
        shape = getattr(llama, "shape", None)
        if not hasattr(ops, "decoder_layers") or shape is None or shape.experts is not None:
            return None  # experts run between the Python layers (``layers/moe.py``)
        dtype = llama.embed_tokens.weight.dtype
        if any(isinstance(m, RMSNorm) and m.weight.dtype != dtype for m in llama.layers.modules()):
            return None  # a norm the Python kernel leaves to the torch reference
        weights: list[torch.Tensor] = []
        for layer in llama.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(isinstance(lin, PackedLinear) for lin in linears):
                return None
            weights += [
                _norm_weight(layer.input_layernorm),
                *_linear_weights(attn.qkv_proj),
                _norm_weight(getattr(attn, "q_norm", None)),  # Qwen3, Gemma 3
                _norm_weight(getattr(attn, "k_norm", None)),
                *_linear_weights(attn.o_proj),
                _norm_weight(layer.post_attention_layernorm),
                _norm_weight(getattr(layer, "pre_feedforward_layernorm", None)),  # Gemma 2/3
                *_linear_weights(mlp.gate_up_proj),
                *_linear_weights(mlp.down_proj),
                _norm_weight(getattr(layer, "post_feedforward_layernorm", None)),
            ]
        weights = [w.detach() for w in weights]
        assert len(weights) == ops.weights_per_layer * len(llama.layers)
        cos = [rotary.cos for rotary in llama.rotaries]
        sin = [rotary.sin for rotary in llama.rotaries]
        for table in cos + sin:
            if table.dtype != torch.float32 or not table.is_contiguous():
                return None
        s, scale, softcap = shape, shape.attn_scale, shape.attn_softcap  # LlamaAttention's
        layer_ropes, windows = list(shape.layer_ropes), list(shape.windows)
        gelu = shape.activation == "gelu_tanh"  # LlamaMLP's GeluAndMul; else SiluAndMul

        def run(x, positions, kv_caches, meta: AttentionMetadata):
            return ops.decoder_layers(
                x, positions, kv_caches, weights, cos, sin, layer_ropes, meta.slot_mapping,
                meta.num_decode_tokens, meta.decode_block_tables, meta.decode_context_lens,
                meta.num_prefills > 0, meta.prefill_block_tables, meta.prefill_query_start_loc,
                meta.prefill_context_lens, s.num_heads, s.num_kv_heads, s.head_dim,
                s.rms_norm_eps, gelu, scale, softcap, windows,
            )  # fmt: skip

        return run


def _linear_weights(lin: PackedLinear) -> list[torch.Tensor]:
    """(weight, packed weight, bias or an empty tensor), as ``decoder_layers`` takes them."""
    return [lin.weight, lin.packed, lin.bias if lin.bias is not None else torch.empty(0)]


def _norm_weight(norm: RMSNorm | None) -> torch.Tensor:
    """An RMSNorm's weight, or an empty tensor for a norm the layer does not have."""
    return torch.empty(0) if norm is None else norm.weight


MOE_PACKED_MIN_ROWS = 16
"""moe.cpp's ``kPackedMinRows``: an expert's rows from which it runs oneDNN's GEMMs."""


def cpu_layer_kernels(ops: ModuleType) -> LayerKernels:
    def rms_norm(x, weight, eps, residual=None):
        if x.dim() == 3 and residual is None and x.dtype == weight.dtype:
            # Qwen3's and Gemma 3's per-head q/k norm, on (T, H, D) views of the projection:
            # a contiguous copy's rows, as decoder.cpp's head_rms_norm norms them.
            return ops.rms_norm(x.contiguous().view(-1, x.shape[-1]), weight, eps).view(x.shape)
        if x.dim() != 2 or not x.is_contiguous() or x.dtype != weight.dtype:
            return _reference_rms_norm(x, weight, eps, residual)
        if residual is None:
            return ops.rms_norm(x, weight, eps)
        ops.fused_add_rms_norm(x, residual, weight, eps)  # residual += x; x = norm(residual)
        return x, residual

    def apply_rotary(positions, q, k, cos, sin):
        ops.rotary_embedding(positions, q, k, cos, sin)
        return q, k

    def fused_moe(block, x, topk_weights, topk_ids):
        # An expert reaches moe.cpp's 16 rows for oneDNN only in a step of 16 tokens or more:
        # fewer, and the packed weights' 2E tensors are not worth passing.
        packed = block.packed if x.shape[0] >= MOE_PACKED_MIN_ROWS else None
        packed_w13, packed_w2 = packed or ([], [])
        return ops.moe_experts(
            x.contiguous(), block.w13, block.w2, topk_weights, topk_ids.long(),
            block.activation == "gelu_tanh", packed_w13, packed_w2,
        )  # fmt: skip

    return LayerKernels(
        rms_norm=rms_norm,
        apply_rotary=apply_rotary,
        silu_and_mul=ops.silu_and_mul,
        gelu_tanh_and_mul=ops.gelu_tanh_and_mul,
        fused_moe=fused_moe,
    )


def _reference_rms_norm(x, weight, eps, residual):
    return RMSNorm.reference(x, weight, eps, residual)
