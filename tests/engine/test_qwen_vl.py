"""Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's image-text checkpoints: their text model is served as the Qwen2
or Qwen3 it is for text (a text token's multimodal rope is the plain rope of its position), the
vision tower beside it is not read."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from model_shapes import QWEN2, QWEN3
from test_correctness import assert_generates_as, make_engine, run_staggered

from conveyor.runtime.model.builtin import generate_model

SPECIAL = dict(image_token_id=310, video_token_id=311, vision_start_token_id=312)
"""Vision token ids past the prompts' (0-299)."""


def _qwen2_5_vl():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = {k: v for k, v in QWEN2.items() if k not in ("architectures", "torch_dtype")}
    text |= dict(
        model_type="qwen2_5_vl_text", rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}
    )
    vision = dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128,
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
        fullatt_block_indexes=[0],
    )  # fmt: skip
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **SPECIAL)
    return Qwen2_5_VLForConditionalGeneration, config


def _qwen2_vl():
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = {k: v for k, v in QWEN2.items() if k not in ("architectures", "torch_dtype")}
    text |= dict(
        model_type="qwen2_vl_text", rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}
    )
    vision = dict(
        depth=1, embed_dim=32, hidden_size=128, num_heads=2, mlp_ratio=2, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2,
    )  # fmt: skip
    config = Qwen2VLConfig(text_config=text, vision_config=vision, **SPECIAL)
    return Qwen2VLForConditionalGeneration, config


def _qwen3_vl():
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text = {k: v for k, v in QWEN3.items() if k not in ("architectures", "torch_dtype")}
    text |= dict(
        model_type="qwen3_vl_text",
        rope_scaling={
            "rope_type": "default",
            "mrope_section": [4, 6, 6],
            "mrope_interleaved": True,
        },
    )
    vision = dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128,
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
        deepstack_visual_indexes=[0],
    )  # fmt: skip
    config = Qwen3VLConfig(text_config=text, vision_config=vision, **SPECIAL)
    return Qwen3VLForConditionalGeneration, config


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def image_text(tmp_path_factory, request) -> tuple[str, type]:
    """A random-weight checkpoint as transformers saves it, with a tokenizer of the text
    shape's; (its directory, its transformers class)."""
    root = tmp_path_factory.mktemp(request.param)
    shape = QWEN3 if request.param == "qwen3_vl" else QWEN2
    text = generate_model(root / "text", shape, seed=7)  # its tokenizer and generation config
    cls, config = {"qwen2_vl": _qwen2_vl, "qwen2_5_vl": _qwen2_5_vl, "qwen3_vl": _qwen3_vl}[
        request.param
    ]()
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():  # a fresh model's norms are exactly 1, its weights tiny: spread them
        for name, param in model.named_parameters():
            if "visual" not in name:
                param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.1)
    path = root / "model"
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(text / name, path / name)
    return str(path), cls


def test_the_text_model_of_a_qwen_vl_checkpoint_is_served(image_text):
    path, cls = image_text
    saved = json.loads((Path(path) / "config.json").read_text())
    assert "vision_config" in saved
    hf = cls.from_pretrained(path, dtype=torch.float32).eval()
    engine = make_engine({"mm": path}, "mm")
    rng = random.Random(3)
    requests = [([rng.randrange(300) for _ in range(rng.randrange(4, 40))], 8) for _ in range(4)]
    outputs = run_staggered(engine, requests, [0, 0, 1, 2])
    assert_generates_as(hf, requests, outputs)
