"""``POST /v1/responses`` (OpenAI's Responses API) on a real server, through the official
``openai`` client: the same generation as chat, written as a response; stored responses
continued with ``previous_response_id``; the stream's typed events; what it refuses."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from conveyor.bench.procs import ChildProcess

MODEL = "conveyor-tiny"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 10}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture
def client(server: ChildProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_a_response_is_the_chat_completion_of_the_same_conversation(
    client: openai.OpenAI,
) -> None:
    def chat_completion() -> openai.types.chat.ChatCompletion:
        return client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "What is a conveyor?"},
            ],
            max_completion_tokens=12,
            temperature=0.0,
        )

    chat_completion()  # both below then find the prompt's blocks cached: the same arithmetic
    response = client.responses.create(
        model=MODEL, instructions="Answer briefly.", input="What is a conveyor?",
        max_output_tokens=12, temperature=0.0,
    )  # fmt: skip
    chat = chat_completion()
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == chat.choices[0].message.content
    assert [item.type for item in response.output] == ["message"]
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens == 12
    assert response.usage.total_tokens == response.usage.input_tokens + 12
    assert response.status == "incomplete"  # stopped by max_output_tokens, not by the model
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.instructions == "Answer briefly." and response.store


def test_previous_response_id_continues_the_stored_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=MODEL, instructions="Be brief.", input="Hello", max_output_tokens=6, temperature=0.0
    )
    second = client.responses.create(
        model=MODEL, input="And again?", previous_response_id=first.id, max_output_tokens=6,
        temperature=0.0,
    )  # fmt: skip
    # the same prompt as sending the whole conversation (instructions are not inherited)
    whole = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And again?"},
        ],
        max_output_tokens=6,
        temperature=0.0,
    )
    assert second.usage.input_tokens == whole.usage.input_tokens
    assert whole.usage.input_tokens_details.cached_tokens > 0  # the stored turn's blocks
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, input="x", previous_response_id=first.id)
    assert err.value.body["param"] == "previous_response_id"


def test_input_items_list_what_the_request_sent_in_pages(client: openai.OpenAI) -> None:
    """``client.responses.input_items.list``: the request's items, newest first unless
    ``order`` is asc, each with an id (given or made), a string content as a text part;
    ``after`` pages on; an unknown ``after`` or a bad ``limit`` is a 400."""
    sent = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny", "id": "fco_given"},
        {"type": "message", "role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]},
    ]
    response = client.responses.create(model=MODEL, input=sent, max_output_tokens=2)
    listed = client.responses.input_items.list(response.id, order="asc", limit=100)
    assert [item.type for item in listed.data] == [
        "message", "function_call", "function_call_output", "message", "message"
    ]  # fmt: skip
    assert listed.data[0].content[0].type == "input_text"
    assert listed.data[0].content[0].text == sent[0]["content"]
    assert listed.data[3].content[0].type == "output_text"
    assert listed.data[2].id == "fco_given" and listed.data[1].call_id == "c1"
    ids = [item.id for item in listed.data]
    assert len(set(ids)) == 5 and not listed.has_more

    newest = client.responses.input_items.list(response.id, limit=2)
    assert [item.id for item in newest.data] == ids[::-1][:2] and newest.has_more
    rest = client.responses.input_items.list(response.id, limit=2, after=newest.last_id)
    assert [item.id for item in rest.data] == ids[::-1][2:4] and rest.has_more
    # the SDK's pager follows ``after`` to the end
    assert [item.id for item in client.responses.input_items.list(response.id, limit=2)] == (
        ids[::-1]
    )
    # before (no longer in the SDK's signature): the page just before that item
    back = client.responses.input_items.list(
        response.id, order="asc", limit=2, extra_query={"before": ids[4]}
    )
    assert [item.id for item in back.data] == ids[2:4] and back.has_more
    one = client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    [item] = client.responses.input_items.list(one.id).data
    assert (item.role, item.content[0].text) == ("user", "hi")

    with pytest.raises(openai.BadRequestError) as err:
        client.responses.input_items.list(response.id, after="msg_unknown")
    assert err.value.body["param"] == "after"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.input_items.list(response.id, limit=0)
    assert err.value.body["param"] == "limit"
    twice = client.responses.create(
        model=MODEL, input=[{"role": "user", "content": c, "id": "msg_same"} for c in "ab"],
        max_output_tokens=2,
    )  # fmt: skip
    ids = [item.id for item in client.responses.input_items.list(twice.id, limit=1)]
    assert len(ids) == len(set(ids)) == 2  # a repeated id is made anew: paging ends
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_" + "0" * 40)


def test_store_false_keeps_nothing(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_the_stream_is_typed_numbered_events_that_add_up_to_the_response(
    client: openai.OpenAI,
) -> None:
    events = list(
        client.responses.create(
            model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
            max_output_tokens=10, temperature=0.0, stream=True,
            include=["message.output_text.logprobs"], top_logprobs=2,
        )
    )  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    final = events[-1].response
    text = "".join(d.delta for d in deltas)
    assert final.output_text == text == events[-4].text
    logprobs = [lp for d in deltas for lp in d.logprobs]
    assert len(logprobs) == final.usage.output_tokens == 10
    assert all(len(lp.top_logprobs) == 2 for lp in logprobs)

    def tokens(lps: list) -> list[tuple[str, float, list[str]]]:
        return [(lp.token, lp.logprob, [t.token for t in lp.top_logprobs]) for lp in lps]

    assert tokens(final.output[0].content[0].logprobs) == tokens(logprobs)
    item_ids = {e.item_id for e in deltas} | {events[2].item.id, final.output[0].id}
    assert len(item_ids) == 1  # every event names the one message item
    assert client.responses.retrieve(final.id).output_text == text


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_function_call_is_a_function_call_item(
    client: openai.OpenAI, stream: bool
) -> None:
    kwargs = dict(
        model=MODEL, input="Weather in Paris?", tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=64,
    )  # fmt: skip
    if stream:
        events = list(client.responses.create(**kwargs, stream=True))
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.delta" in kinds
        assert kinds[-3:] == [
            "response.function_call_arguments.done", "response.output_item.done",
            "response.completed",
        ]  # fmt: skip
        response = events[-1].response
        streamed = "".join(
            e.delta for e in events if e.type == "response.function_call_arguments.delta"
        )
        assert streamed == response.output[-1].arguments
    else:
        response = client.responses.create(**kwargs)
    call = response.output[-1]
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_")
    city = json.loads(call.arguments)["city"]
    assert isinstance(city, str) and 1 <= len(city) <= 10
    # the client runs the function and sends its output back; the model answers from it
    answer = client.responses.create(
        model=MODEL, previous_response_id=response.id, max_output_tokens=4,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )  # fmt: skip
    assert [item.type for item in answer.output] == ["message"]


def test_text_format_json_schema_constrains_the_output(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 8}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model=MODEL, input="Answer in JSON", max_output_tokens=64,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}},
    )  # fmt: skip
    assert set(json.loads(response.output_text)) == {"answer"}
    assert response.text.format.type == "json_schema"


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0]", "input_image"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0]", "text"),
        ({"input": [{"role": "bot", "content": "x"}]}, "input[0]", "role"),
        ({"input": [{"type": "function_call", "call_id": 1}]}, "input[0]", "call_id"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "web_search"),
        ({"input": "x", "tools": [{"type": "function"}]}, "tools", "name"),
        ({"input": "x", "background": True}, "background", "background"),
        ({"input": "x", "truncation": "auto"}, "truncation", "truncation"),
        ({"input": "x", "n": 2}, "n", "one output"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", ""),
        ({"input": "x", "top_logprobs": 21}, "top_logprobs", ""),
        ({"input": "x", "tool_choice": "required"}, "tool_choice", "tools"),
        ({}, "input", ""),
        ({"input": []}, "input", "no items"),
        ({"input": [{"role": ["user"], "content": "x"}]}, "input[0]", "role"),
        ({"input": "x", "text": {"format": "json_object"}}, "text.format", "object"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format", "name"),
        ({"input": "x", "max_output_tokens": 10**9}, "max_output_tokens", "max_output_tokens"),
    ],
)
def test_what_it_cannot_do_is_a_400_naming_the_field(
    server: ChildProcess, body: dict, param: str, says: str
) -> None:
    answer = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, **body}, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_a_server_that_keeps_no_responses_says_so(
    start_server: Callable[..., ChildProcess],
) -> None:
    server = start_server("--responses-store-mb", "0")
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        response = c.responses.create(model=MODEL, input="hi", max_output_tokens=2)
        assert response.store is False
        with pytest.raises(openai.NotFoundError):
            c.responses.create(model=MODEL, input="x", previous_response_id=response.id)


def test_bodies_and_events_are_what_the_sdk_types_require(server: ChildProcess) -> None:
    """Validated by the SDK's own pydantic types (the client itself parses leniently)."""
    body = {
        "model": MODEL, "input": "hi", "max_output_tokens": 6,
        "include": ["message.output_text.logprobs"], "top_logprobs": 1,
    }  # fmt: skip
    whole = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60).json()
    Response.model_validate(whole)
    assert whole["usage"]["input_tokens_details"]["cache_write_tokens"] >= 0
    events = TypeAdapter(ResponseStreamEvent)
    with httpx.stream(
        "POST", f"{server.url}/v1/responses", json={**body, "stream": True}, timeout=60
    ) as answer:
        data = [line[6:] for line in answer.iter_lines() if line.startswith("data: ")]
    parsed = [events.validate_python(json.loads(d)) for d in data]
    assert parsed[-1].type == "response.completed"
    Response.model_validate(json.loads(data[-1])["response"])


def test_a_streamed_forced_call_with_logprobs_is_the_whole_answer(client: openai.OpenAI) -> None:
    kwargs = dict(
        model=MODEL, input="Weather in Paris?", tools=[WEATHER], max_output_tokens=64,
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0.0,
        include=["message.output_text.logprobs"], top_logprobs=1,
    )  # fmt: skip
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    streamed = events[-1].response
    assert [i.type for i in streamed.output] == [i.type for i in whole.output] == ["function_call"]
    assert streamed.output[0].arguments == whole.output[0].arguments
    json.loads(streamed.output[0].arguments)
