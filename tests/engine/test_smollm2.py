"""The built-in real model, SmolLM2-135M-Instruct from its PyPI wheel (a Q4_1 GGUF).

Greedy generation equals transformers reading the same file, token for token, on varied chat
prompts (4 to about 2,400 tokens), batched, with prefill chunks smaller than a KV block, and with
the system prompt the chat template adds found in the prefix cache. Then the answers themselves:
a question with one right answer, and a stop at ``<|im_end|>``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_correctness import run_staggered
from test_gguf import GGUFReference

from conveyor.runtime import SamplingParams
from conveyor.runtime.engine.llm import LLM
from conveyor.runtime.engine.llm_engine import LLMEngine
from conveyor.runtime.engine.settings import EngineSettings
from conveyor.runtime.model.builtin import builtin_model_path

MODEL = "smollm2-135m-instruct"
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "Explain in one sentence why the sky is blue.",
    "def fibonacci(n):",
    "Summarise this text: " + "The river flows past the old mill and on to the sea. " * 180,
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return builtin_model_path(MODEL)


@pytest.fixture(scope="module")
def engine_factory():
    def make(**settings) -> LLMEngine:
        settings.setdefault("max_total_tokens", 16384)
        settings.setdefault("num_threads", 1)
        return LLMEngine(EngineSettings(model=MODEL, device="cpu", **settings))

    return make


@pytest.fixture(scope="module")
def prompts(engine_factory) -> list[list[int]]:
    """Chat prompts through the model's own template, and one raw 4-token prompt."""
    tok = engine_factory(max_total_tokens=4096).tokenizer
    chats = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in QUESTIONS
    ]
    return [tok.encode(c) for c in [*chats, "Once upon a time"]]


@pytest.fixture(scope="module")
def expected(smollm2, prompts) -> list[list[int]]:
    reference = GGUFReference()
    return [reference.greedy(smollm2, p, MAX_TOKENS) for p in prompts]


def test_prompts_span_short_to_long(prompts):
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) >= 8 and lengths[0] <= 8 and lengths[-1] > 2000


def test_batched_matches_transformers(engine_factory, prompts, expected):
    engine = engine_factory(max_running_requests=8)
    requests = [(p, MAX_TOKENS) for p in prompts]
    outputs = run_staggered(engine, requests, [0, 0, 0, 1, 1, 2, 3, 5], ignore_eos=True)
    for i in range(len(prompts)):
        assert outputs[f"r{i}"] == expected[i], f"prompt {i} ({len(prompts[i])} tokens)"


def test_small_chunks_and_the_prefix_cache_match_transformers(engine_factory, prompts, expected):
    """Chunks of 7 tokens (under a 16-token block); the chat template's system prompt is
    shared by every chat prompt, so later ones start from cached blocks."""
    engine = engine_factory(max_running_requests=4, chunked_prefill_size=7)
    short = [i for i, p in enumerate(prompts) if len(p) < 200]
    requests = [(prompts[i], MAX_TOKENS) for i in short]
    arrivals = [6 * n for n in range(len(requests))]
    outputs = run_staggered(engine, requests, arrivals, ignore_eos=True)
    assert engine.stats().prefix_cache_hits >= 16 * (len(short) - 2)
    for n, i in enumerate(short):
        assert outputs[f"r{n}"] == expected[i], f"prompt {i} ({len(prompts[i])} tokens)"


def test_answers_and_stops_at_im_end():
    llm = LLM(MODEL, max_total_tokens=4096, num_threads=2)
    chat = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=False,
    )  # fmt: skip
    (result,) = llm.generate([chat], SamplingParams(max_tokens=48, temperature=0))
    assert "Paris" in result.text
    assert result.finish_reason == "stop"
    assert result.token_ids[-1] == llm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert "<|im_end|>" not in result.text and "<|im_start|>" not in result.text


def test_tensor_parallel_over_three_ranks_matches_transformers(engine_factory, prompts, expected):
    """Its 9 attention heads and 3 KV heads split over 3 ranks (shared memory on CPU; not 2), its tied
    49,152-row embedding split in three, each rank loading its shard of the Q4_1 file: the
    short prompts batched give transformers' tokens."""
    engine = engine_factory(max_running_requests=8, tensor_parallel_size=3)
    try:
        short = [i for i, p in enumerate(prompts) if len(p) < 200]
        requests = [(prompts[i], MAX_TOKENS) for i in short]
        outputs = run_staggered(
            engine, requests, [n // 2 for n in range(len(short))], ignore_eos=True
        )
        for n, i in enumerate(short):
            assert outputs[f"r{n}"] == expected[i], f"prompt {i} ({len(prompts[i])} tokens)"
    finally:
        engine.close()
