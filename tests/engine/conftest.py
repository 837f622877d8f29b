"""Model directories and the Hugging Face reference for the engine's correctness tests."""

from __future__ import annotations

import pytest
from model_shapes import (
    ERNIE4_5,
    EXAONE4,
    GEMMA2,
    GEMMA3,
    GLM,
    GLM4,
    GRANITE,
    GRANITEMOE,
    HELIUM,
    MINISTRAL,
    MINISTRAL3,
    MIXTRAL,
    OLMO2,
    OLMO3,
    PHI3,
    QWEN2,
    QWEN2_MOE,
    QWEN3,
    QWEN3_MOE,
    SEED_OSS,
    SMOLLM3,
)

from conveyor.runtime.model.builtin import TINY_CONFIG, builtin_model_path, generate_model


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {
        "conveyor-tiny": str(builtin_model_path()),
        "qwen2": str(generate_model(root / "qwen2", QWEN2, seed=1)),
        "qwen3": str(generate_model(root / "qwen3", QWEN3, seed=2)),
        "phi3": str(generate_model(root / "phi3", PHI3, seed=3)),
        "gemma2": str(generate_model(root / "gemma2", GEMMA2, seed=4)),
        "gemma3": str(generate_model(root / "gemma3", GEMMA3, seed=5)),
        "mixtral": str(generate_model(root / "mixtral", MIXTRAL, seed=6)),
        "qwen3_moe": str(generate_model(root / "qwen3_moe", QWEN3_MOE, seed=7)),
        "qwen2_moe": str(generate_model(root / "qwen2_moe", QWEN2_MOE, seed=8)),
        "granite": str(generate_model(root / "granite", GRANITE, seed=9)),
        "granitemoe": str(generate_model(root / "granitemoe", GRANITEMOE, seed=10)),
        "smollm3": str(generate_model(root / "smollm3", SMOLLM3, seed=11)),
        "olmo2": str(generate_model(root / "olmo2", OLMO2, seed=11)),
        "olmo3": str(generate_model(root / "olmo3", OLMO3, seed=12)),
        "exaone4": str(generate_model(root / "exaone4", EXAONE4, seed=13)),
        "seed_oss": str(generate_model(root / "seed_oss", SEED_OSS, seed=14)),
        "glm": str(generate_model(root / "glm", GLM, seed=15)),
        "glm4": str(generate_model(root / "glm4", GLM4, seed=16)),
        "ernie4_5": str(generate_model(root / "ernie4_5", ERNIE4_5, seed=17)),
        "ministral": str(generate_model(root / "ministral", MINISTRAL, seed=18)),
        "ministral3": str(generate_model(root / "ministral3", MINISTRAL3, seed=19)),
        "helium": str(generate_model(root / "helium", HELIUM, seed=20)),
    }


class Reference:
    """Greedy outputs of transformers' ``generate`` on the same model directory, cached."""

    def __init__(self) -> None:
        self._models: dict[str, object] = {}
        self._cache: dict[tuple, list[int]] = {}

    def greedy(self, model_dir: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (model_dir, tuple(prompt_ids), max_new_tokens)
        if key not in self._cache:
            import torch
            from transformers import AutoModelForCausalLM

            if model_dir not in self._models:
                self._models[model_dir] = AutoModelForCausalLM.from_pretrained(
                    model_dir, dtype=torch.float32
                ).eval()
            model = self._models[model_dir]
            ids = torch.tensor([prompt_ids])
            with torch.inference_mode():
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                )
            self._cache[key] = out[0, len(prompt_ids) :].tolist()
        return self._cache[key]


@pytest.fixture(scope="session")
def reference() -> Reference:
    return Reference()


__all__ = ["TINY_CONFIG"]
