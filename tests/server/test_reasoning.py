"""``conveyor serve --reasoning-parser qwen3``: a chat completion's thinking comes as
``reasoning_content``, the answer as ``content``, whole and streamed. conveyor-tiny's output
is forced into the shape of a reasoning model's by a regex."""

from __future__ import annotations

from collections.abc import Callable

import openai
import pytest

from conveyor.bench.procs import ChildProcess

SHAPE = {"guided_regex": "<think>[a-c]{4}</think>[x-z]{3}"}


@pytest.fixture(scope="module")
def client(start_server: Callable[..., ChildProcess]):
    server = start_server("--reasoning-parser", "qwen3")
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as c:
        yield c


def ask(client: openai.OpenAI, **kwargs):
    return client.chat.completions.create(
        model="conveyor-tiny",
        messages=[{"role": "user", "content": "Think, then answer"}],
        max_tokens=40,
        extra_body=SHAPE,
        **kwargs,
    )


def test_the_thinking_is_apart_from_the_answer(client):
    message = ask(client).choices[0].message
    assert len(message.reasoning_content) == 4 and set(message.reasoning_content) <= set("abc")
    assert len(message.content) == 3 and set(message.content) <= set("xyz")


def test_streamed_thinking_and_answer_are_the_same_as_whole(client):
    whole = ask(client, seed=3, n=2).choices
    reasoning, content = ["", ""], ["", ""]
    for chunk in ask(client, seed=3, n=2, stream=True):
        for choice in chunk.choices:
            delta = choice.delta
            reasoning[choice.index] += getattr(delta, "reasoning_content", None) or ""
            content[choice.index] += delta.content or ""
    for i in range(2):
        assert "<" not in reasoning[i] + content[i]  # no tag leaks
        assert reasoning[i] == whole[i].message.reasoning_content
        assert content[i] == whole[i].message.content


def test_a_response_gives_the_thinking_as_a_reasoning_item_whole_and_streamed(client):
    kwargs = dict(
        model="conveyor-tiny", input="Think, then answer", max_output_tokens=40,
        extra_body={**SHAPE, "seed": 5},
    )  # fmt: skip
    whole = client.responses.create(**kwargs)
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    thought = whole.output[0].content[0].text
    assert len(thought) == 4 and set(thought) <= set("abc")
    assert len(whole.output_text) == 3 and set(whole.output_text) <= set("xyz")
    events = list(client.responses.create(**kwargs, stream=True))
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    final = events[-1].response
    assert streamed == final.output[0].content[0].text == thought
    assert final.output_text == whole.output_text
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert done == ["reasoning", "message"]
