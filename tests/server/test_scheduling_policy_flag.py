"""``conveyor serve --schedule-policy priority`` (SGLang's spelling of vLLM's
``--scheduling-policy``): a request's ``priority`` is taken, through both APIs and streamed;
the order it gives is checked on the engine (``tests/engine/test_scheduling_policy.py``)."""

from __future__ import annotations

from collections.abc import Callable

import openai
import pytest

from conveyor.bench.procs import ChildProcess


@pytest.fixture(scope="module")
def client(start_server: Callable[..., ChildProcess]):
    server = start_server("--schedule-policy", "priority")
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as c:
        yield c


@pytest.mark.parametrize("priority", [-5, 0, 7])
def test_priority_is_taken(client: openai.OpenAI, priority: int):
    chat = client.chat.completions.create(
        model="conveyor-tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        extra_body={"priority": priority, "ignore_eos": True},
    )
    assert chat.usage.completion_tokens == 3
    stream = client.completions.create(
        model="conveyor-tiny",
        prompt="hi",
        max_tokens=3,
        stream=True,
        extra_body={"priority": priority, "ignore_eos": True},
    )
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "length"
