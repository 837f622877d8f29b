"""``/tokenize`` and ``/detokenize`` with vLLM's request and response shapes."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from conveyor.bench.procs import ChildProcess

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hello."},
]


@pytest.fixture
def http(server: ChildProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def test_tokenize_prompt_counts_what_completions_counts(http: httpx.Client) -> None:
    body = http.post("/tokenize", json={"model": "conveyor-tiny", "prompt": "abc"}).json()
    max_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    assert body["max_model_len"] == max_len
    assert body["count"] == len(body["tokens"])
    done = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 1}).json()
    assert body["count"] == done["usage"]["prompt_tokens"]
    bare = http.post("/tokenize", json={"prompt": "abc", "add_special_tokens": False}).json()
    assert bare["tokens"] == [97, 98, 99]  # the built-in tokenizer is byte-level


def test_tokenize_messages_is_the_chat_prompt(http: httpx.Client) -> None:
    body = http.post("/tokenize", json={"messages": MESSAGES}).json()
    chat = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).json()
    assert body["count"] == chat["usage"]["prompt_tokens"] == len(body["tokens"])
    text = http.post("/detokenize", json={"tokens": body["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\n") and "Say hello." in text
    plain = http.post(
        "/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}
    ).json()
    assert body["tokens"][: plain["count"]] == plain["tokens"]
    assert plain["count"] < body["count"]


def test_detokenize_round_trips(http: httpx.Client) -> None:
    prompt = "héllo ☃, wörld"
    r = http.post(
        "/tokenize",
        json={"prompt": prompt, "add_special_tokens": False, "return_token_strs": True},
    ).json()
    assert len(r["token_strs"]) == r["count"] and all(isinstance(s, str) for s in r["token_strs"])
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": prompt}
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, "messages"),
        ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "gpt-17"}, "model"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {}, "tokens"),
    ],
)
def test_bad_requests_are_4xx(http: httpx.Client, path: str, body: dict, param: str) -> None:
    r = http.post(path, json=body)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["param"] == param


def test_tokenize_lone_surrogate_is_a_400(http: httpx.Client) -> None:
    r = http.post(
        "/tokenize", content=b'{"prompt": "a\\ud800"}', headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]


def test_tokenize_messages_with_tools_counts_what_chat_counts(http: httpx.Client) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = http.post("/tokenize", json={"messages": MESSAGES, "tools": tools}).json()
    chat = http.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "tools": tools, "tool_choice": "none", "max_tokens": 1},
    ).json()
    assert body["count"] == chat["usage"]["prompt_tokens"]
