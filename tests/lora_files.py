"""The base model with a LoRA adapter merged into its weights: the reference an adapter's
outputs must match (adapters are written by ``conveyor.bench.engine.lora_adapters``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from conveyor.bench.engine.lora_adapters import FUSED_MODULES, MODULES, write_adapter

__all__ = ["FUSED_MODULES", "MODULES", "write_adapter", "write_merged"]


def write_merged(
    out: Path, model_dir: Path, tensors: dict[str, torch.Tensor], scaling: float
) -> Path:
    """``model_dir``'s model with W + scaling * B @ A for each of the adapter's modules."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(model_dir, out)
    weights = load_file(str(model_dir / "model.safetensors"))
    for key, a in tensors.items():
        if ".lora_A." in key:
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            name = key.removeprefix("base_model.model.").replace(".lora_A", "")
            weights[name] = weights[name] + scaling * (b @ a)
    save_file(weights, str(out / "model.safetensors"))
    return out
