"""Sampling through the whole engine on the built-in model: seeds, filters, stops, logprobs."""

from __future__ import annotations

import math

import pytest

from conveyor.runtime import LLM, SamplingParams, StructuredOutputParams


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("conveyor-tiny", max_total_tokens=4096, num_threads=1, device="cpu")


PROMPT = "Once upon a time"


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=1234)
    alone = llm.generate(PROMPT, p)[0].token_ids
    crowd = llm.generate(
        [PROMPT, "other", PROMPT],
        [p, SamplingParams(max_tokens=20, temperature=0.9), SamplingParams(max_tokens=16, seed=99)],
    )
    assert crowd[0].token_ids == alone
    assert crowd[2].token_ids != alone  # another seed, another draw


def test_top_k_one_and_tiny_top_p_are_greedy(llm):
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0].token_ids
    top_k = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=1.5, top_k=1))[0]
    top_p = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=1.5, top_p=1e-6))[0]
    min_p = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=1.5, min_p=1.0))[0]
    assert top_k.token_ids == greedy and top_p.token_ids == greedy and min_p.token_ids == greedy


def test_stop_token_ids_and_min_tokens(llm):
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0].token_ids
    stop_at = greedy[3]
    first = greedy.index(stop_at)
    out = llm.generate(
        PROMPT, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_at])
    )[0]
    assert out.token_ids == greedy[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    held = llm.generate(
        PROMPT,
        SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_at], min_tokens=12),
    )[0]
    assert stop_at not in held.token_ids and len(held.token_ids) == 12
    assert held.finish_reason == "length"


def test_stop_strings_cut_the_text(llm):
    full = llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0))[0]
    text = full.text
    needle = text[5:7]
    assert needle, "the reference output is too short for this test"
    out = llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0, stop=[needle]))[0]
    assert out.text == text[: text.index(needle)]
    assert out.finish_reason == "stop" and out.stop_reason == needle
    kept = llm.generate(
        PROMPT,
        SamplingParams(
            max_tokens=24, temperature=0, stop=[needle], include_stop_str_in_output=True
        ),
    )[0]
    assert kept.text == text[: text.index(needle) + len(needle)]


def test_ignore_eos_runs_to_max_tokens(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 40 and out.finish_reason == "length"


def test_logprobs_are_top_k_of_a_distribution(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=5, temperature=0, logprobs=3))[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == tok
        assert len(lp.top) == 3
        assert lp.top[0][0] == tok  # greedy: the sampled token is the most likely
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
        assert math.isclose(lp.logprob, lp.top[0][1], rel_tol=1e-5)
        assert sum(math.exp(x) for _, x in lp.top) <= 1.0 + 1e-5


def test_penalties_change_repetitive_output(llm):
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    assert len(set(plain.token_ids)) < 40, "the random model is expected to repeat itself"
    penalised = llm.generate(
        PROMPT,
        SamplingParams(
            max_tokens=40,
            temperature=0,
            ignore_eos=True,
            frequency_penalty=2.0,
            presence_penalty=2.0,
        ),
    )[0]
    assert len(set(penalised.token_ids)) > len(set(plain.token_ids))
    rep = llm.generate(
        PROMPT,
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, repetition_penalty=2.0),
    )[0]
    assert rep.token_ids != plain.token_ids


def test_timings_are_ordered(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert out.arrival_time <= out.first_scheduled_time <= out.first_token_time <= out.finish_time
    assert out.ttft >= 0 and out.tpot >= 0


def test_logit_bias_plus_100_forces_a_token(llm):
    forced = 97  # any token: +100 outweighs every logit of the random model
    for temperature in (0.0, 1.0):
        p = SamplingParams(max_tokens=8, temperature=temperature, logit_bias={forced: 100})
        assert llm.generate(PROMPT, p)[0].token_ids == [forced] * 8


def test_logit_bias_minus_100_moves_greedy_off_its_token(llm):
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0))[0].token_ids[0]
    crowd = llm.generate(
        [PROMPT, PROMPT],
        [
            SamplingParams(max_tokens=1, temperature=0, logit_bias={greedy: -100}),
            SamplingParams(max_tokens=1, temperature=0),  # shares the step, keeps its token
        ],
    )
    assert crowd[0].token_ids[0] != greedy
    assert crowd[1].token_ids == [greedy]


def test_logit_bias_is_checked_against_the_vocabulary(llm):
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(PROMPT, SamplingParams(max_tokens=1, logit_bias={10**6: 1.0}))
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={1: -101.0})


def test_constrained_and_free_requests_share_a_step(llm):
    """The grammar masks only its own row: a seeded free request next to constrained ones
    samples exactly what it samples alone."""
    free = SamplingParams(max_tokens=10, temperature=1.0, seed=7)
    alone = llm.generate(PROMPT, free)[0].token_ids
    digits = SamplingParams(
        max_tokens=10, temperature=1.0, structured_output=StructuredOutputParams(regex="[0-9]{4}")
    )
    out = llm.generate([PROMPT, PROMPT, PROMPT], [digits, free, digits])
    assert out[1].token_ids == alone
    assert all(len(o.text) == 4 and o.text.isdigit() for o in (out[0], out[2]))
    assert out[0].finish_reason == "stop"


def test_a_grammar_the_library_refuses_is_a_value_error_before_anything_runs(llm):
    bad = SamplingParams(structured_output=StructuredOutputParams(regex="(?<=a)b"))
    with pytest.raises(ValueError, match="Lookbehind"):
        llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=2), bad])
    assert not llm.engine.has_unfinished_requests()
