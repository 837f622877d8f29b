"""Sliding-window attention: Mistral's (every layer, 4096 keys unless the config says
otherwise), Phi-3's (every layer, where the config says), Qwen2's and Qwen3's (``use_sliding_window``, the layers ``layer_types`` or
``max_window_layers`` pick) and SmolLM3's (its NoPE layers, with ``use_sliding_window``) give transformers' greedy tokens once a context is longer than
the window, on every CPU attention path, batched, chunked and prefix-cached. Before, the
window was ignored and the tokens differed from the first one past it."""

from __future__ import annotations

import random

import pytest
import torch
from model_shapes import SMALL

from conveyor.runtime import SamplingParams
from conveyor.runtime.engine.llm_engine import LLMEngine
from conveyor.runtime.engine.settings import EngineSettings
from conveyor.runtime.kernels import cpu
from conveyor.runtime.model.builtin import generate_model
from conveyor.runtime.model.config import ModelConfig, layer_windows

MISTRAL = dict(SMALL, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=16)
QWEN2 = dict(
    SMALL, architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=True,
    sliding_window=12, max_window_layers=1,
)  # fmt: skip
QWEN3 = dict(
    SMALL, architectures=["Qwen3ForCausalLM"], model_type="qwen3", use_sliding_window=True,
    sliding_window=9, layer_types=["sliding_attention", "full_attention"],
)  # fmt: skip
PHI3 = dict(SMALL, architectures=["Phi3ForCausalLM"], model_type="phi3", sliding_window=10)
SMOLLM3 = dict(
    SMALL, architectures=["SmolLM3ForCausalLM"], model_type="smollm3", use_sliding_window=True,
    sliding_window=10, no_rope_layers=[1, 0], pad_token_id=None, tie_word_embeddings=False,
)  # fmt: skip
"""Its config slides the NoPE layers (the second) when ``use_sliding_window`` is on."""
CONFIGS = {"mistral": MISTRAL, "qwen2": QWEN2, "qwen3": QWEN3, "phi3": PHI3, "smollm3": SMOLLM3}

BACKENDS = ["torch", "cpu"]
"""The C++ kernels run the layers in one call for Mistral and Qwen2 (``decoder.cpp``) and
per layer for Qwen3 (its q/k norm)."""


@pytest.fixture(scope="module")
def windowed_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("windowed")
    return {
        name: str(generate_model(root / name, config, seed=11 + i))
        for i, (name, config) in enumerate(CONFIGS.items())
    }


def _run(engine: LLMEngine, requests: list[tuple[list[int], int]]) -> list[list[int]]:
    """Every request added at once (more than fit in one step), run to the end; an EOS
    ends one, as it ends transformers' generate."""
    for i, (prompt, max_tokens) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    outputs: dict[str, list[int]] = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        outputs.update({o.request_id: o.output_token_ids for o in engine.step() if o.finished})
    return [outputs[f"r{i}"] for i in range(len(requests))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", list(CONFIGS))
def test_greedy_tokens_equal_transformers_past_the_window(windowed_dirs, reference, model, backend):
    if backend == "cpu" and (not cpu.enabled() or cpu.load() is None):
        pytest.skip(f"the CPU kernels are {cpu.load_error()}")
    rng = random.Random(5)
    shared = [rng.randrange(256) for _ in range(40)]  # a prefix cached across requests
    requests = [([rng.randrange(256) for _ in range(n)], 20) for n in (3, 14, 30, 75)]
    requests += [(shared + [rng.randrange(256) for _ in range(n)], 12) for n in (5, 33)]
    engine = LLMEngine(
        EngineSettings(
            model=windowed_dirs[model], device="cpu", attention_backend=backend,
            max_total_tokens=4096, num_threads=1, chunked_prefill_size=32, block_size=16,
        )
    )  # fmt: skip
    got = _run(engine, requests)
    for (prompt, max_tokens), tokens in zip(requests, got, strict=True):
        expected = reference.greedy(windowed_dirs[model], prompt, max_tokens)
        assert tokens == expected, f"{model} on {backend}: a prompt of {len(prompt)} tokens differs"


WINDOW_CONFIGS = [
    pytest.param(dict(MISTRAL), id="mistral-16"),
    pytest.param({k: v for k, v in MISTRAL.items() if k != "sliding_window"}, id="mistral-default"),
    pytest.param(dict(MISTRAL, sliding_window=None), id="mistral-none"),
    pytest.param(dict(QWEN2), id="qwen2-max-window-layers"),
    pytest.param(dict(QWEN2, use_sliding_window=False), id="qwen2-off"),
    pytest.param(dict(QWEN2, num_hidden_layers=4, max_window_layers=2), id="qwen2-4-layers"),
    pytest.param(
        {k: v for k, v in QWEN2.items() if k not in ("sliding_window", "max_window_layers")},
        id="qwen2-defaults",
    ),
    pytest.param(dict(QWEN3), id="qwen3-layer-types"),
    pytest.param(dict(QWEN3, use_sliding_window=False), id="qwen3-off"),
    pytest.param(
        dict(SMALL, architectures=["LlamaForCausalLM"], model_type="llama", sliding_window=8),
        id="llama-ignores",
    ),
    pytest.param(dict(SMOLLM3), id="smollm3-nope-layers"),
    pytest.param(dict(SMOLLM3, use_sliding_window=False), id="smollm3-off"),
    pytest.param(
        dict(SMOLLM3, num_hidden_layers=8, no_rope_layers=None, no_rope_layer_interval=3),
        id="smollm3-interval",
    ),
]


@pytest.mark.parametrize("values", WINDOW_CONFIGS)
def test_layer_windows_are_transformers_per_layer_windows(values):
    """The window of each layer, from Conveyor's config and from transformers' config, is
    the one transformers' own attention layers use (0 where they attend to everything)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    values = {k: v for k, v in values.items() if k != "torch_dtype"}
    hf_config = AutoConfig.for_model(**values)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    expected = []
    for layer in model.model.layers:
        window = getattr(layer.self_attn, "sliding_window", None)
        expected.append(window or 0)
    if values["model_type"] == "mistral":  # its mask is sliding wherever the config has one
        expected = [hf_config.sliding_window or 0] * hf_config.num_hidden_layers
    assert list(layer_windows(hf_config)) == expected
    ours = ModelConfig.from_values(values)
    assert ours is not None
    assert list(layer_windows(ours)) == expected
