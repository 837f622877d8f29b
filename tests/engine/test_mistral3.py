"""Mistral 3's image-text checkpoints (Mistral Small 3.1 and 3.2): their Mistral text model is
served, the Pixtral image tower and projector beside it are not read."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from model_shapes import SMALL
from test_correctness import assert_generates_as, make_engine, run_staggered

from conveyor.runtime.model.builtin import generate_model

TEXT = dict(
    SMALL,
    architectures=["MistralForCausalLM"],
    model_type="mistral",
    sliding_window=None,
    rope_theta=1_000_000.0,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def mistral3_image_text(tmp_path_factory, request) -> str:
    """A Mistral 3 image-text checkpoint (random weights, a small Pixtral tower) as
    transformers saves it, with a text decoder of ``TEXT``'s shape. Its text config says the
    head is untied; the whole model's config decides (tied: no lm_head is saved)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    root = tmp_path_factory.mktemp("mistral3")
    text = generate_model(root / "text", TEXT, seed=5)  # its tokenizer and generation config
    text_config = {k: v for k, v in TEXT.items() if k not in ("architectures", "torch_dtype")}
    vision = dict(
        model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, head_dim=16, image_size=28, patch_size=14,
    )  # fmt: skip
    config = Mistral3Config(
        text_config=text_config, vision_config=vision, image_token_index=300,
        spatial_merge_size=2, tie_word_embeddings=request.param,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Mistral3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # a fresh model's norms are exactly 1, its weights tiny: spread them
        for name, param in model.named_parameters():
            if "language_model" in name or "lm_head" in name:
                param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.1)
    path = root / "model"
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(text / name, path / name)
    return str(path)


def test_the_text_model_of_a_mistral3_checkpoint_is_served(mistral3_image_text):
    from transformers import Mistral3ForConditionalGeneration

    saved = json.loads((Path(mistral3_image_text) / "config.json").read_text())
    assert saved["model_type"] == "mistral3" and "vision_config" in saved
    hf = Mistral3ForConditionalGeneration.from_pretrained(mistral3_image_text, dtype=torch.float32)
    engine = make_engine({"mm": mistral3_image_text}, "mm")
    rng = random.Random(3)
    requests = [([rng.randrange(300) for _ in range(rng.randrange(4, 40))], 8) for _ in range(4)]
    outputs = run_staggered(engine, requests, [0, 0, 1, 2])
    assert_generates_as(hf, requests, outputs)
