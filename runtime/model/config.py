"""A model's hyper-parameters as the engine reads them, without transformers' config classes.

transformers 5's config classes of the Llama family import ``transformers.activations``, which
pulls ``torch.distributed.tensor`` and sympy: 2-3 s of every replica's start, only to hold a
dozen numbers. ``ModelConfig`` holds the fields the decoder, the KV cache and the stop tokens
read, with the defaults and derived values of ``LlamaConfig``, ``MistralConfig``,
``Qwen2Config``, ``Qwen3Config``, ``Phi3Config``, ``GraniteConfig``, ``SmolLM3Config``,
``Olmo2Config``, ``Olmo3Config``, ``Exaone4Config``, ``SeedOssConfig``, ``GlmConfig``,
``Glm4Config`` and ``Ernie4_5Config`` (tests/engine/test_model_config.py
compares every field with transformers'). Whatever it does not model -- another model type, a scaled rope (whose
frequencies transformers' own initialisers compute), rope parameters per layer type -- still
gets transformers' config: ``from_values`` says None.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

DEFAULT_ROPE_THETA = 10_000.0
"""transformers' ``RotaryEmbeddingConfigMixin.default_theta``, for a config that names none."""

# model_type -> the class defaults (transformers 5) of the fields below that a config.json may
# leave out; fields missing here default to the dataclass's own.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=None, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2,
    ),
    "mistral": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096 * 32,
        bos_token_id=1, eos_token_id=2, sliding_window=4096,
    ),
    "qwen2": dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=32768,
        sliding_window=4096, max_window_layers=28,
    ),
    "qwen3": dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, head_dim=128,
        max_position_embeddings=32768, sliding_window=4096, max_window_layers=28,
    ),
    "phi3": dict(
        vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=None, max_position_embeddings=4096,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=32000, pad_token_id=32000,
    ),
    "granite": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=None, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2,
    ),
    "smollm3": dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=32768,
        bos_token_id=128000, eos_token_id=128001, pad_token_id=128004, tie_word_embeddings=True,
    ),
    "olmo2": dict(
        vocab_size=50304, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=None, max_position_embeddings=2048,
        rms_norm_eps=1e-5, pad_token_id=1, eos_token_id=50279,
    ),
    "olmo3": dict(
        vocab_size=50304, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=None, max_position_embeddings=2048,
        rms_norm_eps=1e-5, pad_token_id=1, eos_token_id=50279, sliding_window=4096,
    ),
    "exaone4": dict(
        vocab_size=102400, hidden_size=4096, intermediate_size=16384, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048,
        rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=2, sliding_window=4096,
        sliding_window_pattern=4,
    ),
    "seed_oss": dict(
        vocab_size=155136, hidden_size=4096, intermediate_size=27648, num_hidden_layers=64,
        num_attention_heads=80, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=524288, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        attention_bias=True,
    ),
    "glm": dict(
        vocab_size=151552, hidden_size=4096, intermediate_size=13696, num_hidden_layers=40,
        num_attention_heads=32, num_key_value_heads=2, head_dim=128,
        max_position_embeddings=131072, rms_norm_eps=1.5625e-07, pad_token_id=151329,
        eos_token_id=[151329, 151336, 151338], attention_bias=True, partial_rotary_factor=0.5,
    ),
    "ernie4_5": dict(
        vocab_size=103424, hidden_size=1024, intermediate_size=3072, num_hidden_layers=18,
        num_attention_heads=16, num_key_value_heads=2, head_dim=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=True,
    ),
}  # fmt: skip
_DEFAULTS["glm4"] = _DEFAULTS["glm"]

_DEFAULT_THETA = {"smollm3": 2_000_000.0, "olmo3": 500_000.0, "ernie4_5": 500_000.0}
"""The rope theta of a config that names none, where its class's ``default_theta`` is not
``DEFAULT_ROPE_THETA``."""

_HEAD_DIM_FROM_HIDDEN = ("llama", "mistral", "phi3", "seed_oss", "glm", "glm4", "ernie4_5")
"""Types whose config derives a missing head_dim as hidden_size // num_attention_heads (Qwen2
has no such field: the decoder derives it the same way; Qwen3's default is 128)."""


@dataclass
class ModelConfig:
    """The fields of a Llama-family config that Conveyor reads (``shape.DecoderShape``,
    ``layers/rotary.py``, ``engine/state.py``), under transformers' names."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rope_parameters: dict[str, Any]
    """``{"rope_type": "default", "rope_theta": ...}``: only the plain rope is held here."""
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """Llama's: biases on q/k/v and o_proj; Seed-OSS's: on q/k/v only."""
    attention_out_bias: bool = False
    """Seed-OSS: a bias on o_proj."""
    use_bias: bool = False
    """ERNIE 4.5: biases on every projection, the MLP's too."""
    mlp_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    dtype: str | None = None
    """The checkpoint's dtype name (``float32``, ``bfloat16``); None where it says none."""
    rope_freq_factors: list[float] | None = None
    """Per-frequency rope factors of a Llama 3.x GGUF (``layers/rotary.py``)."""
    sliding_window: int | None = None
    """Keys a query sees, its own included, in a sliding-window layer (``layer_windows``);
    Qwen2's and Qwen3's only with ``use_sliding_window``."""
    use_sliding_window: bool = False
    max_window_layers: int = 0
    """Qwen2/Qwen3: layers from this index on slide, where ``layer_types`` is not given."""
    layer_types: list[str] | None = None
    """``full_attention`` or ``sliding_attention`` per layer (Qwen2, Qwen3, OLMo 3: by default
    three sliding layers, then a full one)."""
    partial_rotary_factor: float = 1.0
    """The share of a head's dimensions the rotary turns (Phi-4-mini: 0.75)."""
    embedding_multiplier: float = 1.0
    """Granite: the embedded tokens are multiplied by this."""
    attention_multiplier: float = 1.0
    """Granite: the attention scores' scale (in place of 1 / sqrt(head_dim))."""
    residual_multiplier: float = 1.0
    """Granite: the attention's and the MLP's outputs are multiplied by this before their
    residual adds."""
    logits_scaling: float = 1.0
    """Granite: the logits are divided by this."""
    no_rope_layers: list[int] | None = None
    """SmolLM3: per layer, 1 where it turns q and k with the rope, 0 where it does not (a NoPE
    layer); filled from ``no_rope_layer_interval`` where config.json leaves it out."""
    no_rope_layer_interval: int = 4
    """SmolLM3: every this-many-th layer is a NoPE layer, where ``no_rope_layers`` is not given."""
    sliding_window_pattern: int | str | None = None
    """EXAONE 4: every this-many-th layer is a full one, the others slide, where
    ``layer_types`` is not given (4: three local layers, then a global one); also written as
    a string of L (local) and G (global) repeated over the layers, as EXAONE's hub configs do."""

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> ModelConfig | None:
        """The config of ``values`` (a config.json's, or the same keys from a GGUF); None
        where transformers' config must be used (see the module docstring)."""
        model_type = values.get("model_type")
        if model_type not in _DEFAULTS:
            return None
        rope = _plain_rope(values, _DEFAULT_THETA.get(model_type, DEFAULT_ROPE_THETA))
        if rope is None:
            return None
        fields = {f.name for f in dataclasses.fields(cls)}
        given = {k: v for k, v in values.items() if k in fields and k != "rope_parameters"}
        if "dtype" not in given and isinstance(values.get("torch_dtype"), str):
            given["dtype"] = values["torch_dtype"]
        config = cls(**{**_DEFAULTS[model_type], **given, "rope_parameters": rope})
        if config.head_dim is None and model_type in _HEAD_DIM_FROM_HIDDEN:
            config.head_dim = config.hidden_size // config.num_attention_heads
        if config.num_key_value_heads is None:
            config.num_key_value_heads = config.num_attention_heads
        if model_type == "smollm3":
            _smollm3_layers(config)
        if model_type == "olmo3" and config.layer_types is None:  # as Olmo3Config fills it
            config.layer_types = [
                "full_attention" if (i + 1) % 4 == 0 else "sliding_attention"
                for i in range(config.num_hidden_layers)
            ]
        if model_type == "exaone4":
            _exaone4_layers(config)
        return config

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict (a tensor-parallel rank gets the config this way)."""
        return dataclasses.asdict(self)


def _smollm3_layers(config: ModelConfig) -> None:
    """SmolLM3Config's derived lists: a NoPE layer every ``no_rope_layer_interval`` layers
    (the 4th, 8th, ...), and, with ``use_sliding_window`` and a ``sliding_window``, the NoPE
    layers sliding (``layer_types``)."""
    layers, every = config.num_hidden_layers, config.no_rope_layer_interval
    if config.no_rope_layers is None:
        config.no_rope_layers = [int((i + 1) % every != 0) for i in range(layers)]
    if config.layer_types is None:
        slides = config.use_sliding_window and config.sliding_window is not None
        config.layer_types = [
            "sliding_attention" if slides and not config.no_rope_layers[i] else "full_attention"
            for i in range(layers)
        ]


def _exaone4_layers(config: ModelConfig) -> None:
    """Exaone4Config's ``layer_types`` where config.json leaves it out: with a
    ``sliding_window``, every ``sliding_window_pattern``-th layer full and the others sliding
    (4 by default; an ``LLLG`` string read letter by letter, repeated); without one, every
    layer full (where transformers' class divides by a pattern of 0)."""
    if config.layer_types is None:
        config.layer_types = exaone4_layer_types(
            config.num_hidden_layers, config.sliding_window, config.sliding_window_pattern
        )


def exaone4_layer_types(layers: int, sliding_window: Any, pattern: Any) -> list[str]:
    """EXAONE 4's ``layer_types`` from its ``sliding_window`` and ``sliding_window_pattern``
    (``_exaone4_layers``)."""
    if sliding_window is None or not pattern:
        return ["full_attention"] * layers
    if isinstance(pattern, str):
        letters = pattern.upper()
        if set(letters) - {"L", "G"}:
            raise ValueError(
                f"sliding_window_pattern {pattern!r} is neither a number nor a string of L "
                "(local) and G (global)"
            )
        return [
            "sliding_attention" if letters[i % len(letters)] == "L" else "full_attention"
            for i in range(layers)
        ]
    return [
        "sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(layers)
    ]


def transformers_values(values: dict[str, Any]) -> dict[str, Any]:
    """config.json's ``values`` as transformers' config class can read them: EXAONE 4's hub
    configs write ``sliding_window_pattern`` as a string ("LLLG"), which ``Exaone4Config``
    cannot derive ``layer_types`` from (it takes the pattern modulo), so they are spelled
    out. ``values`` itself where nothing needs it."""
    pattern = values.get("sliding_window_pattern")
    if values.get("model_type") != "exaone4" or not isinstance(pattern, str):
        return values
    if values.get("layer_types") is not None:
        return values
    layers = values.get("num_hidden_layers", _DEFAULTS["exaone4"]["num_hidden_layers"])
    window = values.get("sliding_window", _DEFAULTS["exaone4"]["sliding_window"])
    return {**values, "layer_types": exaone4_layer_types(layers, window, pattern)}


def _plain_rope(values: dict[str, Any], default_theta: float) -> dict[str, Any] | None:
    """transformers' standardised ``rope_parameters`` for a plain rope; None for any other."""
    # transformers reads a legacy ``rope_scaling`` in preference to ``rope_parameters``.
    given = values.get("rope_scaling") or values.get("rope_parameters") or {}
    if not isinstance(given, dict) or any(isinstance(v, dict) for v in given.values()):
        return None  # per-layer-type parameters
    rope = dict(given)
    rope.setdefault("rope_theta", values.get("rope_theta", default_theta))
    rope.setdefault("rope_type", rope.get("type", "default"))
    return rope if rope["rope_type"] == "default" and rope["rope_theta"] is not None else None


def layer_windows(config: Any) -> tuple[int, ...]:
    """Per layer, how many keys a query sees, its own included (0: every key before it), as
    transformers' masks read ``config`` (a ``ModelConfig`` or transformers' own): Mistral
    slides in every layer when ``sliding_window`` is set (its class default is 4096; Ministral
    3's is none; Ministral's own slides in the layers ``layer_types`` names), and so
    does Phi-3 (Phi-3-mini-4k's config says 2047; the class default is none), Mixtral and
    Qwen3-MoE (whose configs set it only with ``use_sliding_window``); Qwen2 and
    Qwen3 only with ``use_sliding_window``, in the layers ``layer_types`` names (by default
    those from ``max_window_layers`` on); Gemma 2 and 3 in the layers ``layer_types`` names
    (every other one, five of every six), and so do Qwen2-MoE, OLMo 3 (three of every four, by
    default), SmolLM3 (whose config marks its NoPE layers sliding where
    ``use_sliding_window`` is on; transformers' masks and vLLM slide in whichever layers
    ``layer_types`` marks) and EXAONE 4 (three local layers of every four, where it has a
    ``sliding_window``); Llama, Gemma, OLMo 2 and Seed-OSS never. A query at position ``i`` then sees
    keys ``i - window + 1 .. i``."""
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None) or 0
    if config.model_type in ("mistral", "ministral3", "phi3", "mixtral", "qwen3_moe"):
        return (window,) * layers
    filled = ("gemma2", "gemma3_text", "qwen2_moe", "olmo3", "smollm3", "exaone4", "ministral")
    if config.model_type in filled:
        return tuple(window if kind == "sliding_attention" else 0 for kind in config.layer_types)
    if config.model_type not in ("qwen2", "qwen3") or not getattr(
        config, "use_sliding_window", False
    ):
        return (0,) * layers
    types = getattr(config, "layer_types", None) or [
        "sliding_attention" if window and i >= config.max_window_layers else "full_attention"
        for i in range(layers)
    ]
    return tuple(window if kind == "sliding_attention" else 0 for kind in types)
