"""Phi-3's rope: a partial rotary (Phi-4-mini turns three quarters of each head) and LongRoPE's
two sets of factors (the 128k models) give transformers' greedy tokens on every CPU attention
path. The short factors serve a replica whose ``--max-model-len`` fits the original context
(as transformers turns such a sequence), the long ones any other (as transformers turns a
sequence past it). The fused checkpoint, batching, chunking, prefix caching and tensor
parallelism are the shared correctness tests' (``model_dirs["phi3"]``)."""

from __future__ import annotations

import random

import pytest
from model_shapes import PHI3
from test_correctness import make_engine, run_staggered

from conveyor.runtime.kernels import cpu
from conveyor.runtime.model.builtin import generate_model

ORIGINAL = 64
"""``original_max_position_embeddings`` of the LongRoPE model below."""

LONGROPE = dict(
    PHI3,
    max_position_embeddings=4 * ORIGINAL,
    original_max_position_embeddings=ORIGINAL,
    rope_scaling={
        "type": "longrope",  # what Phi-3's configs say; transformers reads it as longrope
        "short_factor": [1.0 + 0.05 * i for i in range(12)],  # 24 turning dims of 32
        "long_factor": [1.5 + 0.4 * i for i in range(12)],
    },
)


@pytest.fixture(scope="module")
def longrope(tmp_path_factory) -> dict[str, str]:
    return {"longrope": str(generate_model(tmp_path_factory.mktemp("phi3") / "m", LONGROPE, 7))}


def _requests(lengths: tuple[int, ...], max_tokens: int) -> list[tuple[list[int], int]]:
    rng = random.Random(sum(lengths))
    return [([rng.randrange(256) for _ in range(n)], max_tokens) for n in lengths]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("served", ["original", "long"])
def test_longrope_greedy_tokens_equal_transformers(longrope, reference, backend, served):
    if backend == "cpu" and (not cpu.enabled() or cpu.load() is None):
        pytest.skip(f"the CPU kernels are {cpu.load_error()}")
    if served == "original":  # every sequence fits: the short factors, as transformers
        requests, settings = _requests((3, 17, 40), 20), {"max_model_len": ORIGINAL}
    else:  # prompts past the original length: the long factors, as transformers
        requests, settings = _requests((70, 90, 130), 16), {}
    engine = make_engine(
        longrope, "longrope", attention_backend=backend, chunked_prefill_size=32, block_size=16,
        **settings,
    )  # fmt: skip
    try:
        outputs = run_staggered(engine, requests, [0, 0, 2])
    finally:
        engine.close()
    for i, (prompt, max_tokens) in enumerate(requests):
        expected = reference.greedy(longrope["longrope"], prompt, max_tokens)
        assert outputs[f"r{i}"] == expected, f"a prompt of {len(prompt)} tokens differs"


def test_the_two_sets_of_factors_give_other_tokens(longrope, reference):
    """The served length picks the factors: the long ones on a short prompt are not what
    transformers gives it (so the test above tells the two apart)."""
    requests = _requests((3, 17, 40), 20)
    engine = make_engine(longrope, "longrope", attention_backend="torch")
    try:
        outputs = run_staggered(engine, requests, [0, 0, 0])
    finally:
        engine.close()
    expected = [reference.greedy(longrope["longrope"], p, n) for p, n in requests]
    assert [outputs[f"r{i}"] for i in range(len(requests))] != expected
