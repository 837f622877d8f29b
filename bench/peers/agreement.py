"""Do Conveyor and the peer compute the same thing? Greedy tokens and logprobs, side by side.

Speed is only worth comparing between servers that give the same answers. ``probe`` sends each
server the same prompts (random token ids, seeded) as greedy completions with the top
logprobs, the tokens named by id (vLLM's ``return_tokens_as_token_ids``, which both serve);
``compare`` then counts the sequences that are identical, and over the positions before any
divergence reports the largest difference of the chosen token's logprob and whether the
top-k sets agree. A first divergence where the two leading tokens are closer than the
logprobs' noise is a near tie, not an error; it is reported with its margin.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

TOP = 5
"""Alternatives per position."""


@dataclass
class Answer:
    """One greedy completion: per position, the token id, its logprob and the top ``TOP``."""

    tokens: list[int]
    logprobs: list[float]
    top: list[dict[int, float]]


def prompts(path: Path, n: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of 8-120 random token ids below the model's ``vocab_size`` (its
    config.json), the same for every server."""
    vocab = int(json.loads((path / "config.json").read_text())["vocab_size"])
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(8, 120))] for _ in range(n)]


def probe(url: str, model: str, batch: list[list[int]], max_tokens: int) -> list[Answer]:
    """Each prompt's greedy completion from the server at ``url``, one request at a time (so
    batching cannot change the arithmetic between the servers)."""
    answers = []
    with httpx.Client(base_url=url, timeout=300.0) as client:
        for prompt in batch:
            body = {
                "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "logprobs": TOP, "return_tokens_as_token_ids": True, "ignore_eos": True,
            }  # fmt: skip
            response = client.post("/v1/completions", json=body)
            response.raise_for_status()
            answers.append(_answer(response.json()["choices"][0]["logprobs"]))
    return answers


def _answer(logprobs: dict[str, Any]) -> Answer:
    def token_id(name: str) -> int:
        return int(name.removeprefix("token_id:"))

    return Answer(
        tokens=[token_id(t) for t in logprobs["tokens"]],
        logprobs=[float(lp) for lp in logprobs["token_logprobs"]],
        top=[{token_id(t): float(lp) for t, lp in top.items()} for top in logprobs["top_logprobs"]],
    )


def compare(ours: list[Answer], theirs: list[Answer]) -> dict[str, Any]:
    """How far ``ours`` and ``theirs`` (the same prompts' answers) agree."""
    identical, max_delta, top_sets_equal, positions = 0, 0.0, 0, 0
    ties: list[dict[str, Any]] = []
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        same = 0
        while same < min(len(a.tokens), len(b.tokens)) and a.tokens[same] == b.tokens[same]:
            same += 1
        identical += same == len(a.tokens) == len(b.tokens)
        for p in range(same):
            positions += 1
            max_delta = max(max_delta, abs(a.logprobs[p] - b.logprobs[p]))
            top_sets_equal += set(a.top[p]) == set(b.top[p])
        if same < min(len(a.tokens), len(b.tokens)):
            # the margin between the two servers' choices, in the peer's logprobs (None: ours
            # is not among its top alternatives)
            ours_there = b.top[same].get(a.tokens[same])
            margin = None if ours_there is None else b.logprobs[same] - ours_there
            ties.append({"prompt": i, "position": same, "margin": margin})
        elif len(a.tokens) != len(b.tokens):  # one answer ends where the other goes on
            ties.append({"prompt": i, "position": same, "lengths": [len(a.tokens), len(b.tokens)]})
    return {
        "prompts": len(ours),
        "identical": identical,
        "positions_compared": positions,
        "max_abs_logprob_delta": max_delta,
        "top_sets_equal": top_sets_equal,
        "divergences": ties,
    }


def format_agreement(result: dict[str, Any], peer: str) -> str:
    """The comparison as the bench prints it."""
    lines = [
        f"agreement with {peer}: greedy sequences identical {result['identical']}/"
        f"{result['prompts']}; over {result['positions_compared']} positions before any "
        f"divergence, max |logprob delta| {result['max_abs_logprob_delta']:.2e}, top-{TOP} "
        f"sets equal at {result['top_sets_equal']}/{result['positions_compared']}"
    ]
    for d in result["divergences"]:
        where = f"  prompt {d['prompt']} diverges at token {d['position']}: "
        if "lengths" in d:
            lines.append(where + f"the answers are {d['lengths'][0]} and {d['lengths'][1]} long")
        elif d["margin"] is None:
            lines.append(where + f"our token is not among {peer}'s top {TOP}")
        else:
            near = " (a near tie)" if abs(d["margin"]) < 1e-3 else ""
            lines.append(where + f"{peer}'s margin between the two choices {d['margin']:.2e}{near}")
    return "\n".join(lines)
