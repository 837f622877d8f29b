"""A decoder's shape: what ``llama.py``'s layers need from a model's config, read once.

The model types Conveyor runs and what each changes in the shared decoder (biases, q/k norms,
Gemma's norms, scales and caps, Granite's multipliers, OLMo's and EXAONE 4's post-norms, q/k
norms per head or over the whole projection, rope tables per layer type, layers without rope
(SmolLM3's, EXAONE 4's global ones), sliding windows, experts),
with this rank's share of the heads under tensor parallelism.
"""

from __future__ import annotations

import torch

from conveyor.runtime.layers.moe import MOE_MODEL_TYPES, ExpertShape, dense_width
from conveyor.runtime.layers.parallel import SINGLE, HeadSplit, TensorParallel
from conveyor.runtime.layers.rotary import rope_inv_freq, rope_layer_types, rotary_row_order
from conveyor.runtime.layers.vocab_parallel import VocabSplit
from conveyor.runtime.model.config import layer_windows

GEMMA = ("gemma", "gemma2", "gemma3_text")
OLMO = ("olmo2", "olmo3")
GLM = ("glm", "glm4")
INTERLEAVED_ROPE = (*GLM, "ernie4_5", "helium")
"""Model types whose rotary turns pairs (2i, 2i + 1) (``layers/rotary.py``)."""
SUPPORTED_MODEL_TYPES = (
    "llama", "mistral", "ministral", "ministral3", "qwen2", "qwen3", "phi3", "granite", "smollm3",
    "seed_oss", "exaone4", "helium", *GEMMA, *OLMO, *GLM, "ernie4_5", *MOE_MODEL_TYPES,
)  # fmt: skip


class DecoderShape:
    """The hyper-parameters the layers need, read once from a transformers config.

    ``num_heads``, ``num_kv_heads`` and ``intermediate_size`` are this rank's share under
    tensor parallelism (``layers/parallel.py``); the ``total_`` ones are the model's.
    """

    def __init__(self, config, tp: TensorParallel = SINGLE, context: int | None = None):
        self.model_type = config.model_type
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model type {self.model_type!r} is not supported; "
                f"Conveyor runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if getattr(config, "use_bidirectional_attention", None):
            raise ValueError(
                "use_bidirectional_attention is set: this is an embedding model (EmbeddingGemma?); "
                "Conveyor serves causal language models"
            )
        self.activation = _activation(config)
        """``silu`` or ``gelu_tanh``: the MLP's gate."""
        self.hidden_size = config.hidden_size
        self.num_layers = config.num_hidden_layers
        self.total_num_heads = config.num_attention_heads
        self.total_num_kv_heads = (
            getattr(config, "num_key_value_heads", None) or self.total_num_heads
        )
        self.head_dim = (
            getattr(config, "head_dim", None) or self.hidden_size // self.total_num_heads
        )
        self.experts = ExpertShape.of(config, tp)
        """Mixtral's, Qwen2-MoE's and Qwen3-MoE's experts (``layers/moe.py``); None: dense."""
        self.total_intermediate_size = dense_width(config, self.experts)
        """The dense MLP's width; 0 when every layer's MLP is experts."""
        self.tp = tp
        self.split = HeadSplit.of(
            self.total_num_heads, self.total_num_kv_heads, self.total_intermediate_size, tp
        )
        self.num_heads = self.split.num_heads
        self.num_kv_heads = self.split.num_kv_heads
        self.intermediate_size = self.split.intermediate_size
        self.vocab_size = config.vocab_size
        self.vocab = VocabSplit.of(self.vocab_size, tp)
        """This rank's rows of the embedding and the LM head."""
        self.rms_norm_eps = config.rms_norm_eps
        self.max_position = config.max_position_embeddings
        self.qkv_bias, self.o_bias, self.mlp_bias = _biases(config)
        """Biases on q/k/v, on o_proj and on the MLP's projections."""
        olmo = self.model_type in OLMO
        self.qk_norm = self.model_type in ("qwen3", "qwen3_moe", "gemma3_text", "exaone4")
        """Qwen3, Gemma 3 and EXAONE 4 norm q and k per head (a norm of ``head_dim``)."""
        self.qk_norm_across_heads = olmo
        """OLMo 2/3 norm q and k over the whole projection (every head at once), before the
        rotary; under tensor parallelism the sum of squares is summed over the ranks."""
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        gemma = self.model_type in GEMMA
        self.norm_offset = 1.0 if gemma else 0.0
        """Added to every norm's checkpoint weight at load: Gemma's norms scale by 1 + weight."""
        self.norm_dtype = torch.float32 if gemma or olmo or self.model_type == "helium" else None
        """The norms' weight dtype (None: the model's): Gemma's, OLMo's and Helium's scale in
        float32 and round once (``layers/layernorm.py``)."""
        granite = self.model_type in ("granite", "granitemoe")
        self.embed_scale = (
            self.hidden_size**0.5
            if gemma
            else float(config.embedding_multiplier)
            if granite and config.embedding_multiplier != 1
            else None
        )
        """Gemma and Granite multiply the embedded tokens by this (not the tied LM head's
        rows); Gemma's is rounded to the model's dtype first (``embed_scale_rounded``)."""
        self.embed_scale_rounded = gemma
        self.residual_scale = float(config.residual_multiplier) if granite else 1.0
        """Granite: the attention's and the MLP's outputs are scaled by this before their
        residual adds; folded into o_proj and down_proj (the experts' w2) at load
        (``llama_weights.py``)."""
        self.logits_scaling = float(config.logits_scaling) if granite else 1.0
        """Granite divides its logits by this."""
        self.sandwich_norms = self.model_type in ("gemma2", "gemma3_text", "glm4")
        """Gemma 2/3 and GLM-4-0414: the attention's and the MLP's outputs are normed before
        their residual adds, and the MLP's input norm is ``pre_feedforward_layernorm`` (GLM's
        checkpoint names are mapped to Gemma's at load: ``loader.checkpoint_names``)."""
        self.post_norms = olmo or self.model_type == "exaone4"
        """OLMo 2/3 and EXAONE 4: no norm before the attention or the MLP (each reads the
        residual stream itself); their outputs are normed (``post_attention_layernorm``,
        ``post_feedforward_layernorm``) before their residual adds. EXAONE 4's norms round
        before they scale, as Llama's (``norm_dtype`` None)."""
        scalar = getattr(config, "query_pre_attn_scalar", None) if self.sandwich_norms else None
        self.attn_scale = (
            float(config.attention_multiplier)
            if granite
            else float(scalar or self.head_dim) ** -0.5
        )
        """The attention scores' scale: 1 / sqrt(head_dim), Gemma's ``query_pre_attn_scalar``'s,
        or Granite's ``attention_multiplier``."""
        # Only Gemma 2 caps the scores: transformers' and vLLM's Gemma 3 read no
        # attn_logit_softcapping, though its config holds the field.
        cap = (
            getattr(config, "attn_logit_softcapping", None) if self.model_type == "gemma2" else None
        )
        self.attn_softcap = float(cap or 0.0)
        """Gemma 2: attention scores are capped to ``cap * tanh(s / cap)``; 0: not capped."""
        cap = getattr(config, "final_logit_softcapping", None) if self.sandwich_norms else None
        self.final_softcap = float(cap or 0.0)
        """Gemma 2: the logits are capped the same way; 0: not capped."""
        self.windows = layer_windows(config)
        """Per layer, the keys a query sees (its own included); 0: all before it."""
        rope_types = rope_layer_types(config)
        self.ropes: list[tuple[torch.Tensor, float]] = []
        """Each rope table's (inverse frequencies, attention scaling): one, or one per layer
        type whose parameters differ (Gemma 3's full and sliding layers)."""
        type_table = []  # per entry of rope_types: its table in self.ropes
        for kind in rope_types or (None,):
            inv, scaling = rope_inv_freq(config, self.head_dim, context, kind)
            # Types whose parameters come out the same share a table (OLMo 3's sliding and
            # full layers without a scaled rope: its config nests a set per type all the same).
            same = [
                i for i, (u, a) in enumerate(self.ropes) if a == scaling and torch.equal(u, inv)
            ]
            if not same:
                self.ropes.append((inv, scaling))
            type_table.append(same[0] if same else len(self.ropes) - 1)
        unknown = set(getattr(config, "layer_types", None) or ()) - set(rope_types or ())
        if rope_types and unknown:
            raise ValueError(
                f"layer_types names {sorted(unknown)}, which rope_parameters has no entry for "
                f"(it has {list(rope_types)})"
            )
        tables = (
            tuple(type_table[rope_types.index(kind)] for kind in config.layer_types)
            if rope_types
            else (0,) * self.num_layers
        )
        self.layer_ropes: tuple[int | None, ...] = tuple(
            table if turns else None
            for table, turns in zip(tables, _rope_layers(config), strict=True)
        )
        """Per layer, the index of its table in ``ropes``; None: the layer turns neither q nor
        k (SmolLM3's NoPE layers, EXAONE 4's global ones)."""
        if len({inv.numel() for inv, _ in self.ropes}) > 1:
            raise ValueError("layer types that turn different shares of a head are not supported")
        self.inv_freq, self.rope_scaling = self.ropes[0]
        self.qk_order = rotary_row_order(
            self.head_dim, 2 * self.inv_freq.numel(), self.model_type in INTERLEAVED_ROPE
        )
        """A partial or interleaved rotary's order of a head's q/k dimensions
        (``layers/rotary.py``); None: the checkpoint's."""


def _biases(config) -> tuple[bool, bool, bool]:
    """(q/k/v, o_proj, MLP) biases, as each model type's transformers modules read its config:
    Llama's ``attention_bias`` is on all four projections; Qwen2's q/k/v biases are always
    there (Qwen2-MoE's with ``qkv_bias``); GLM's and Helium's ``attention_bias`` is on q/k/v
    only, and GLM's MLP has none; Seed-OSS has ``attention_out_bias`` for o_proj; ERNIE
    4.5's ``use_bias`` is on every projection; EXAONE 4 has none, whatever its config says."""
    kind = config.model_type

    def flag(name: str) -> bool:
        return bool(getattr(config, name, False))

    if kind == "exaone4":
        return False, False, False
    if kind == "ernie4_5":
        return (flag("use_bias"),) * 3
    mlp = kind not in GLM and flag("mlp_bias")
    if kind == "qwen2" or (kind == "qwen2_moe" and getattr(config, "qkv_bias", True)):
        return True, False, mlp
    attention = flag("attention_bias")
    if kind == "seed_oss":
        return attention, flag("attention_out_bias"), mlp
    if kind in (*GLM, "helium"):
        return attention, False, mlp
    return attention, attention, mlp


def _rope_layers(config) -> tuple[bool, ...]:
    """Per layer, whether it turns q and k: every layer but SmolLM3's NoPE ones, where
    ``no_rope_layers`` says 0 (its config fills the list: every fourth layer by default), and
    EXAONE 4's full layers where it has a ``sliding_window`` (its global layers turn nothing;
    without a window every layer turns, as transformers' ``Exaone4Attention`` reads it)."""
    layers = config.num_hidden_layers
    if config.model_type == "exaone4" and getattr(config, "sliding_window", None) is not None:
        return tuple(kind == "sliding_attention" for kind in config.layer_types)
    flags = getattr(config, "no_rope_layers", None) if config.model_type == "smollm3" else None
    if flags is None:
        return (True,) * layers
    if len(flags) < layers:
        raise ValueError(
            f"no_rope_layers has {len(flags)} entries for {layers} layers; it needs one a layer"
        )
    return tuple(bool(flag) for flag in flags[:layers])


def _activation(config) -> str:
    """The MLP gate's function as Conveyor names it, from transformers' name for it."""
    model_type = config.model_type
    if model_type in ("gemma2", "gemma3_text"):
        name = getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"
    else:
        name = getattr(config, "hidden_act", None) or "silu"
    if name in ("silu", "swish"):  # transformers' names for the same function
        return "silu"
    # Gemma's legacy "gelu" means the tanh approximation (transformers and vLLM read it so).
    # Gemma 2/3's "gelu" is exact GELU in transformers (vLLM refuses it): not this branch.
    if name in ("gelu_pytorch_tanh", "gelu_new") or (name == "gelu" and model_type == "gemma"):
        return "gelu_tanh"
    raise ValueError(
        f"hidden activation {name!r} is not supported; Conveyor's MLP gates with silu or "
        "gelu_pytorch_tanh"
    )
