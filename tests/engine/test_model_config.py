"""Conveyor's own config reads every value the engine uses as transformers' config would."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch

from conveyor.runtime.model.builtin import TINY_CONFIG
from conveyor.runtime.model.config import ModelConfig
from conveyor.runtime.model.loader import config_dtype
from conveyor.runtime.model.shape import DecoderShape

SMALL = dict(
    hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
    vocab_size=320,
)  # fmt: skip

CONFIGS = [
    # (model type, config.json's other keys): missing keys take each class's defaults
    *[(t, {}) for t in ("llama", "mistral", "qwen2", "qwen3", "phi3")],
    *[(t, SMALL) for t in ("llama", "mistral", "qwen2", "qwen3", "phi3")],
    ("llama", {**TINY_CONFIG}),
    ("llama", {**SMALL, "num_key_value_heads": 2, "head_dim": None, "rope_theta": 5e5}),
    ("llama", {**SMALL, "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
    ("llama", {**SMALL, "eos_token_id": [7, 9], "bos_token_id": None, "dtype": "bfloat16"}),
    ("llama", {**SMALL, "rope_scaling": {"type": "default"}, "rms_norm_eps": 1e-5}),
    ("mistral", {**SMALL, "head_dim": 64, "max_position_embeddings": 4096}),
    ("qwen2", {**SMALL, "head_dim": 64, "rope_parameters": {"rope_theta": 1e6}}),
    ("qwen3", {**SMALL, "num_key_value_heads": 1, "torch_dtype": "float16"}),
    ("mistral", {**SMALL, "sliding_window": 8}),
    ("mistral", {**SMALL, "sliding_window": None}),
    ("qwen2", {**SMALL, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}),
    ("qwen3", {**SMALL, "use_sliding_window": True, "layer_types": ["sliding_attention"] * 2}),
    ("llama", {**SMALL, "hidden_act": "swish"}),
    ("phi3", {**SMALL, "num_key_value_heads": 2, "partial_rotary_factor": 0.5}),
    ("phi3", {**SMALL, "sliding_window": 2047, "rope_scaling": None, "rope_theta": 250000.0}),
    ("granite", {}),
    ("granite", SMALL),
    (
        "granite",
        {
            **SMALL,
            "embedding_multiplier": 12.0,
            "attention_multiplier": 0.0078125,
            "residual_multiplier": 0.22,
            "logits_scaling": 8.0,
            "tie_word_embeddings": True,
        },
    ),
    ("smollm3", {}),
    ("smollm3", SMALL),
    ("smollm3", {**SMALL, "num_hidden_layers": 7, "no_rope_layer_interval": 3, "rope_theta": 5e6}),
    ("smollm3", {**SMALL, "no_rope_layers": [0, 1, 1], "attention_bias": True, "mlp_bias": True}),
    (
        "smollm3",
        {
            **SMALL,
            "num_hidden_layers": 8,
            "use_sliding_window": True,
            "sliding_window": 16,
            "tie_word_embeddings": False,
            "head_dim": 64,
        },
    ),
    ("olmo2", {}),
    ("olmo2", {**SMALL, "rope_theta": 500000.0}),
    ("olmo3", {}),  # its own theta (5e5), three sliding layers of every four
    ("olmo3", {**SMALL, "num_hidden_layers": 6, "sliding_window": 64}),
    (
        "olmo3",
        {**SMALL, "layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8},
    ),
    ("exaone4", {}),  # a window of 4096 in three layers of every four; the fourth turns no rope
    (
        "exaone4",
        {**SMALL, "num_hidden_layers": 7, "sliding_window": 64, "sliding_window_pattern": 3},
    ),
    ("exaone4", {**SMALL, "sliding_window": None, "layer_types": ["full_attention"] * 2}),
    (
        "exaone4",
        {**SMALL, "layer_types": ["full_attention", "sliding_attention"], "head_dim": 64},
    ),
    ("exaone4", {**SMALL, "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
    ("seed_oss", {}),
    ("seed_oss", {**SMALL, "num_key_value_heads": 2, "head_dim": 32}),
    ("seed_oss", {**SMALL, "attention_bias": False, "attention_out_bias": True, "mlp_bias": True}),
    *[(t, {}) for t in ("glm", "glm4", "ernie4_5")],
    *[(t, SMALL) for t in ("glm", "glm4", "ernie4_5")],
    ("glm", {**SMALL, "partial_rotary_factor": 1.0, "attention_bias": False, "head_dim": 64}),
    ("glm4", {**SMALL, "num_key_value_heads": 2, "rope_theta": 1e6, "eos_token_id": 7}),
    ("ernie4_5", {**SMALL, "use_bias": True, "head_dim": None, "tie_word_embeddings": False}),
]

READ = (
    "model_type", "hidden_size", "num_layers", "total_num_heads", "total_num_kv_heads",
    "head_dim", "total_intermediate_size", "vocab_size", "rms_norm_eps", "max_position",
    "qkv_bias", "o_bias", "mlp_bias", "qk_norm", "tie_word_embeddings", "rope_scaling",
    "windows", "embed_scale", "attn_scale", "residual_scale", "logits_scaling", "layer_ropes",
    "qk_norm_across_heads", "post_norms", "norm_dtype",
)  # fmt: skip
"""What ``DecoderShape`` takes from a config."""


def transformers_config(model_type: str, values: dict):
    from transformers import AutoConfig

    values = {k: v for k, v in values.items() if k != "model_type"}
    return AutoConfig.for_model(model_type, **values)


@pytest.mark.parametrize(("model_type", "values"), CONFIGS)
def test_the_engine_reads_what_transformers_config_says(model_type, values):
    ours = ModelConfig.from_values({**values, "model_type": model_type})
    theirs = transformers_config(model_type, values)
    assert ours is not None
    want, got = DecoderShape(theirs), DecoderShape(ours)
    for name in READ:
        assert getattr(got, name) == getattr(want, name), name
    assert torch.equal(got.inv_freq, want.inv_freq)
    assert ours.eos_token_id == theirs.eos_token_id
    assert config_dtype(ours) == config_dtype(theirs)
    assert DecoderShape(ModelConfig(**ours.to_dict())).head_dim == want.head_dim


@pytest.mark.parametrize(
    "values",
    [
        {"model_type": "gemma"},
        {"model_type": "llama", "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {"model_type": "llama", "rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
        {"model_type": "qwen2", "rope_parameters": {"full_attention": {"rope_theta": 1e4}}},
    ],
)
def test_what_it_does_not_model_is_left_to_transformers(values):
    assert ModelConfig.from_values(values) is None


def test_exaone4_reads_its_hub_configs_pattern_string_and_a_config_without_a_window():
    """EXAONE's hub configs write ``sliding_window_pattern`` as a string ("LLLG": three local
    layers, then a global one), which transformers' class cannot derive ``layer_types`` from;
    it reads as the number 4 does. Without a window (and no ``layer_types``, where the class
    divides by zero) every layer is full and turns the rope."""
    values = {**SMALL, "model_type": "exaone4", "num_hidden_layers": 6}
    by_string = DecoderShape(ModelConfig.from_values({**values, "sliding_window_pattern": "LLLG"}))
    by_number = DecoderShape(ModelConfig.from_values({**values, "sliding_window_pattern": 4}))
    assert by_string.windows == by_number.windows == (4096, 4096, 4096, 0, 4096, 4096)
    assert by_string.layer_ropes == by_number.layer_ropes == (0, 0, 0, None, 0, 0)
    no_window = DecoderShape(ModelConfig.from_values({**values, "sliding_window": None}))
    assert no_window.windows == (0,) * 6 and no_window.layer_ropes == (0,) * 6
    with pytest.raises(ValueError, match="neither a number nor a string of L"):
        ModelConfig.from_values({**values, "sliding_window_pattern": "LLXG"})


def test_exaone4_reads_its_pattern_string_beside_a_rope_transformers_config_holds(tmp_path):
    """A scaled rope (EXAONE 4.0 32B's llama3) leaves the config to transformers, whose
    ``Exaone4Config`` cannot take the hub configs' ``sliding_window_pattern`` string: it is
    read as the number 4 is."""
    from conveyor.runtime.model.loader import ModelFiles, load_config

    rope = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    values = {**SMALL, "model_type": "exaone4", "num_hidden_layers": 6, "rope_scaling": rope}
    (tmp_path / "config.json").write_text(json.dumps({**values, "sliding_window_pattern": "LLLG"}))
    got = DecoderShape(load_config(ModelFiles(tmp_path)))
    want = DecoderShape(transformers_config("exaone4", {**values, "sliding_window_pattern": 4}))
    assert got.windows == want.windows == (4096, 4096, 4096, 0, 4096, 4096)
    assert got.layer_ropes == want.layer_ropes
    assert torch.equal(got.inv_freq, want.inv_freq)


def test_reading_a_config_imports_no_transformers(tmp_path):
    """The import this module exists to avoid (torch.distributed.tensor, sympy: seconds)."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from conveyor.runtime.model.loader import ModelFiles, load_config\n"
        f"config = load_config(ModelFiles(Path({str(tmp_path)!r})))\n"
        "assert type(config).__name__ == 'ModelConfig', type(config)\n"
        "loaded = [m for m in ('transformers', 'sympy') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "values",
    [{**SMALL}, {**SMALL, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
      "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}],
    ids=["plain-rope", "llama3-rope"],
)  # fmt: skip
def test_every_tensor_of_a_model_lives_on_the_device_it_is_built_on(values):
    """The engine builds its model under ``with torch.device(...)``: a buffer computed on the
    CPU instead (the rotary tables once were) fails the first step on a GPU. ``meta`` stands
    in for the GPU here."""
    from conveyor.runtime.model.llama import LlamaForCausalLM

    config = transformers_config("llama", values)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend=None)  # type: ignore[arg-type]
    tensors = [*model.named_parameters(), *model.named_buffers()]
    assert any(name.startswith("rotaries.") for name, _ in tensors)
    assert [name for name, t in tensors if t.device.type != "meta"] == []


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_an_activation_other_than_silu_or_tanh_gelu_is_refused_not_run_as_either(model_type):
    """The MLP gates with silu or GELU's tanh approximation; a config asking for another
    activation (exact GELU here) is refused, whichever config reads it."""
    values = {**SMALL, "hidden_act": "gelu"}
    ours = ModelConfig.from_values({**values, "model_type": model_type})
    for config in (ours, transformers_config(model_type, values)):
        with pytest.raises(ValueError, match="hidden activation 'gelu' is not supported"):
            DecoderShape(config)
        tanh = copy.copy(config)
        tanh.hidden_act = "gelu_pytorch_tanh"
        assert DecoderShape(tanh).activation == "gelu_tanh"


@pytest.mark.parametrize(
    ("head", "tied"),
    [("other", False), ("copy", True), (None, True)],
)
def test_a_tied_config_beside_a_head_of_its_own_serves_that_head(tmp_path, head, tied):
    """transformers 5 unties a config's ``tie_word_embeddings`` when the checkpoint holds an
    ``lm_head.weight`` of other values than the embedding (and loads that head); an equal
    copy, or none, stays tied."""
    from safetensors.torch import save_file

    from conveyor.runtime.model.loader import ModelFiles, load_config

    config = {"model_type": "llama", **SMALL, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    embed = torch.randn(320, 256, generator=torch.Generator().manual_seed(0))
    tensors = {"model.embed_tokens.weight": embed}
    if head is not None:
        tensors["lm_head.weight"] = embed.clone() if head == "copy" else embed * 2
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert load_config(ModelFiles(tmp_path)).tie_word_embeddings is tied


@pytest.mark.parametrize(
    ("values", "method"),
    [
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "fp8"),
        ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "awq"),
        ({"text_config": {"quantization_config": {"quant_method": "gptq"}}}, "gptq"),
    ],
)
def test_a_quantized_checkpoint_is_refused_naming_its_method(tmp_path, values, method):
    """Its weights would not fit the float layers (scales beside them, packed integers): it is
    refused before any weight is read, with what to use instead."""
    from conveyor.runtime.model.loader import ModelFiles, load_config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **SMALL, **values}))
    with pytest.raises(ValueError, match=f"quantized \\(quantization_config: {method}\\).*GGUF"):
        load_config(ModelFiles(tmp_path))
