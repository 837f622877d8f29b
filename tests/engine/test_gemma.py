"""Gemma 1, 2 and 3 beside transformers: what the shared correctness tests (``model_dirs``'s
``gemma2`` and ``gemma3``: batching, chunking, preemption, prefix caching) do not reach.

Gemma 1's legacy ``gelu`` config, Gemma 2's capped logits (a cap never changes a greedy token,
only logprobs), the text model of a Gemma 3 image-text checkpoint, and the configs Conveyor
refuses."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from model_shapes import GEMMA2, GEMMA3, SMALL
from test_correctness import assert_generates_as, greedy_logprobs, make_engine, run_staggered

from conveyor.runtime.kernels import cpu
from conveyor.runtime.model.builtin import generate_model

GEMMA = dict(
    SMALL,
    architectures=["GemmaForCausalLM"],
    model_type="gemma",
    hidden_act="gelu",  # Gemma 1's released configs: transformers and vLLM read it as tanh GELU
    tie_word_embeddings=False,
)

BACKENDS = ["torch", "cpu"]


def _skip_without_cpu_kernels(backend: str) -> None:
    if backend == "cpu" and (not cpu.enabled() or cpu.load() is None):
        pytest.skip(f"the CPU kernels are {cpu.load_error()}")


def _requests(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(256) for _ in range(rng.randint(2, 60))], 16) for _ in range(n)]


@pytest.fixture(scope="module")
def gemma_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gemma")
    return {
        "gemma": str(generate_model(root / "gemma", GEMMA, seed=11)),
        "gemma2": str(generate_model(root / "gemma2", GEMMA2, seed=12)),
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_gemma1_greedy_tokens_equal_transformers(gemma_dirs, reference, backend):
    _skip_without_cpu_kernels(backend)
    engine = make_engine(gemma_dirs, "gemma", attention_backend=backend, chunked_prefill_size=16)
    requests = _requests(5, 1)
    outputs = run_staggered(engine, requests, [0, 0, 1, 3, 4])
    for i, (prompt, max_tokens) in enumerate(requests):
        assert outputs[f"r{i}"] == reference.greedy(gemma_dirs["gemma"], prompt, max_tokens), i


@pytest.mark.parametrize("backend", BACKENDS)
def test_gemma2_logprobs_are_of_the_capped_logits(gemma_dirs, backend):
    """Each generated token's logprob and top alternatives are transformers', whose logits
    are ``cap * tanh(logits / cap)``; the uncapped ones would give other numbers."""
    _skip_without_cpu_kernels(backend)
    from transformers import AutoModelForCausalLM

    path = gemma_dirs["gemma2"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = make_engine(gemma_dirs, "gemma2", attention_backend=backend)
    prompt = [random.Random(2).randrange(256) for _ in range(30)]
    logprobs = greedy_logprobs(engine, prompt, 4, 3)
    tokens = prompt + [lp.token_id for lp in logprobs]
    with torch.inference_mode():
        capped = torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), -1)
        hidden = hf.model(torch.tensor([tokens])).last_hidden_state
        uncapped = torch.log_softmax(hf.lm_head(hidden)[0].float(), -1)
    for i, lp in enumerate(logprobs):
        row = len(prompt) - 1 + i
        assert lp.logprob == pytest.approx(capped[row, lp.token_id].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == capped[row].topk(3).indices.tolist()
        assert abs(uncapped[row, lp.token_id].item() - lp.logprob) > 1e-2  # the cap matters


@pytest.fixture(scope="module")
def gemma3_image_text(tmp_path_factory) -> str:
    """A Gemma 3 image-text checkpoint (random weights, a small SigLIP tower) as
    transformers saves it, with a text decoder of ``GEMMA3``'s shape."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    root = tmp_path_factory.mktemp("gemma3-mm")
    text = generate_model(root / "text", GEMMA3, seed=13)  # its tokenizer and generation config
    text_config = {k: v for k, v in GEMMA3.items() if k not in ("architectures", "torch_dtype")}
    vision = dict(
        model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14,
    )  # fmt: skip
    config = Gemma3Config(
        text_config=text_config, vision_config=vision, mm_tokens_per_image=4,
        image_token_index=300, boi_token_index=301, eoi_token_index=302,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # norms near 1 (a fresh model's are exactly 1: no test of the offset)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") and "language_model" in name:
                param.normal_(0.0, 0.1)
    path = root / "model"
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(text / name, path / name)
    return str(path)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gemma3_image_text_checkpoint_serves_its_text_model(gemma3_image_text, backend):
    _skip_without_cpu_kernels(backend)
    from transformers import Gemma3ForConditionalGeneration

    saved = json.loads((Path(gemma3_image_text) / "config.json").read_text())
    assert saved["model_type"] == "gemma3" and "vision_config" in saved
    hf = Gemma3ForConditionalGeneration.from_pretrained(gemma3_image_text, dtype=torch.float32)
    engine = make_engine({"mm": gemma3_image_text}, "mm", attention_backend=backend)
    requests = _requests(4, 3)
    outputs = run_staggered(engine, requests, [0, 0, 1, 2])
    assert_generates_as(hf, requests, outputs)


GEMMA3_NO_SCALING = {k: v for k, v in GEMMA3.items() if k != "rope_scaling"}

ODD_CONFIGS = {
    # transformers' (and vLLM's) Gemma 3 reads no attn_logit_softcapping, Gemma 1 neither cap
    "gemma3-stray-score-cap": dict(GEMMA3, attn_logit_softcapping=1.0),
    "gemma1-stray-caps": dict(GEMMA, attn_logit_softcapping=1.0, final_logit_softcapping=1.0),
    # a flat rope_parameters: transformers nests a set per layer type beside its keys
    "gemma3-flat-rope": {
        **{k: v for k, v in GEMMA3_NO_SCALING.items() if k not in ("rope_theta",)},
        "rope_local_base_freq": 10_000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
    },
}


@pytest.mark.parametrize("name", ODD_CONFIGS)
def test_config_fields_are_read_as_transformers_reads_them(tmp_path, reference, name):
    path = str(generate_model(tmp_path / name, ODD_CONFIGS[name], seed=21))
    engine = make_engine({name: path}, name, attention_backend="torch")
    requests = _requests(3, 4)
    outputs = run_staggered(engine, requests, [0, 0, 1])
    for i, (prompt, max_tokens) in enumerate(requests):
        assert outputs[f"r{i}"] == reference.greedy(path, prompt, max_tokens), i


def test_gemma_configs_conveyor_cannot_serve_are_refused(tmp_path):
    embedding = generate_model(
        tmp_path / "embedding", dict(GEMMA3, use_bidirectional_attention=True), seed=1
    )
    with pytest.raises(ValueError, match="use_bidirectional_attention is set"):
        make_engine({"m": str(embedding)}, "m")
    relu = generate_model(tmp_path / "relu", dict(GEMMA2, hidden_activation="relu"), seed=1)
    with pytest.raises(ValueError, match="hidden activation 'relu' is not supported"):
        make_engine({"m": str(relu)}, "m")
    # Gemma 1's legacy "gelu" is the tanh approximation; Gemma 2/3's is exact GELU
    exact = generate_model(tmp_path / "exact", dict(GEMMA3, hidden_activation="gelu"), seed=1)
    with pytest.raises(ValueError, match="hidden activation 'gelu' is not supported"):
        make_engine({"m": str(exact)}, "m")
    chunked = dict(GEMMA3, layer_types=["sliding_attention", "chunked_attention"])
    odd = generate_model(tmp_path / "chunked", chunked, seed=1)
    with pytest.raises(ValueError, match=r"layer_types names \['chunked_attention'\]"):
        make_engine({"m": str(odd)}, "m")


def test_gemma2_and_3_refuse_float16_and_auto_picks_bfloat16_on_gpus(gemma_dirs):
    from conveyor.runtime.engine.model_runner import resolve_dtype
    from conveyor.runtime.model.loader import load_config, open_model

    config = load_config(open_model(gemma_dirs["gemma2"]))
    with pytest.raises(ValueError, match="numerically unstable in float16"):
        make_engine(gemma_dirs, "gemma2", dtype="float16")
    config.dtype = torch.float16  # a checkpoint converted to float16
    assert resolve_dtype("auto", config, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", config, torch.device("cpu")) == torch.float32
