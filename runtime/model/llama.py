"""The Llama family's decoder: Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma, Granite, SmolLM3
and OLMo share one shape.

RMSNorm, rotary embeddings, grouped-query attention over the paged KV cache,
and a gated MLP. The differences are flags read from the Hugging Face config (``shape.py``):
Qwen2 has biases on q/k/v, Qwen3 normalises q and k per head, some models tie
the LM head to the embeddings. Phi-3's checkpoints hold q/k/v and gate/up fused
(split at load, so tensor parallelism cuts them as any other), and Phi-4-mini
turns only part of each head (``layers/rotary.py``).

SmolLM3 is Llama whose NoPE layers (``no_rope_layers``: every fourth by default) turn neither
q nor k: their attention sees no positions but the causal mask's.

Granite is Llama with four multipliers: of the embeddings, of the attention scores (in place
of 1 / sqrt(head_dim)), of each residual branch (folded into o_proj and down_proj at load)
and a divisor of the logits.

Gemma (1, 2 and 3's text models) scales the embeddings by sqrt(hidden), its norms by
``1 + weight`` (offset at load, so every RMSNorm kernel serves it) and gates its MLP
with GELU's tanh approximation. Gemma 2 and 3 also norm the attention's and the MLP's
outputs before each residual add ("sandwich" norms), scale scores by
``query_pre_attn_scalar`` and slide a window in some layers. Gemma 2 soft-caps the
attention scores and the logits (``cap * tanh(x / cap)``); Gemma 3 normalises q and k
per head and turns its sliding layers with a rope of their own.

OLMo 2 and 3 have no norm before the attention or the MLP: each reads the residual stream as
it is, and its output is normed before the residual add (``post_attention_layernorm``,
``post_feedforward_layernorm``). Their q and k norms span the whole projection, every head at
once, before the rotary; OLMo 3 slides a window in three layers of every four.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch import nn

from conveyor.runtime.layers.attention import AttentionBackend, DecoderLayers
from conveyor.runtime.layers.attention_metadata import AttentionMetadata
from conveyor.runtime.layers.layernorm import RMSNorm
from conveyor.runtime.layers.linear import packed_linear
from conveyor.runtime.layers.lora import LoRAProjection, LoRASlots
from conveyor.runtime.layers.moe import GatedMLP, SparseMoeBlock
from conveyor.runtime.layers.parallel import SINGLE, Shard, TensorParallel
from conveyor.runtime.layers.rotary import RotaryEmbedding, rope_inv_freq, rope_type
from conveyor.runtime.layers.vocab_parallel import VocabParallelEmbedding, gather_logits
from conveyor.runtime.model import llama_weights
from conveyor.runtime.model.shape import DecoderShape

Projected = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""A layer up to its attention: q (T, Hq, D), k and v (T, Hkv, D), and the residual (T, hidden)."""


class LlamaAttention(nn.Module):
    """Called in three parts (``project``, ``attend``, ``output``): piecewise CUDA graphs
    capture the parts around ``attend``."""

    def __init__(self, s: DecoderShape, backend: AttentionBackend, window: int = 0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = s.num_heads, s.num_kv_heads, s.head_dim
        self.window = window
        """Keys a query sees, its own included (a sliding-window layer); 0: all before it."""
        self.q_size = s.num_heads * s.head_dim
        self.kv_size = s.num_kv_heads * s.head_dim
        self.qkv_proj = nn.Linear(s.hidden_size, self.q_size + 2 * self.kv_size, bias=s.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, s.hidden_size, bias=s.o_bias)
        if s.qk_norm:
            self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps, s.norm_dtype)
            self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps, s.norm_dtype)
        self.qk_norm = s.qk_norm
        self.qk_norm_across_heads = s.qk_norm_across_heads
        if s.qk_norm_across_heads:  # OLMo: this rank's heads' share of a norm of all of them
            self.q_norm = RMSNorm(self.q_size, s.rms_norm_eps, s.norm_dtype)
            self.k_norm = RMSNorm(self.kv_size, s.rms_norm_eps, s.norm_dtype)
            self.qk_widths = (
                s.total_num_heads * s.head_dim,
                s.total_num_kv_heads * s.head_dim,
                max(1, s.tp.size // s.total_num_kv_heads),
            )
            """The norms' whole widths (q's, k's), and how many ranks hold each KV head."""
        self.scale = s.attn_scale
        self.softcap = s.attn_softcap
        self.backend = backend
        self.tp = s.tp if s.tp.size > 1 else None  # o_proj is row-parallel: sum its partials
        self.lora_qkv_proj: LoRAProjection | None = None
        self.lora_o_proj: LoRAProjection | None = None
        """Set when the replica serves LoRA adapters (``layers/lora.py``)."""

    def project(
        self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> q (T, Hq, D), k and v (T, Hkv, D), rotated (unless ``rotary`` is
        None: SmolLM3's NoPE layers): all that depends on the step's tokens alone (a piecewise
        CUDA graph holds it, ``piecewise_graphs.py``)."""
        qkv = self.qkv_proj(x)  # (T, q_size + 2 * kv_size)
        if self.lora_qkv_proj is not None:
            qkv = self.lora_qkv_proj(x, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm_across_heads:
            q, k = self.norm_across_heads(q, k)
        q = q.view(-1, self.num_heads, self.head_dim)  # (T, Hq, D)
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary is None:
            return q, k, v
        return rotary(positions, q, k) + (v,)

    def norm_across_heads(
        self, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """OLMo's q and k norms, (T, q_size) and (T, kv_size) -> the same, each over the whole
        projection: under tensor parallelism the ranks' sums of squares are summed first (a KV
        head that several ranks hold counted once), in one all-reduce for both."""
        q, k = q.contiguous(), k.contiguous()
        if self.tp is None:
            return cast(torch.Tensor, self.q_norm(q)), cast(torch.Tensor, self.k_norm(k))
        q_width, k_width, kv_copies = self.qk_widths
        qf, kf = q.float(), k.float()
        squares = torch.stack([qf.pow(2).sum(-1), kf.pow(2).sum(-1) / kv_copies], dim=-1)
        self.tp.all_reduce(squares)  # (T, 2): the whole q's and k's sums of squares
        scale = torch.rsqrt(squares / squares.new_tensor([q_width, k_width]) + self.q_norm.eps)
        return (
            RMSNorm.scaled(qf * scale[:, :1], self.q_norm.weight, q.dtype),
            RMSNorm.scaled(kf * scale[:, 1:], self.k_norm.weight, k.dtype),
        )

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The step's K/V into the cache, and attention over each sequence's context: the
        part that depends on the batch's sequences -> (T, Hq, D), into ``out`` if given."""
        return self.backend.forward(
            q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, out, self.window, self.softcap
        )

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """(T, Hq, D) -> (T, hidden), summed over the ranks' heads."""
        o = o.flatten(1)
        out = self.o_proj(o)  # (T, hidden), this rank's heads' part
        if self.lora_o_proj is not None:
            out = self.lora_o_proj(o, out)
        return out if self.tp is None else self.tp.all_reduce(out)


class LlamaMLP(GatedMLP):
    """The dense MLP, with its LoRA adapters and the all-reduce of its row-parallel down_proj."""

    def __init__(self, s: DecoderShape):
        super().__init__(s.hidden_size, s.intermediate_size, s.activation, s.mlp_bias)
        self.tp = s.tp if s.tp.size > 1 else None  # down_proj is row-parallel
        self.lora_gate_up_proj: LoRAProjection | None = None
        self.lora_down_proj: LoRAProjection | None = None

    def forward(self, x):
        if self.lora_gate_up_proj is None or self.lora_down_proj is None:
            out = super().forward(x)  # (T, hidden), this rank's part
        else:
            h = self.act(self.lora_gate_up_proj(x, self.gate_up_proj(x)))
            out = self.lora_down_proj(h, self.down_proj(h))
        return out if self.tp is None else self.tp.all_reduce(out)


class LlamaDecoderLayer(nn.Module):
    """Called in halves around its attention (``before_attention``, ``after_attention``)."""

    def __init__(
        self, s: DecoderShape, backend: AttentionBackend, window: int = 0, sparse: bool = False
    ):
        """``sparse``: the MLP is a mixture of experts (``s.experts``)."""
        super().__init__()
        self.self_attn = LlamaAttention(s, backend, window)
        self.mlp: LlamaMLP | SparseMoeBlock
        if sparse and s.experts is not None:
            self.mlp = SparseMoeBlock(s.hidden_size, s.experts, s.activation, s.tp)
        else:
            self.mlp = LlamaMLP(s)
        if not s.post_norms:  # OLMo has no input norm
            self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps, s.norm_dtype)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps, s.norm_dtype)
        self.sandwich_norms = s.sandwich_norms
        self.post_norms = s.post_norms
        if s.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps, s.norm_dtype)
        if s.sandwich_norms or s.post_norms:
            self.post_feedforward_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps, s.norm_dtype)

    def before_attention(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding | None,
    ) -> Projected:
        """The input norm (with the residual add) and the projections -> (q, k, v, residual)."""
        if self.post_norms:  # OLMo: the residual stream itself goes in
            residual = x if residual is None else x + residual
            return (*self.self_attn.project(positions, residual, rotary), residual)
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        return (*self.self_attn.project(positions, x, rotary), residual)

    def after_attention(
        self, o: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's output projection, the residual add, norm and MLP -> (x, residual)."""
        o = self.self_attn.output(o)
        if self.post_norms:  # OLMo: the MLP reads the stream; each output normed, then added
            residual = residual + self.post_attention_layernorm(o)
            return self.post_feedforward_layernorm(self.mlp(residual)), residual
        if not self.sandwich_norms:
            x, residual = self.post_attention_layernorm(o, residual)
            return self.mlp(x), residual
        # Gemma 2/3: each block's output is normed before it joins the residual stream.
        x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(o), residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        config,
        backend: AttentionBackend,
        tp: TensorParallel = SINGLE,
        context: int | None = None,
    ):
        """``context``: the most positions a sequence may have (the served
        ``--max-model-len``; None: the model's), which picks LongRoPE's factors."""
        super().__init__()
        self.config = config
        s = self.shape = DecoderShape(config, tp, context)
        self.embed_tokens = VocabParallelEmbedding(s.hidden_size, s.vocab, tp)
        sparse = s.experts.sparse_layers if s.experts else (False,) * s.num_layers
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(s, backend, w, moe) for w, moe in zip(s.windows, sparse, strict=True)
        )
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps, s.norm_dtype)
        self.rotaries = nn.ModuleList(
            RotaryEmbedding(s.head_dim, s.max_position, inv_freq, scaling)
            for inv_freq, scaling in s.ropes
        )
        """One table per rope of ``shape.ropes``; layer ``i`` turns with ``rotary_of(i)``."""
        self.embed_scale = s.embed_scale
        if s.embed_scale is not None and s.embed_scale_rounded:  # as the reference's is
            self.embed_scale = float(torch.tensor(s.embed_scale, dtype=torch.get_default_dtype()))
        self.tied_head_packed: torch.Tensor | None = None
        """The tied LM head (the embedding) in oneDNN's layout, set on CPU (``layers/linear.py``)."""
        self.fused_layers: DecoderLayers | None = None
        """All layers in one call, (x, positions, kv_caches, meta) -> (x, residual), with the
        loop below's result; set on CPU when the C++ kernels can (``kernels/cpu/backend.py``)."""
        self.lora: LoRASlots | None = None
        """The LoRA adapters on the device, when the replica serves some (``layers/lora.py``)."""
        if s.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(s.hidden_size, s.vocab.rows, bias=False)
            # This rank's vocabulary rows; those past the checkpoint's are padding, zeros.
            self.lm_head.weight.data[s.vocab.loaded :].zero_()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions (T,); kv_caches (L, 2, blocks, bs, Hkv, D) -> hidden (T, hidden)."""
        if self.fused_layers is not None and (self.lora is None or self.lora.step.masks is None):
            x, residual = self.fused_layers(self.embed(input_ids), positions, kv_caches, meta)
            x, _ = self.norm(x, residual)
            return x
        # The same pieces a piecewise CUDA graph captures, with attention between them.
        q, k, v, residual = self.begin(input_ids, positions)
        for i in range(len(self.layers) - 1):
            o = self.attend(i, q, k, v, kv_caches, meta)
            q, k, v, residual = self.between(i + 1, o, residual, positions)
        return self.finish(self.attend(len(self.layers) - 1, q, k, v, kv_caches, meta), residual)

    # -- the forward pass in pieces: attention (``attend``) is what lies between them --------

    def begin(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Projected:
        """The embedding and the first layer up to its attention -> (q, k, v, residual)."""
        return self.layer(0).before_attention(
            positions, self.embed(input_ids), None, self.rotary_of(0)
        )

    def attend(
        self,
        i: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_caches: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Layer ``i``'s attention over the paged cache -> (T, Hq, D)."""
        return self.layer(i).self_attn.attend(q, k, v, kv_caches[i], meta, out)

    def between(
        self, i: int, o: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor
    ) -> Projected:
        """Layer ``i - 1`` after its attention, then layer ``i`` up to its own."""
        x, residual = self.layer(i - 1).after_attention(o, residual)
        return self.layer(i).before_attention(positions, x, residual, self.rotary_of(i))

    def finish(self, o: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last layer after its attention, and the final norm -> hidden (T, hidden)."""
        x, residual = self.layer(len(self.layers) - 1).after_attention(o, residual)
        x, _ = self.norm(x, residual)
        return x

    @torch.no_grad()
    def fit_rope_to(self, context: int) -> None:
        """The rotary tables for a served context that turned out shorter than the one the
        model was built for (the KV cache holds fewer tokens): LongRoPE's factors depend on
        it (``layers/rotary.py``). Rewritten in place, so the fused layers and CUDA graphs
        that hold the tables keep reading them."""
        if rope_type(self.config) != "longrope":
            return
        s = self.shape
        inv_freq, scaling = rope_inv_freq(self.config, s.head_dim, context)
        if torch.equal(inv_freq, s.inv_freq) and scaling == s.rope_scaling:
            return
        with torch.device(self.rotary.cos.device):
            table = RotaryEmbedding(s.head_dim, s.max_position, inv_freq, scaling)
        self.rotary.cos.copy_(table.cos)
        self.rotary.sin.copy_(table.sin)
        s.inv_freq, s.rope_scaling = inv_freq, scaling

    def layer(self, i: int) -> LlamaDecoderLayer:
        return cast(LlamaDecoderLayer, self.layers[i])

    @property
    def rotary(self) -> RotaryEmbedding:
        """The first rope table: every layer's but under per-layer-type ropes (Gemma 3)."""
        return cast(RotaryEmbedding, self.rotaries[0])

    def rotary_of(self, i: int) -> RotaryEmbedding | None:
        """Layer ``i``'s rope table; None where it turns nothing (SmolLM3's NoPE layers)."""
        table = self.shape.layer_ropes[i]
        return None if table is None else cast(RotaryEmbedding, self.rotaries[table])

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings (T, hidden), scaled where the model scales them (Gemma)."""
        x = self.embed_tokens(input_ids)
        return x if self.embed_scale is None else x * self.embed_scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(N, hidden) -> (N, vocab) float32 logits; under tensor parallelism every rank
        calls it with the same rows, and only rank 0 gets the logits (the others None)."""
        if self.lm_head is not None:
            local = self.lm_head(hidden)  # (N, this rank's vocabulary rows)
        else:
            local = packed_linear(hidden, self.embed_tokens.weight, self.tied_head_packed, None)
        logits = gather_logits(local, self.shape.vocab, self.shape.tp)
        if logits is None:
            return None
        if self.shape.logits_scaling != 1:
            logits = logits / self.shape.logits_scaling  # Granite
        cap = self.shape.final_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    # -- weights: where a checkpoint's tensors go (``llama_weights.py``) -------------------

    def weight_shard(self, hf_name: str) -> Shard | None:
        """The part of checkpoint tensor ``hf_name`` this rank holds (None: all of it). The
        loaders read only that part and hand ``load_weights`` the shard."""
        return llama_weights.weight_shard(self.shape, hf_name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face tensors (each already cut to ``weight_shard``) into the (partly
        merged) parameters; all must be set."""
        llama_weights.load_weights(self, weights)

    def output_rows(self, hf_part: str, tensor: torch.Tensor) -> torch.Tensor:
        """The output rows of checkpoint projection ``hf_part`` (a weight, bias or LoRA ``B``)
        as the model holds them (``llama_weights.output_rows``)."""
        return llama_weights.output_rows(self.shape, hf_part, tensor)

    def shard_range(self, hf_part: str) -> tuple[int, int]:
        """(start, rows) of checkpoint projection ``hf_part`` in its merged parameter."""
        return llama_weights.shard_range(self.shape, hf_part)
