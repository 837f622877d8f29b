"""Structured outputs on the random-weights built-in model, where only the grammar can make
the output valid: every sampled response must parse and match its schema, streamed or not."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from conveyor.bench.procs import ChildProcess

MODEL = "conveyor-tiny"
MESSAGES = [{"role": "user", "content": "Describe a user as JSON."}]
ROLES = ["admin", "user", "guest"]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"type": "string", "enum": ROLES},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 5},
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


def assert_matches_schema(text: str) -> None:
    """SCHEMA, checked keyword by keyword."""
    obj = json.loads(text)
    assert isinstance(obj, dict), text
    assert {"name", "age", "role"} <= set(obj) <= {"name", "age", "role", "tags"}, text
    assert isinstance(obj["name"], str) and 1 <= len(obj["name"]) <= 12, text
    assert type(obj["age"]) is int and 0 <= obj["age"] <= 150, text
    assert obj["role"] in ROLES, text
    if "tags" in obj:
        assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 3, text
        assert all(isinstance(t, str) and len(t) <= 5 for t in obj["tags"]), text


@pytest.fixture
def client(server: ChildProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture
def http(server: ChildProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def json_schema_format(strict: bool) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": "user", "schema": SCHEMA, "strict": strict},
    }


def test_json_schema_20_sampled_responses_all_validate(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        n=10,
        temperature=1,
        max_tokens=400,
        response_format=json_schema_format(strict=True),  # type: ignore[arg-type]
    )
    texts = [c.message.content or "" for c in r.choices]
    assert [c.finish_reason for c in r.choices] == ["stop"] * 10
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        n=10,
        temperature=1,
        max_tokens=400,
        response_format=json_schema_format(strict=False),  # type: ignore[arg-type]
        stream=True,
    )
    streamed = [""] * 10
    finish: list[str | None] = [None] * 10
    for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
    assert finish == ["stop"] * 10
    for text in texts + streamed:
        assert_matches_schema(text)
    assert len(set(texts + streamed)) > 1  # sampled, not one forced answer


def test_json_object(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        n=4,
        temperature=1,
        max_tokens=300,
        response_format={"type": "json_object"},
    )
    for c in r.choices:
        if c.finish_reason == "stop":  # an open-ended object can outgrow max_tokens
            assert isinstance(json.loads(c.message.content or ""), dict)
        else:
            assert (c.message.content or "").startswith("{")


def test_guided_choice_and_regex_on_completions(client: openai.OpenAI) -> None:
    choices = ["yes", "no", 'a "quoted" été']
    r = client.completions.create(
        model=MODEL,
        prompt="Answer:",
        n=8,
        temperature=1,
        max_tokens=40,
        extra_body={"guided_choice": choices},
    )
    assert all(c.text in choices for c in r.choices), [c.text for c in r.choices]
    r = client.completions.create(
        model=MODEL,
        prompt="Code:",
        n=8,
        temperature=1,
        max_tokens=40,
        extra_body={"guided_regex": r"[A-Z]{3}-\d{2,4}"},
    )
    assert all(re.fullmatch(r"[A-Z]{3}-\d{2,4}", c.text) for c in r.choices), r.choices


def test_guided_json_on_completions_and_structured_outputs_on_chat(
    client: openai.OpenAI,
) -> None:
    r = client.completions.create(
        model=MODEL,
        prompt="User:",
        n=3,
        temperature=1,
        max_tokens=400,
        extra_body={"guided_json": json.dumps(SCHEMA)},  # the schema as text works too
    )
    for c in r.choices:
        assert_matches_schema(c.text)
    r2 = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        n=3,
        temperature=1,
        max_tokens=50,
        extra_body={"structured_outputs": {"choice": ROLES}},
        stream=False,
    )
    assert all(c.message.content in ROLES for c in r2.choices)


def test_constrained_and_free_requests_in_one_batch(client: openai.OpenAI) -> None:
    """n choices of one request share every step; a free request alongside is unaffected."""
    free = dict(model=MODEL, prompt="Hello", max_tokens=12, temperature=0)
    alone = client.completions.create(**free).choices[0].text  # type: ignore[call-overload]
    constrained = client.completions.create(
        model=MODEL,
        prompt=["Hello", "Hello"],
        max_tokens=12,
        temperature=0,
        extra_body={"guided_regex": "[0-9]+"},
    )
    together = client.completions.create(**free).choices[0].text  # type: ignore[call-overload]
    assert all(re.fullmatch("[0-9]+", c.text) for c in constrained.choices)
    assert together == alone


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"guided_regex": "(?<=a)b"}, "guided_regex", "lookbehind"),
        ({"guided_json": {"type": "foo"}}, "guided_json", 'type "foo"'),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_json": [1, 2]}, "guided_json", "must be an object"),
        ({"guided_grammar": "root ::= (("}, "guided_grammar", "EBNF"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "one way"),
        ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "schema"),
        ({"structured_outputs": {"xml": "a"}}, "structured_outputs", "unknown"),
        ({"guided_regex": "a+", "ignore_eos": True}, "guided_regex", "ignore_eos"),
        # compiles, but no value matches: was a 200 that aborted with a refused token as text
        ({"guided_json": {"$ref": "#"}}, "guided_json", "admits no output"),
    ],
)
def test_bad_constraints_are_400s(
    http: httpx.Client, body: dict[str, Any], param: str, says: str
) -> None:
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert says.lower() in err["message"].lower(), err
