"""The model shapes ``conveyor bench gpu`` measures, as model directories with random or
dummy weights (configs and the built-in tokenizer; nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "vocab_size": 128256,
    "torch_dtype": "bfloat16",
}
"""Llama-3-8B's shapes."""
LLAMA_1B = {
    **LLAMA_8B,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "tie_word_embeddings": True,
}
"""Llama-3.2-1B's shapes (without its rope scaling)."""
TINY = {
    **LLAMA_8B,
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
}
"""For ``--smoke`` (the script's own check on a machine without a GPU)."""


def write_model_dir(path: Path, config: dict) -> Path:
    """config.json + the built-in byte-level tokenizer (small: the model's vocab stays as is)."""
    from conveyor.runtime.model.builtin import _write_config, _write_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(path, {**config, "vocab_size": 320})
    _write_config(path, config)
    return path
