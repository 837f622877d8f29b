"""vLLM's request fields beyond OpenAI's that change what a request gets, through the
``openai`` client's ``extra_body``: ``allowed_token_ids``, ``bad_words``, ``cache_salt`` and
``truncate_prompt_tokens``. Each would otherwise be ignored as an unknown field, silently."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from conveyor.bench.procs import ChildProcess

MODEL = "conveyor-tiny"
"""Byte-level without merges: one token per ASCII character, token 97 is "a"."""


@pytest.fixture
def client(server: ChildProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def _refused(client: openai.OpenAI, param: str, **extra: Any) -> str:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body=extra)
    assert err.value.body["param"] == param, err.value.body
    message: str = err.value.body["message"]
    return message


def test_allowed_token_ids_limit_what_is_generated(client: openai.OpenAI) -> None:
    allowed = {"a": 97, "b": 98}
    r = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=24, temperature=1.5, seed=3,
        extra_body={"allowed_token_ids": list(allowed.values())},
    )  # fmt: skip
    text = r.choices[0].text
    assert len(text) == 24 and set(text) <= set(allowed), text
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=12,
        temperature=1.5, stream=True, extra_body={"allowed_token_ids": [98]},
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "b" * 12
    assert "at least one" in _refused(client, "allowed_token_ids", allowed_token_ids=[])
    assert "[0, " in _refused(client, "allowed_token_ids", allowed_token_ids=[10**7])
    _refused(client, "allowed_token_ids", allowed_token_ids=[-1])


def test_bad_words_never_come_out(client: openai.OpenAI) -> None:
    """Outputs of "a" and "b" only: without bad_words they hold "ab"; with it, never (a
    word of one token is banned at every step)."""

    def texts(**extra: Any) -> list[str]:
        r = client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=30, temperature=2.0, seed=11, n=4,
            extra_body={"allowed_token_ids": [97, 98], **extra},
        )  # fmt: skip
        return [c.text for c in r.choices]

    assert any("ab" in t for t in texts())
    for t in texts(bad_words=["ab"]):
        assert "ab" not in t and len(t) == 30, t
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=20,
        temperature=1.5, extra_body={"allowed_token_ids": [97, 98], "bad_words": [" a"]},
    )  # fmt: skip
    assert r.choices[0].message.content == "b" * 20
    assert "non-blank" in _refused(client, "bad_words", bad_words=["  "])
    assert "at most" in _refused(client, "bad_words", bad_words=["w"] * 1000)
    assert "characters" in _refused(client, "bad_words", bad_words=["w" * 5000])


def _cached(client: openai.OpenAI, prompt: str, salt: str | None = None) -> int:
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
        extra_body={"cache_salt": salt} if salt is not None else None,
    )  # fmt: skip
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return r.usage.prompt_tokens_details.cached_tokens or 0


def test_cache_salt_shares_cached_blocks_only_within_one_salt(client: openai.OpenAI) -> None:
    prompt = f"{uuid.uuid4().hex} " * 8  # a few blocks no earlier test left cached
    assert _cached(client, prompt) == 0
    assert _cached(client, prompt) > 0  # unsalted: found
    assert _cached(client, prompt, "tenant-a") == 0  # another tenant cannot tell it was asked
    assert _cached(client, prompt, "tenant-a") > 0  # its own blocks are found
    assert _cached(client, prompt, "tenant-b") == 0
    assert _cached(client, prompt, "tenant-b") > 0
    assert _cached(client, prompt) > 0  # the unsalted blocks are still there
    assert "at least 1" in _refused(client, "cache_salt", cache_salt="")


def _max_model_len(server: ChildProcess) -> int:
    card = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
    length: int = card["max_model_len"]
    return length


def test_truncate_prompt_tokens_keeps_the_prompts_end(
    client: openai.OpenAI, server: ChildProcess
) -> None:
    r = client.completions.create(
        model=MODEL, prompt="abcdefghijklmnop", max_tokens=1, echo=True,
        extra_body={"truncate_prompt_tokens": 4},
    )  # fmt: skip
    assert r.usage is not None and r.usage.prompt_tokens == 4
    assert r.choices[0].text.startswith("mnop")  # echo gives back what was run
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x" * 500}], max_tokens=1,
        extra_body={"truncate_prompt_tokens": 7},
    )  # fmt: skip
    assert r.usage is not None and r.usage.prompt_tokens == 7

    limit = _max_model_len(server)
    long = "y" * (limit * 40)  # past what the server reads unasked: refused unread
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=long, max_tokens=5)
    r = client.completions.create(
        model=MODEL, prompt=long, max_tokens=5, extra_body={"truncate_prompt_tokens": -1}
    )
    assert r.usage is not None and r.usage.prompt_tokens == limit - 5
    for bad in (0, -2, limit + 1):
        _refused(client, "truncate_prompt_tokens", truncate_prompt_tokens=bad)
