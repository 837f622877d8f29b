"""Bad input gets a 4xx with an OpenAI-style body that says what to change; never a 500,
never a stuck engine."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from conveyor.bench.procs import ChildProcess

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def http(server: ChildProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def assert_error(
    r: httpx.Response, status: int, param: str | None = None, says: str = ""
) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    assert says.lower() in err["message"].lower(), err
    return err


def test_malformed_json(http: httpx.Client) -> None:
    r = http.post(CHAT, content=b'{"messages": [', headers={"content-type": "application/json"})
    assert_error(r, 400, says="not valid JSON")


def test_missing_messages_and_prompt(http: httpx.Client) -> None:
    assert_error(http.post(CHAT, json={"model": "conveyor-tiny"}), 400, "messages", "missing")
    assert_error(http.post(COMPLETIONS, json={"max_tokens": 3}), 400, "prompt", "missing")
    assert_error(http.post(CHAT, json={"messages": []}), 400, "messages")


def test_wrong_field_types(http: httpx.Client) -> None:
    assert_error(
        http.post(CHAT, json={"messages": MESSAGES, "max_tokens": "lots"}), 400, "max_tokens"
    )
    assert_error(
        http.post(CHAT, json={"messages": MESSAGES, "temperature": "hot"}), 400, "temperature"
    )
    assert_error(http.post(CHAT, json={"messages": "hi"}), 400, "messages")
    assert_error(http.post(COMPLETIONS, json={"prompt": {"text": "x"}}), 400)


@pytest.mark.parametrize(
    ("field", "value", "param", "says"),
    [
        ("temperature", -1, "temperature", ">= 0"),
        ("top_p", 0, "top_p", "(0, 1]"),
        ("top_p", 1.5, "top_p", "(0, 1]"),
        ("max_tokens", 0, "max_tokens", ">= 1"),
        ("max_completion_tokens", 0, "max_completion_tokens", ">= 1"),
        ("presence_penalty", 3, "presence_penalty", "[-2, 2]"),
        ("top_logprobs", 50, "top_logprobs", "logprobs"),
        ("n", 0, "n", ""),
        ("logit_bias", {"1": 101}, "logit_bias", "[-100, 100]"),
        ("logit_bias", {"one": 5}, "logit_bias", "token ids"),
        ("logit_bias", {"-3": 5}, "logit_bias", "token ids"),
        ("logit_bias", {"100000": 5}, "logit_bias", "[0, 320)"),
        ("priority", 1, "priority", "--scheduling-policy priority"),
        ("priority", "urgent", "priority", ""),
    ],
)
def test_invalid_parameter_values(
    http: httpx.Client, field: str, value: Any, param: str, says: str
) -> None:
    body: dict[str, Any] = {"messages": MESSAGES, field: value}
    if field == "top_logprobs":
        body["logprobs"] = True
    assert_error(http.post(CHAT, json=body), 400, param, says)


def test_completion_logprobs_out_of_range(http: httpx.Client) -> None:
    assert_error(
        http.post(COMPLETIONS, json={"prompt": "x", "logprobs": 99}), 400, "logprobs", "[0, 20]"
    )


def test_prompt_longer_than_context(http: httpx.Client) -> None:
    max_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    err = assert_error(
        http.post(COMPLETIONS, json={"prompt": [5] * (max_len + 10), "max_tokens": 1}),
        400,
        says="context length",
    )
    assert err["code"] == "context_length_exceeded"
    assert_error(
        http.post(CHAT, json={"messages": [{"role": "user", "content": "x" * (max_len + 10)}]}),
        400,
        "messages",
        "context length",
    )


def test_prompt_that_fills_the_context_is_blamed_not_max_tokens(http: httpx.Client) -> None:
    """With max_tokens given, a prompt that alone fills the context is what to shorten: the
    error used to say "lower max_tokens to at most 0", which no request can do."""
    max_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    err = assert_error(
        http.post(COMPLETIONS, json={"prompt": [5] * (max_len + 10), "max_tokens": 2}),
        400,
        "prompt",
        f"shorten the prompt to at most {max_len - 2} tokens",
    )
    assert err["code"] == "context_length_exceeded"
    assert "at most 0" not in err["message"]
    err = assert_error(
        http.post(
            CHAT,
            json={
                "messages": [{"role": "user", "content": "x" * (max_len + 10)}],
                "max_completion_tokens": 3,
            },
        ),
        400,
        "messages",
        "shorten the prompt",
    )
    assert "at most 0" not in err["message"]


def test_max_tokens_beyond_context(http: httpx.Client) -> None:
    max_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    assert_error(
        http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": max_len}),
        400,
        "max_tokens",
        "lower max_tokens",
    )


def test_token_ids_outside_vocabulary(http: httpx.Client) -> None:
    assert_error(http.post(COMPLETIONS, json={"prompt": [1, 10**9]}), 400, "prompt", "token ids")


def test_unknown_model(http: httpx.Client) -> None:
    err = assert_error(
        http.post(CHAT, json={"model": "gpt-17", "messages": MESSAGES}),
        404,
        "model",
        "conveyor-tiny",
    )
    assert err["code"] == "model_not_found"


def test_unknown_route(http: httpx.Client) -> None:
    assert_error(http.post("/v1/embeddings", json={}), 404)


def test_openai_client_raises_bad_request(server: ChildProcess) -> None:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="conveyor-tiny", messages=MESSAGES, temperature=-2)
        assert "temperature" in str(info.value)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="x")


def test_engine_still_serves_after_bad_input(http: httpx.Client) -> None:
    for body in ({"prompt": ""}, {"prompt": [], "max_tokens": 2}, {"prompt": "x", "stop": [""]}):
        r = http.post(COMPLETIONS, json=body)
        assert 400 <= r.status_code < 500, r.text
    r = http.post(COMPLETIONS, json={"prompt": "still alive", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 3


def test_lone_surrogates_are_a_400(http: httpx.Client) -> None:
    """Valid JSON, invalid Unicode: the tokenizer cannot take it, so the client hears why."""
    body = '{"messages": [{"role": "user", "content": "\\udcff\\ud800 x"}], "max_tokens": 2}'
    r = http.post(CHAT, content=body.encode(), headers={"content-type": "application/json"})
    assert_error(r, 400, "messages", "surrogate")
    body = '{"prompt": ["ok", "\\ud800"], "max_tokens": 2}'
    r = http.post(COMPLETIONS, content=body.encode(), headers={"content-type": "application/json"})
    assert_error(r, 400, "prompt", "surrogate")
    r = http.post(COMPLETIONS, json={"prompt": "still alive", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_seed_outside_64_bits_is_a_400_not_a_dead_engine(http: httpx.Client, seed: int) -> None:
    body = {"prompt": "x", "max_tokens": 2, "temperature": 1, "seed": seed}
    assert_error(http.post(COMPLETIONS, json=body), 400, "seed", "integer in")
    r = http.post(COMPLETIONS, json={**body, "seed": 2**63 - 1, "n": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        (COMPLETIONS, {"prompt": "x", "stop": 5}, "stop", "string"),
        (COMPLETIONS, {"prompt": None}, "prompt", "string"),
        (COMPLETIONS, {"prompt": ["a", 1]}, "prompt.1", "string"),
        (CHAT, {"messages": MESSAGES, "tool_choice": "always"}, "tool_choice", "'required'"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content.0.type",
            "'text'",
        ),
    ],
)
def test_a_field_of_several_types_is_named_as_sent(
    http: httpx.Client, path: str, body: dict[str, Any], param: str, says: str
) -> None:
    """``param`` is the request's field, not pydantic's name for a branch of its type
    (``stop.str``, ``tool_choice.literal[...]``); the message is the most specific branch's."""
    err = assert_error(http.post(path, json=body), 400, param, says)
    assert f"field {param!r}" in err["message"]


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"", "empty"),
        (b'{"prompt": "\xff\xfe hi"}', "UTF-8"),
        (b'{"prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "JSON"),
        (b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", "digits"),
    ],
)
def test_a_body_that_is_not_a_json_object_says_what_to_send(
    http: httpx.Client, content: bytes, says: str
) -> None:
    r = http.post(COMPLETIONS, content=content, headers={"content-type": "application/json"})
    err = assert_error(r, 400, says=says)
    assert "None" not in err["message"] and "There was an error" not in err["message"]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_stream_options_without_stream_is_a_400(http: httpx.Client, path: str) -> None:
    """As OpenAI and vLLM answer it: the options would silently do nothing."""
    body: dict[str, Any] = {"prompt": "x"} if path == COMPLETIONS else {"messages": MESSAGES}
    body |= {"max_tokens": 2, "stream_options": {"include_usage": True}}
    assert_error(http.post(path, json=body), 400, "stream_options", "stream")
    body["stream"] = False
    assert_error(http.post(path, json=body), 400, "stream_options", "stream")


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_text_too_long_for_any_tokenisation_is_refused_before_tokenising(
    http: httpx.Client, path: str
) -> None:
    """30 MB of text cannot fit 4k tokens, whatever its tokens: refused at once, where
    tokenising it first held a tokenizer thread (of two) for half a minute."""
    text = "a" * 30_000_000
    body: dict[str, Any] = {"prompt": text} if path == COMPLETIONS else {"messages": []}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": text}]
    started = time.monotonic()
    r = http.post(path, json=body | {"max_tokens": 1})
    elapsed = time.monotonic() - started
    err = assert_error(r, 400, "prompt" if path == COMPLETIONS else "messages", "context length")
    assert err["code"] == "context_length_exceeded"
    assert elapsed < 10, f"{elapsed:.1f} s: the prompt was tokenised"


@pytest.mark.parametrize(
    ("path", "field"),
    [
        *[
            (COMPLETIONS, f)
            for f in ("n", "stream", "echo", "min_tokens", "ignore_eos", "skip_special_tokens")
        ],
        *[(CHAT, f) for f in ("n", "stream", "logprobs", "parallel_tool_calls", "max_tokens")],
    ],
)
def test_null_means_the_default(http: httpx.Client, path: str, field: str) -> None:
    """OpenAI's schema has ``"n": null``, ``"stream": null``, ... mean the default, and
    clients that write every field send them (as vLLM accepts them)."""
    body: dict[str, Any] = {"prompt": "x"} if path == COMPLETIONS else {"messages": MESSAGES}
    body |= {"max_tokens": 2, field: None}
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain"])
def test_json_sent_as_another_content_type_says_which_to_send(
    http: httpx.Client, content_type: str
) -> None:
    """``curl -d`` sends a form's content type: the 400 names the header to set."""
    r = http.post(
        COMPLETIONS,
        content=b'{"prompt": "x", "max_tokens": 1}',
        headers={"content-type": content_type},
    )
    assert_error(r, 400, says="Content-Type: application/json")


@pytest.mark.parametrize(
    "kwargs",
    [
        {
            "chat_template": "{% for i in range(99999) %}{% for j in range(99999) %}x{% endfor %}{% endfor %}"
        },
        {"chat_template": "{% for i in range(10**9) %}x{% endfor %}"},
        {"tokenize": True},
        {"return_dict": True},
        {"messages": []},
    ],
)
@pytest.mark.parametrize("path", [CHAT, "/tokenize"])
def test_chat_template_kwargs_set_only_the_templates_variables(
    http: httpx.Client, path: str, kwargs: dict[str, Any]
) -> None:
    """A template of the client's own would run in the server (a loop of 10^10 steps, or
    a 500 for one the sandbox stops); the arguments of the rendering are the server's."""
    body = {"messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": kwargs}
    err = assert_error(http.post(path, json=body, timeout=10), 400, "chat_template_kwargs")
    assert next(iter(kwargs)) in err["message"]
    ok = body | {"chat_template_kwargs": {"enable_thinking": False}}
    assert http.post(path, json=ok).status_code == 200


@pytest.mark.parametrize(
    "arguments", ["[" * 100_000 + "]" * 100_000, "1" * 5000, '{"a": NaN}', "{not json"]
)
@pytest.mark.parametrize("path", [CHAT, "/tokenize"])
def test_tool_call_arguments_the_parser_refuses_reach_the_template_as_text(
    http: httpx.Client, path: str, arguments: str
) -> None:
    """An earlier assistant turn's ``arguments`` are JSON text the client wrote; what
    ``json.loads`` cannot take (nested too deep, a number too long) is passed on as text,
    as invalid JSON already was, not a 500."""
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "1", "content": "r"},
    ]
    r = http.post(path, json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "schema_text", ["[" * 100_000 + "]" * 100_000, '{"maxLength": 1' + "0" * 5000 + "}"]
)
def test_a_schema_text_the_parser_refuses_is_a_400(http: httpx.Client, schema_text: str) -> None:
    """``guided_json`` as JSON text: nested too deep or a number too long for ``json.loads``
    is the client's to fix, like any other invalid JSON there."""
    body = {"prompt": "x", "max_tokens": 2, "guided_json": schema_text}
    assert_error(http.post(COMPLETIONS, json=body), 400, "guided_json", "not valid JSON")
