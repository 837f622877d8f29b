"""``/v1/completions`` with ``echo`` and ``logprobs``: the prompt's logprobs come back before
the generated tokens', as lm-evaluation-harness's ``local-completions`` scores a continuation
(``max_tokens: 1``, ``logprobs: 1``, ``echo: true``, prompts as token ids, in batches)."""

from __future__ import annotations

import math

import httpx
import pytest

from conveyor.bench.procs import ChildProcess


def lm_eval_body(prompt) -> dict:
    return {"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}


def test_the_prompts_logprobs_come_first_with_null_for_the_first_token(server: ChildProcess):
    prompt = "The quick brown fox"
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = http.post("/v1/completions", json=lm_eval_body(prompt)).json()
    choice, usage = body["choices"][0], body["usage"]
    lp = choice["logprobs"]
    n_prompt = usage["prompt_tokens"]
    assert len(lp["tokens"]) == n_prompt + usage["completion_tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(x <= 0 and math.isfinite(x) for x in lp["token_logprobs"][1:])
    assert choice["text"].startswith(prompt)
    assert "".join(lp["tokens"][:n_prompt]) == prompt  # conveyor-tiny: bytes, no BOS
    assert lp["text_offset"][n_prompt] == len(prompt)  # the generated token's, after the echo
    for token, top in zip(lp["tokens"][1:], lp["top_logprobs"][1:], strict=True):
        assert token in top and len(top) <= 2


def test_a_batch_of_token_id_prompts_each_gets_its_own(server: ChildProcess):
    prompts = [[72, 101, 108, 108, 111], [87, 111, 114, 108, 100, 33, 33]]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = http.post("/v1/completions", json=lm_eval_body(prompts)).json()
    for choice, prompt in zip(body["choices"], prompts, strict=True):
        assert len(choice["logprobs"]["token_logprobs"]) == len(prompt) + 1
    # the same prompt alone gives the same numbers (no batch effect beyond rounding)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        alone = http.post("/v1/completions", json=lm_eval_body(prompts[1])).json()
    assert alone["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(
        body["choices"][1]["logprobs"]["token_logprobs"][1:], abs=1e-4
    )


def test_streamed_echo_with_logprobs_says_to_send_it_whole(server: ChildProcess):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/v1/completions", json={**lm_eval_body("Hi"), "stream": True})
    assert r.status_code == 400 and "stream: false" in r.json()["error"]["message"]
