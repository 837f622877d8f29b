"""``conveyor bench peer``'s side-by-side check of answers: probing a real server, comparing."""

from __future__ import annotations

import json
from pathlib import Path

from conveyor.bench.peers import agreement
from conveyor.bench.procs import ChildProcess


def test_a_server_agrees_with_itself_token_for_token(server: ChildProcess, tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 320}))
    prompts = agreement.prompts(tmp_path, 3, seed=1)
    assert prompts == agreement.prompts(tmp_path, 3, seed=1)  # the same for every server
    assert all(8 <= len(p) <= 120 and max(p) < 320 for p in prompts)
    first = agreement.probe(server.url, "conveyor-tiny", prompts, 6)
    second = agreement.probe(server.url, "conveyor-tiny", prompts, 6)
    assert [len(a.tokens) for a in first] == [6, 6, 6]  # ignore_eos: every answer is whole
    assert all(len(a.top[0]) == agreement.TOP for a in first)
    result = agreement.compare(first, second)
    assert result["identical"] == 3 and result["divergences"] == []
    assert result["positions_compared"] == 18 and result["top_sets_equal"] == 18
    assert result["max_abs_logprob_delta"] == 0.0
    assert "identical 3/3" in agreement.format_agreement(result, "itself")


def _answer(tokens: list[int], logprobs: list[float]) -> agreement.Answer:
    top = [{t: lp, t + 1: lp - 0.5} for t, lp in zip(tokens, logprobs, strict=True)]
    return agreement.Answer(tokens, logprobs, top)


def test_a_divergence_is_found_with_its_margin_and_stops_the_comparison():
    ours = [_answer([1, 2, 3], [-0.1, -0.2, -0.3]), _answer([4, 5, 6], [-1.0, -1.0, -1.0])]
    theirs = [_answer([1, 2, 3], [-0.1, -0.25, -0.3]), _answer([4, 9, 6], [-1.0, -1.0, -1.0])]
    theirs[1].top[1][5] = -1.0005  # our choice, just below the peer's
    result = agreement.compare(ours, theirs)
    assert result["identical"] == 1
    assert result["positions_compared"] == 3 + 1  # the second prompt only up to its divergence
    assert abs(result["max_abs_logprob_delta"] - 0.05) < 1e-9
    [d] = result["divergences"]
    assert d["prompt"] == 1 and d["position"] == 1 and abs(d["margin"] - 5e-4) < 1e-9
    text = agreement.format_agreement(result, "vllm")
    assert "identical 1/2" in text and "near tie" in text


def test_answers_of_other_lengths_and_tokens_outside_the_top_are_said_so():
    ours = [_answer([1, 2], [-0.1, -0.2]), _answer([4, 5], [-1.0, -1.0])]
    theirs = [_answer([1, 2, 3], [-0.1, -0.2, -0.3]), _answer([4, 9], [-1.0, -1.0])]
    result = agreement.compare(ours, theirs)
    assert result["identical"] == 0
    short, outside = result["divergences"]
    assert short == {"prompt": 0, "position": 2, "lengths": [2, 3]}
    assert outside["margin"] is None  # our 5 is not in the peer's top at that position
    json.dumps(result, allow_nan=False)  # results.json stays strict JSON
    text = agreement.format_agreement(result, "vllm")
    assert "2 and 3 long" in text and "not among vllm's top" in text
