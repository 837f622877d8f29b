"""Greedy generation equals transformers' ``generate`` token for token, however it is batched.

Batched, chunked, preempted and prefix-cached generation all have to reproduce
the reference exactly: any bookkeeping slip in the KV cache shows up as a
different token.
"""

from __future__ import annotations

import random

import pytest

from conveyor.runtime import SamplingParams
from conveyor.runtime.engine.llm_engine import LLMEngine
from conveyor.runtime.engine.settings import EngineSettings

MODELS = [
    "conveyor-tiny",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma2",
    "gemma3",
    "mixtral",
    "qwen3_moe",
    "qwen2_moe",
    "granite",
    "granitemoe",
    "smollm3",
    "olmo2",
    "olmo3",
    "exaone4",
    "seed_oss",
    "glm",
    "glm4",
    "ernie4_5",
    "ministral",
    "ministral3",
    "helium",
]


def make_engine(model_dirs, model: str, **settings) -> LLMEngine:
    settings.setdefault("max_total_tokens", 4096)
    settings.setdefault("num_threads", 1)
    return LLMEngine(EngineSettings(model=model_dirs[model], device="cpu", **settings))


def workload(n: int, seed: int, vocab: int = 256) -> list[tuple[list[int], int]]:
    """``n`` (prompt ids, max_tokens) pairs with varied lengths, prompts of byte tokens."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(vocab) for _ in range(rng.randint(1, 90))], rng.randint(1, 24))
        for _ in range(n)
    ]


def run_staggered(
    engine: LLMEngine, requests, arrivals: list[int], *, ignore_eos: bool = False
) -> dict[str, list[int]]:
    """Add request i at engine step ``arrivals[i]``; run until all finish."""
    outputs: dict[str, list[int]] = {}
    step = 0
    pending = sorted(range(len(requests)), key=lambda i: arrivals[i])
    while pending or engine.has_unfinished_requests():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            prompt, max_tokens = requests[i]
            engine.add_request(
                f"r{i}",
                prompt,
                SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos),
            )
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.output_token_ids
        step += 1
        assert step < 10_000, "engine did not finish"
    return outputs


def assert_generates_as(hf, requests, outputs: dict[str, list[int]]) -> None:
    """Each request's output (``run_staggered``'s) is what transformers model ``hf`` generates
    greedily from the same prompt, one at a time."""
    import torch

    for i, (prompt, max_tokens) in enumerate(requests):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            expected = hf.eval().generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                do_sample=False,
            )[0, len(prompt):].tolist()  # fmt: skip
        assert outputs[f"r{i}"] == expected, i


def greedy_logprobs(engine: LLMEngine, prompt: list[int], max_tokens: int, top: int) -> list:
    """The ``Logprob`` of each token a greedy request for ``prompt`` generates, with its
    ``top`` alternatives."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=top)
    engine.add_request("logprobs", prompt, params)
    logprobs = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            logprobs += out.new_logprobs
    return logprobs


def assert_matches_reference(model_dirs, reference, model, requests, outputs):
    for i, (prompt, max_tokens) in enumerate(requests):
        expected = reference.greedy(model_dirs[model], prompt, max_tokens)
        assert outputs[f"r{i}"] == expected, f"request {i} (prompt {len(prompt)} tokens) differs"


@pytest.mark.parametrize("model", MODELS)
def test_one_request(model_dirs, reference, model):
    engine = make_engine(model_dirs, model)
    requests = [(list(b"The quick brown fox jumps over the lazy dog"), 24)]
    outputs = run_staggered(engine, requests, [0])
    assert_matches_reference(model_dirs, reference, model, requests, outputs)


@pytest.mark.parametrize("model", MODELS)
def test_sixteen_requests_arriving_at_different_steps(model_dirs, reference, model):
    engine = make_engine(model_dirs, model, max_running_requests=8, chunked_prefill_size=64)
    requests = workload(16, seed=1)
    arrivals = [0, 0, 0, 1, 1, 2, 3, 5, 5, 8, 13, 13, 21, 22, 30, 34]
    outputs = run_staggered(engine, requests, arrivals)
    assert_matches_reference(model_dirs, reference, model, requests, outputs)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill(model_dirs, reference, model, chunk):
    engine = make_engine(model_dirs, model, max_running_requests=4, chunked_prefill_size=chunk)
    requests = workload(6, seed=2)
    outputs = run_staggered(engine, requests, [0, 0, 1, 2, 2, 4])
    assert_matches_reference(model_dirs, reference, model, requests, outputs)


@pytest.mark.parametrize("model", MODELS)
def test_preemption_keeps_outputs(model_dirs, reference, model):
    # 12 blocks of 8 tokens: a handful of 90-token prompts cannot all stay resident.
    engine = make_engine(
        model_dirs,
        model,
        max_total_tokens=160,
        block_size=8,
        max_running_requests=8,
        chunked_prefill_size=48,
        max_model_len=160,
    )
    requests = [(p, 24) for p, _ in workload(8, seed=3)]
    outputs = run_staggered(engine, requests, [0] * 8)
    assert engine.stats().preemptions > 0, "the KV cache was meant to be too small"
    assert_matches_reference(model_dirs, reference, model, requests, outputs)
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("model", MODELS)
def test_shared_prefixes_hit_the_cache(model_dirs, reference, model):
    engine = make_engine(model_dirs, model, block_size=8, max_running_requests=4)
    system = list(b"You are a helpful assistant. Answer briefly and precisely. ")
    requests = [(system + list(q), 12) for q in (b"What is 2+2?", b"Name a colour.", b"Hi")]
    requests.append((list(requests[0][0]), 12))  # an identical prompt, later
    outputs = run_staggered(engine, requests, [0, 3, 6, 40])
    stats = engine.stats()
    assert stats.prefix_cache_hits >= 3 * (len(system) // 8) * 8
    assert_matches_reference(model_dirs, reference, model, requests, outputs)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mode", ["static", "none"])
def test_static_and_none_modes(model_dirs, reference, model, mode):
    engine = make_engine(model_dirs, model, scheduler=mode, max_running_requests=4)
    requests = workload(7, seed=4)
    outputs = run_staggered(engine, requests, [0, 0, 0, 1, 2, 2, 9])
    assert_matches_reference(model_dirs, reference, model, requests, outputs)


@pytest.mark.parametrize("model_type", ["glm", "glm4", "exaone4", "ernie4_5"])
def test_bias_keys_the_models_modules_do_not_read_add_no_bias(tmp_path, reference, model_type):
    """transformers' GLM MLP has no biases whatever ``mlp_bias`` says, nor have EXAONE 4's or
    ERNIE 4.5's projections whatever ``attention_bias`` / ``mlp_bias`` say (ERNIE's follow
    ``use_bias``): such a config.json's checkpoint has none, and the engine serves it as
    transformers does."""
    from model_shapes import ERNIE4_5, EXAONE4, GLM, GLM4

    from conveyor.runtime.model.builtin import generate_model

    shape = {"glm": GLM, "glm4": GLM4, "exaone4": EXAONE4, "ernie4_5": ERNIE4_5}[model_type]
    config = {**shape, "mlp_bias": True, "attention_bias": model_type in ("glm", "glm4")}
    if model_type == "ernie4_5":
        config |= {"use_bias": False, "attention_bias": True}
    dirs = {model_type: str(generate_model(tmp_path / model_type, config, seed=18))}
    requests = [(list(b"The quick brown fox jumps over the lazy dog"), 12)]
    outputs = run_staggered(make_engine(dirs, model_type), requests, [0])
    assert_matches_reference(dirs, reference, model_type, requests, outputs)
