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
from conveyor.runtime.layers.moe import SparseMoeBlock


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
        norms, OLMo 2/3's post-norms and q/k norms over the whole projection, a rope table per
        layer type (Gemma 3, OLMo 3) or none (SmolLM3's NoPE layers), and the mixture-of-experts
        MLPs of ``layers/moe.py`` (routed the same way, ``moe.cpp``'s experts as ``fused_moe``
        runs them, the shared expert), beside dense ones. Epsilon, scale, the score soft cap and
        the routing come from the shape, as the layers' own do."""
        ops = self.ops
        # The Llama family's submodules, read by name (``runtime/model/llama.py``); torch types
        # each as Tensor | Module, so the walk reads the model as Any.
        llama: Any = model
        shape = getattr(llama, "shape", None)
        if not hasattr(ops, "decoder_layers") or shape is None:
            return None
        dtype = llama.embed_tokens.weight.dtype
        if any(isinstance(m, RMSNorm) and m.weight.dtype != dtype for m in llama.layers.modules()):
            return None  # a norm the Python kernel leaves to the torch reference
        weights: list[torch.Tensor] = []
        packed_experts: list[list[torch.Tensor]] = []  # each sparse layer's, w13's then w2's
        for layer in llama.layers:
            attn = layer.self_attn
            mlp = _mlp_weights(layer.mlp, packed_experts)
            if mlp is None or not all(
                isinstance(lin, PackedLinear) for lin in (attn.qkv_proj, attn.o_proj)
            ):
                return None
            gate_up, down, moe = mlp
            weights += [
                _norm_weight(getattr(layer, "input_layernorm", None)),  # none in OLMo
                *_linear_weights(attn.qkv_proj),
                _norm_weight(getattr(attn, "q_norm", None)),  # Qwen3, Gemma 3, OLMo
                _norm_weight(getattr(attn, "k_norm", None)),
                *_linear_weights(attn.o_proj),
                _norm_weight(layer.post_attention_layernorm),
                _norm_weight(getattr(layer, "pre_feedforward_layernorm", None)),  # Gemma 2/3
                *gate_up,
                *down,
                _norm_weight(getattr(layer, "post_feedforward_layernorm", None)),  # and OLMo
                *moe,
            ]
        weights = [w.detach() for w in weights]
        if len(packed_experts) != sum(shape.experts.sparse_layers if shape.experts else ()):
            packed_experts = []  # some not packed (``pack_experts``): the tiles serve them all
        assert len(weights) == ops.weights_per_layer * len(llama.layers)
        cos = [rotary.cos for rotary in llama.rotaries]
        sin = [rotary.sin for rotary in llama.rotaries]
        for table in cos + sin:
            if table.dtype != torch.float32 or not table.is_contiguous():
                return None
        s, scale, softcap = shape, shape.attn_scale, shape.attn_softcap  # LlamaAttention's
        # -1: a layer that turns nothing (SmolLM3's NoPE layers).
        layer_ropes = [-1 if r is None else r for r in shape.layer_ropes]
        windows = list(shape.windows)
        gelu = shape.activation == "gelu_tanh"  # LlamaMLP's GeluAndMul; else SiluAndMul
        e = shape.experts
        top_k, renormalize, round_weights = (
            (e.top_k, e.renormalize, e.round_weights) if e is not None else (0, False, False)
        )
        packed = [w for pair in packed_experts for w in pair]  # flat, as decoder_layers takes it

        def run(x, positions, kv_caches, meta: AttentionMetadata):
            # As ``fused_moe``: the packed experts from moe.cpp's rows for oneDNN only.
            experts = packed if x.shape[0] >= MOE_PACKED_MIN_ROWS else []
            return ops.decoder_layers(
                x, positions, kv_caches, weights, cos, sin, layer_ropes, meta.slot_mapping,
                meta.num_decode_tokens, meta.decode_block_tables, meta.decode_context_lens,
                meta.num_prefills > 0, meta.prefill_block_tables, meta.prefill_query_start_loc,
                meta.prefill_context_lens, s.num_heads, s.num_kv_heads, s.head_dim,
                s.rms_norm_eps, gelu, scale, softcap, windows, top_k, renormalize,
                round_weights, experts,
            )  # fmt: skip

        return run


def _linear_weights(lin: PackedLinear) -> list[torch.Tensor]:
    """(weight, packed weight, bias or an empty tensor), as ``decoder_layers`` takes them."""
    return [lin.weight, lin.packed, lin.bias if lin.bias is not None else torch.empty(0)]


def _mlp_weights(
    mlp: nn.Module, packed_experts: list[list[torch.Tensor]]
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] | None:
    """A layer's MLP as ``decoder_layers`` takes it: (gate_up, down) linears of the dense MLP
    or the shared expert (empty ones: none), and the mixture of experts' (router weight,
    packed router, w13, w2, shared expert's gate weight, its packed) or empty tensors for a
    dense layer; a sparse layer's packed experts (w13's then w2's) are appended to
    ``packed_experts``. None: a layer ``decoder_layers`` cannot run (a linear not packed for
    oneDNN, experts without the CPU kernel)."""
    empty = torch.empty(0)
    if not isinstance(mlp, SparseMoeBlock):  # the dense MLP (``LlamaMLP``)
        dense = _packed(mlp.gate_up_proj, mlp.down_proj)
        if dense is None:
            return None
        return _linear_weights(dense[0]), _linear_weights(dense[1]), [empty] * 6
    router = _packed(mlp.gate)
    if mlp.kernel is None or router is None:
        return None  # the torch path's roundings are not moe.cpp's
    gate_up, down, shared_gate = [empty] * 3, [empty] * 3, [empty] * 2
    if mlp.shared_expert is not None:
        shared = _packed(
            mlp.shared_expert.gate_up_proj, mlp.shared_expert.down_proj, mlp.shared_expert_gate
        )
        if shared is None:
            return None
        gate_up, down = _linear_weights(shared[0]), _linear_weights(shared[1])
        shared_gate = _linear_weights(shared[2])[:2]  # no bias
    if mlp.packed is not None:
        packed_experts.append([*mlp.packed[0], *mlp.packed[1]])
    moe = [*_linear_weights(router[0])[:2], mlp.w13, mlp.w2, *shared_gate]  # router: no bias
    return gate_up, down, moe


def _packed(*linears: object) -> list[PackedLinear] | None:
    """``linears``, or None when one is not packed for oneDNN (``layers/linear.py``)."""
    packed = [lin for lin in linears if isinstance(lin, PackedLinear)]
    return packed if len(packed) == len(linears) else None


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
