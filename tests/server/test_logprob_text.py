"""A token's text in logprobs where a UTF-8 character spans tokens, as vLLM reports it: ``""``
for the bytes before the last, the whole character at the last, alternatives read against the
sampled tokens only. conveyor-tiny's tokenizer has one token per byte (id = byte value)."""

from __future__ import annotations

import httpx
import pytest

from conveyor.bench.procs import ChildProcess
from conveyor.runtime.model.builtin import builtin_model_path
from conveyor.runtime.server.logprob_text import completed_text


@pytest.fixture(scope="module")
def decode():
    from conveyor.runtime.model.loader import ModelFiles, load_tokenizer

    tokenizer = load_tokenizer(ModelFiles(builtin_model_path()))
    return tokenizer.decode


def texts(decode, sampled: list[int]) -> list[str]:
    """Each sampled token's logprob text, as the server computes it."""
    out = []
    for i, token in enumerate(sampled):
        alone = decode([token])
        out.append(
            completed_text(decode, token, sampled[:i]) if alone.endswith("\ufffd") else alone
        )
    return out


def test_a_characters_bytes_say_nothing_until_the_last_says_all(decode):
    assert texts(decode, list("xé".encode())) == ["x", "", "é"]
    assert texts(decode, list("😀".encode())) == ["", "", "", "😀"]
    for text in ("日本", "a“b”c", "naïve 😀!"):
        got = texts(decode, list(text.encode()))
        assert "".join(got) == text and "\ufffd" not in "".join(got), got


def test_alternatives_are_read_against_the_sampled_tokens_not_each_other(decode):
    before = list("xé".encode())[:-1]  # "x" and the first byte of "é" (0xC3)
    assert completed_text(decode, 0xA9, before) == "é"  # the sampled one
    assert completed_text(decode, 0xA8, before) == "è"  # an alternative at the same place
    assert completed_text(decode, 0xC3, list(b"x")) == ""  # a character's first byte
    assert completed_text(decode, 0xFF, list(b"abc")) == ""  # never valid UTF-8
    assert completed_text(decode, 0xA9, []) == ""  # no context: a lone continuation byte


def test_echoed_prompt_tokens_join_into_the_prompt(server: ChildProcess):
    prompt = "naïve café “quoted” 😀 日本"
    body = {"prompt": prompt, "max_tokens": 1, "logprobs": 2, "echo": True, "temperature": 0}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        got = http.post("/v1/completions", json=body).json()
    lp, n_prompt = got["choices"][0]["logprobs"], got["usage"]["prompt_tokens"]
    assert "".join(lp["tokens"][:n_prompt]) == prompt
    assert "\ufffd" not in "".join(lp["tokens"][:n_prompt])
    # offsets point into the echoed text: each token's text starts where its offset says
    for token, offset in zip(lp["tokens"][:n_prompt], lp["text_offset"][:n_prompt], strict=True):
        assert prompt[offset : offset + len(token)] == token


def _completion(url: str, **fields) -> dict:
    body = {"prompt": "héllo", "max_tokens": 2, "logprobs": 2, "echo": True, "temperature": 0}
    with httpx.Client(base_url=url, timeout=60) as http:
        return http.post("/v1/completions", json=body | fields).json()


def test_return_tokens_as_token_ids_names_every_token_by_id(server: ChildProcess):
    """vLLM's return_tokens_as_token_ids: ``token_id:ID`` for the sampled, echoed and
    alternative tokens (a byte-level tokenizer: id = byte), in completions and chat; vLLM's
    prompt_logprobs keep their decoded_token."""
    plain = _completion(server.url)["choices"][0]["logprobs"]
    got = _completion(server.url, return_tokens_as_token_ids=True, prompt_logprobs=1)
    lp = got["choices"][0]["logprobs"]
    assert lp["tokens"][:6] == [f"token_id:{b}" for b in "héllo".encode()]
    assert all(t.startswith("token_id:") for t in lp["tokens"])
    tops = [top for top in lp["top_logprobs"] if top]
    assert tops and all(k.startswith("token_id:") for top in tops for k in top)
    # ids never collide where texts may ("" for each unfinished character's byte)
    assert [len(t) for t in tops] >= [len(t) for t in plain["top_logprobs"] if t]
    assert got["choices"][0]["prompt_logprobs"][3][str(ord("l"))]["decoded_token"] == "l"
    chat = {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True,
        "top_logprobs": 2, "temperature": 0, "return_tokens_as_token_ids": True,
    }  # fmt: skip
    with httpx.Client(base_url=server.url, timeout=60) as http:
        content = http.post("/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]
    for entry in content["content"]:
        assert entry["token"].startswith("token_id:")
        assert entry["bytes"] == list(entry["token"].encode())
        assert all(alt["token"].startswith("token_id:") for alt in entry["top_logprobs"])


def test_the_server_flag_sets_the_default_a_request_overrides(start_server):
    s = start_server("--return-tokens-as-token-ids")
    tokens = _completion(s.url)["choices"][0]["logprobs"]["tokens"]
    assert tokens[0] == f"token_id:{ord('h')}"
    tokens = _completion(s.url, return_tokens_as_token_ids=False)["choices"][0]["logprobs"]
    assert tokens["tokens"][0] == "h"
