"""Tool calling on the random-weights built-in model: ``required`` and a named function are
forced by the grammar, so every call's arguments parse and match the function's schema."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from conveyor.bench.procs import ChildProcess

MODEL = "conveyor-tiny"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
UNITS = ["celsius", "fahrenheit"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 10},
                "unit": {"type": "string", "enum": UNITS},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters
TOOLS = [WEATHER, CLOCK]


def assert_valid_call(call: Any) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert_valid_arguments(call.function.name, call.function.arguments)


def assert_valid_arguments(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    if name == "get_time":
        assert args == {}
        return
    assert name == "get_weather"
    assert {"city", "unit"} <= set(args) <= {"city", "unit", "days"}, args
    assert isinstance(args["city"], str) and 1 <= len(args["city"]) <= 10, args
    assert args["unit"] in UNITS, args
    if "days" in args:
        assert type(args["days"]) is int and 1 <= args["days"] <= 7, args


@pytest.fixture
def client(server: ChildProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_required_always_calls_a_tool_with_valid_arguments(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        parallel_tool_calls=False,  # random weights would make arrays of any length
        n=8,
        temperature=1,
        max_tokens=300,
    )
    for c in r.choices:
        assert c.finish_reason == "tool_calls", c
        assert c.message.content is None and c.message.tool_calls
        assert len(c.message.tool_calls) == 1
        assert_valid_call(c.message.tool_calls[0])
    assert len({c.message.tool_calls[0].id for c in r.choices if c.message.tool_calls}) == 8


def test_named_function_streamed_and_not(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice=choice,  # type: ignore[arg-type]
        n=4,
        temperature=1,
        max_tokens=200,
    )
    for c in r.choices:
        assert c.finish_reason == "stop"  # a call forced by name: OpenAI's and vLLM's answer
        assert c.message.tool_calls is not None and len(c.message.tool_calls) == 1
        assert c.message.tool_calls[0].function.name == "get_weather"
        assert_valid_call(c.message.tool_calls[0])
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1,
        max_tokens=200,
        stream=True,
    )
    deltas, content, finishes = [], "", []
    for chunk in stream:
        assert (
            chunk.choices[0].delta.model_dump(exclude_none=True) or chunk.choices[0].finish_reason
        )
        for c in chunk.choices:
            content += c.delta.content or ""
            deltas += c.delta.tool_calls or []
            finishes += [c.finish_reason] if c.finish_reason else []
    assert finishes == ["tool_calls"] and content == ""
    # the call's id and name first, then its arguments as they are generated
    assert {d.index for d in deltas} == {0}  # parallel_tool_calls false: one call
    assert deltas[0].id and deltas[0].function.name
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    if deltas[0].function.name == "get_weather":  # get_time's {} may be one token
        assert len(deltas) > 2, "the arguments came in one piece"
    deltas[0].function.arguments = "".join(d.function.arguments or "" for d in deltas)
    assert_valid_call(deltas[0])


def test_a_forced_call_cut_short_says_length_streamed_or_not(client: openai.OpenAI) -> None:
    """max_tokens ending a ``required`` call half-way: finish_reason ``length``, and the
    stream's deltas add up to the whole answer (the same greedy tokens), arguments and all."""
    ask = {"model": MODEL, "messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required",
           "parallel_tool_calls": False, "temperature": 0}  # fmt: skip
    full = client.chat.completions.create(**ask, max_tokens=300)  # type: ignore[call-overload]
    assert full.choices[0].finish_reason == "tool_calls"
    cut = full.usage.completion_tokens - 3  # before the closing brackets
    whole = client.chat.completions.create(**ask, max_tokens=cut).choices[0]  # type: ignore[call-overload]
    assert whole.finish_reason == "length"
    arguments, names, finishes = "", [], []
    for chunk in client.chat.completions.create(**ask, max_tokens=cut, stream=True):  # type: ignore[call-overload]
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                arguments += d.function.arguments or ""
                names += [d.function.name] if d.function.name else []
            finishes += [c.finish_reason] if c.finish_reason else []
    assert finishes == ["length"]
    assert whole.message.tool_calls and names == ["get_weather"]
    assert arguments == whole.message.tool_calls[0].function.arguments
    assert full.choices[0].message.tool_calls[0].function.arguments.startswith(arguments)

    # a stop string ends it part-way: finish_reason stop (not tool_calls), streamed or not
    stopped = client.chat.completions.create(**ask, max_tokens=300, stop=['"city"'])  # type: ignore[call-overload]
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.tool_calls[0].function.arguments == "{"
    stream = client.chat.completions.create(**ask, max_tokens=300, stop=['"city"'], stream=True)  # type: ignore[call-overload]
    assert [c.finish_reason for chunk in stream for c in chunk.choices if c.finish_reason] == [
        "stop"
    ]


def test_none_answers_in_text_and_history_with_tool_calls_renders(
    client: openai.OpenAI,
) -> None:
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    r = client.chat.completions.create(
        model=MODEL,
        messages=history,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="none",
        max_tokens=5,
        temperature=0,
    )
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.fixture
def http(server: ChildProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"tools": TOOLS}, "tool_choice", "--tool-call-parser"),  # auto by default
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not in tools",
        ),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", "distinct"),
        ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools.0.function", ""),
        (
            {"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"},
            "guided_regex",
            "cannot be combined",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}
                ],
                "tool_choice": "required",
            },
            "tools",
            'type "x"',
        ),
    ],
)
def test_bad_tool_requests_are_400s(
    http: httpx.Client, body: dict[str, Any], param: str, says: str
) -> None:
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert says.lower() in err["message"].lower(), err


def test_auto_with_a_parser_answers_in_text_when_the_model_calls_nothing(
    start_server: Callable[..., ChildProcess],
) -> None:
    server = start_server("--tool-call-parser", "hermes")
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as client:
        r = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            tools=TOOLS,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content


def test_a_named_functions_arguments_stream_as_they_are_generated(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        n=2,
        temperature=1,
        max_tokens=200,
        stream=True,
    )
    deltas: dict[int, list[Any]] = {0: [], 1: []}
    finish: dict[int, str | None] = {}
    for chunk in stream:
        for c in chunk.choices:
            deltas[c.index] += c.delta.tool_calls or []
            finish[c.index] = c.finish_reason or finish.get(c.index)
    for index, parts in deltas.items():
        assert finish[index] == "stop"  # forced by name, as OpenAI and vLLM answer it
        assert len(parts) > 3  # one delta per step, not the call at the end
        first, rest = parts[0], parts[1:]
        assert first.id.startswith("call_") and first.function.name == "get_weather"
        assert all(p.index == 0 and p.id is None for p in rest)
        arguments = first.function.arguments + "".join(p.function.arguments for p in rest)
        assert_valid_arguments("get_weather", arguments)


XML_CALL = (
    "<function=get_weather>\\n<parameter=city>\\nOslo\\n</parameter>\\n"
    "<parameter=unit>\\ncelsius\\n</parameter>\\n<parameter=days>\\n3\\n</parameter>\\n"
    "</function>"
)
"""Qwen3-Coder's and Seed-OSS's form of a call, as a regex (``days`` is written as text)."""


@pytest.mark.parametrize(
    ("parser", "forced"),
    [
        (
            "hermes",
            r'Sure\. <tool_call>\{"name": "get_weather", "arguments": '
            r'\{"city": "Oslo", "unit": "celsius", "days": 3\}\}</tool_call>',
        ),
        ("qwen3_coder", f"Sure\\. <tool_call>\\n{XML_CALL}\\n</tool_call>"),
        ("seed_oss", f"Sure\\. <seed:tool_call>\\n{XML_CALL}\\n</seed:tool_call>"),
    ],
)
def test_auto_parses_the_models_own_calls_streamed_and_not(
    start_server: Callable[..., ChildProcess], parser: str, forced: str
) -> None:
    """A regex makes the random model write a call in the parser's format; the parser turns it
    into one, whose arguments take the schema's types (the XML's ``days`` an integer), and the
    call's text never shows in the content, streamed or not."""
    server = start_server("--tool-call-parser", parser)
    body = dict(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="auto",
        max_tokens=300,
        extra_body={"guided_regex": forced},
    )
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as client:
        r = client.chat.completions.create(**body)  # type: ignore[call-overload]
        stream = client.chat.completions.create(**body, stream=True)  # type: ignore[call-overload]
        content, calls, finish = "", [], None
        for chunk in stream:
            for c in chunk.choices:
                content += c.delta.content or ""
                calls += c.delta.tool_calls or []
                finish = c.finish_reason or finish
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content == "Sure."
    assert message.tool_calls is not None and len(message.tool_calls) == 1
    assert_valid_call(message.tool_calls[0])
    want = {"city": "Oslo", "unit": "celsius", "days": 3}
    assert json.loads(message.tool_calls[0].function.arguments) == want
    assert finish == "tool_calls" and content.strip() == "Sure."  # the call text never shows
    assert [c.function.name for c in calls] == ["get_weather"]
    assert [json.loads(c.function.arguments) for c in calls] == [want]
