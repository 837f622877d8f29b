"""``logit_bias`` through both endpoints with the ``openai`` client; what the bias does to
sampling is tested on the engine (``tests/engine/test_sampling.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from conveyor.bench.procs import ChildProcess

MODEL = "conveyor-tiny"
A = 97
"""The built-in model's tokenizer is byte-level without merges: token 97 is "a"."""


@pytest.fixture
def client(server: ChildProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_completion_logit_bias_forces_a_token(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=6, temperature=1, logit_bias={str(A): 100}
    )
    assert r.choices[0].text == "a" * 6


def test_chat_logit_bias_forces_a_token_streamed_too(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=1, logit_bias={str(A): 100}
    )
    assert r.choices[0].message.content == "aaaaa"
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, logit_bias={str(A): 100}, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "aaaaa"


def test_chat_logit_bias_minus_100_moves_greedy_off_its_token(client: openai.OpenAI) -> None:
    def greedy(bias: dict[str, int]) -> str:
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=1,
            temperature=0,
            logit_bias=bias,
        )
        return r.choices[0].message.content or ""

    first = greedy({})
    # On the built-in weights this prompt's greedy token is one ASCII byte (its own token id).
    assert len(first) == 1 and ord(first) < 128, first
    assert greedy({str(ord(first)): -100}) != first
    assert greedy({str(ord(first)): 0}) == first
