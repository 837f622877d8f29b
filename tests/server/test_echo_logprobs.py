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


def test_vllms_prompt_logprobs_field_on_both_apis(server: ChildProcess):
    """vLLM's own shape: per prompt token (null first) a map from token id to its logprob,
    rank and text, for the prompt's token and the ``prompt_logprobs`` likeliest; on each
    completion choice, and once on a chat response."""
    prompt = [72, 101, 108, 108, 111, 33]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        completion = http.post(
            "/v1/completions",
            json={"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2, "n": 2, "seed": 1},
        ).json()
        echoed = http.post("/v1/completions", json=lm_eval_body(prompt)).json()
        chat = http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                  "prompt_logprobs": 0},
        ).json()  # fmt: skip
    echo_lps = echoed["choices"][0]["logprobs"]["token_logprobs"]
    for choice in completion["choices"]:
        plp = choice["prompt_logprobs"]
        assert len(plp) == len(prompt) and plp[0] is None
        for pos, entry in enumerate(plp[1:], start=1):
            own = entry[str(prompt[pos])]
            assert own["logprob"] == pytest.approx(echo_lps[pos], abs=1e-4)
            assert own["rank"] >= 1 and isinstance(own["decoded_token"], str)
            assert 1 <= len(entry) <= 3
            ranks = sorted(v["rank"] for k, v in entry.items() if k != str(prompt[pos]))
            assert ranks == list(range(1, len(ranks) + 1))
    assert "prompt_logprobs" not in echoed["choices"][0]  # only when asked for
    chat_plp = chat["prompt_logprobs"]
    assert len(chat_plp) == chat["usage"]["prompt_tokens"] and chat_plp[0] is None
    assert all(len(entry) == 1 for entry in chat_plp[1:])  # 0 alternatives: the token alone


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "not streamed"),
        ({"prompt": "x", "prompt_logprobs": 21}, "[0, 20]"),
        ({"prompt": "x", "prompt_logprobs": -1}, ">= 0"),
    ],
)
def test_prompt_logprobs_refused_with_the_field_named(server: ChildProcess, body, says):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt_logprobs" and says in err["message"]
