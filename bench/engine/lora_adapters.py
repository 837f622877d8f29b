"""Random PEFT LoRA adapters of a model, written by hand (no peft dependency): what
``conveyor bench lora`` serves and the LoRA tests check against merged weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
"""What PEFT targets in a Phi-3, whose checkpoint fuses q/k/v and gate/up."""
BLOCK = {
    m: "self_attn" if m in (*MODULES[:4], "qkv_proj") else "mlp" for m in MODULES + FUSED_MODULES
}


def dims_from_config(config: dict) -> tuple[int, dict[str, tuple[int, int]]]:
    """(layers, checkpoint module -> (out, in) features) of a Llama-family config.json."""
    h, heads = config["hidden_size"], config["num_attention_heads"]
    d = config.get("head_dim") or h // heads
    q, kv = heads * d, (config.get("num_key_value_heads") or heads) * d
    i = config["intermediate_size"]
    dims = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i),
            "qkv_proj": (q + 2 * kv, h), "gate_up_proj": (2 * i, h)}  # fmt: skip
    return config["num_hidden_layers"], dims


def write_adapter(
    out: Path,
    shape: tuple[int, dict[str, tuple[int, int]]] | Path,
    seed: int,
    rank: int = 8,
    alpha: float = 16,
    modules: tuple[str, ...] = MODULES,
    layers: list[int] | None = None,
    std: float = 0.1,
    **config: object,
) -> dict[str, torch.Tensor]:
    """A random adapter in folder ``out`` for a model of ``shape`` ((layers, module dims), or
    a model folder holding config.json); returns its tensors."""
    if isinstance(shape, Path):
        shape = dims_from_config(json.loads((shape / "config.json").read_text()))
    num_layers, dims = shape
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(num_layers) if layers is None else layers:
        for m in modules:
            o, n = dims[m]
            key = f"base_model.model.model.layers.{i}.{BLOCK[m]}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n, generator=g) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(o, rank, generator=g) * std
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    peft = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "bias": "none",
            "target_modules": list(modules), **config}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(peft))
    return tensors
