"""Phi-3's rope: a partial rotary (Phi-4-mini turns three quarters of each head) and LongRoPE's
two sets of factors (the 128k models) give transformers' greedy tokens on every CPU attention
path. The short factors serve a replica whose context fits the original one (the default, as
vLLM's; as transformers turns such a sequence), the long ones any other (as transformers
turns a sequence past it). The fused checkpoint, batching, chunking, prefix caching and tensor
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
@pytest.mark.parametrize("served", ["original", "default", "long"])
def test_longrope_greedy_tokens_equal_transformers(longrope, reference, backend, served):
    if backend == "cpu" and (not cpu.enabled() or cpu.load() is None):
        pytest.skip(f"the CPU kernels are {cpu.load_error()}")
    if served == "original":  # every sequence fits: the short factors, as transformers
        requests, settings = _requests((3, 17, 40), 20), {"max_model_len": ORIGINAL}
    elif served == "default":  # no --max-model-len: the original context, set once the model
        # is built (for the model's whole length), and the factors rewritten to fit it
        requests, settings = _requests((3, 17, 40), 20), {}
    else:  # prompts past the original length: the long factors, as transformers
        requests, settings = _requests((70, 90, 130), 16), {"max_model_len": 4 * ORIGINAL}
    settings.setdefault("max_total_tokens", 4096)
    engine = make_engine(
        longrope, "longrope", attention_backend=backend, chunked_prefill_size=32, block_size=16,
        **settings,
    )  # fmt: skip
    try:
        assert served == "long" or engine.max_model_len == ORIGINAL
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
    engine = make_engine(longrope, "longrope", attention_backend="torch", max_model_len=256)
    try:
        outputs = run_staggered(engine, requests, [0, 0, 0])
    finally:
        engine.close()
    expected = [reference.greedy(longrope["longrope"], p, n) for p, n in requests]
    assert [outputs[f"r{i}"] for i in range(len(requests))] != expected


def test_checkpoints_the_decoder_cannot_read_are_refused_with_the_reason(tmp_path):
    from safetensors.torch import load_file, save_file

    def start(folder) -> None:
        make_engine({"m": str(folder)}, "m", attention_backend="torch").close()

    folder = generate_model(tmp_path / "m", PHI3, seed=1)
    good = load_file(str(folder / "model.safetensors"))
    q_rows = PHI3["num_attention_heads"] * PHI3["head_dim"]
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    gate_up = "model.layers.1.mlp.gate_up_proj.weight"
    for changed, why in (
        ({"model.layers.0.self_attn.q_proj.weight": good[qkv][:q_rows]}, "given twice"),
        ({gate_up: good[gate_up][:-1]}, r"gate_up_proj.*has 511 rows, expected 256 \+ 256"),
    ):
        tensors = {k: v.clone() for k, v in {**good, **changed}.items()}
        save_file(tensors, str(folder / "model.safetensors"))
        with pytest.raises(ValueError, match=why):
            start(folder)
    # a LongRoPE that would turn an odd number of dimensions
    odd = dict(LONGROPE, head_dim=16, hidden_size=64, partial_rotary_factor=0.3125)
    odd["rope_scaling"] = dict(
        LONGROPE["rope_scaling"], short_factor=[1.0] * 2, long_factor=[2.0] * 2
    )
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        start(generate_model(tmp_path / "odd", odd, seed=2))
