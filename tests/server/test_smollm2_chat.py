"""The built-in real model through ``conveyor serve`` and the official ``openai`` client:
right answers, streaming and not, a stop at ``<|im_end|>`` with no special token in the text,
``stop`` strings and ``max_tokens``."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from conveyor.runtime.server.process import ServerProcess

MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    args = ["--model", MODEL, "--max-total-tokens", "8192", "--num-threads", "2"]
    with (
        ServerProcess(args) as server,
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c,
    ):
        yield c


def test_the_model_is_listed_under_its_builtin_name(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_a_factual_question_is_answered(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=48, temperature=0)
    choice = r.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"  # at <|im_end|>, before max_tokens
    assert r.usage is not None and r.usage.completion_tokens < 48
    assert "<|im_end|>" not in choice.message.content and "<|im" not in choice.message.content


def test_streaming_gives_the_same_answer(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=48, temperature=0
    )
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=48, temperature=0, stream=True
    )
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == (
        whole.choices[0].message.content
    )
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_stop_string_ends_the_answer_before_it(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=48, temperature=0, stop=["Paris"]
    )
    assert r.choices[0].finish_reason == "stop"
    assert "Paris" not in r.choices[0].message.content
    assert r.choices[0].message.content.startswith("The capital of France is")


def test_max_tokens_cuts_the_answer(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 3


def test_completions_continue_text(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert "Paris" in r.choices[0].text
