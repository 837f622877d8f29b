"""Random request bodies on every POST endpoint: never a 5xx, and the server serves on.

The bodies use the endpoints' own field names with values of any JSON type (and, for
strings, lone surrogates), so most requests get past JSON parsing and reach the
handlers' own checks, where a 500 would hide.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.bench.procs import ChildProcess

FIELDS = {
    "/v1/chat/completions": [
        "messages", "max_tokens", "n", "temperature", "top_p", "stop", "seed", "logit_bias",
        "logprobs", "top_logprobs", "stream", "response_format", "guided_json", "guided_regex",
        "guided_choice", "tools", "tool_choice", "parallel_tool_calls", "min_tokens",
        "chat_template_kwargs", "structured_outputs", "stop_token_ids", "ignore_eos",
    ],
    "/v1/completions": [
        "prompt", "max_tokens", "n", "echo", "logprobs", "stop", "seed", "logit_bias",
        "guided_json", "guided_regex", "guided_choice", "guided_grammar", "best_of", "stream",
    ],
    "/tokenize": ["prompt", "messages", "add_special_tokens", "add_generation_prompt", "tools"],
    "/detokenize": ["tokens"],
}  # fmt: skip

text = st.text(max_size=12) | st.sampled_from(["\ud800", "\udcff\ud800 x", "user", "a+", "{}"])
small_int = st.integers(-3, 12) | st.sampled_from([2**63, -(2**64), 10**9])
leaf = st.none() | st.booleans() | small_int | st.floats(allow_nan=False) | text
json_value = st.recursive(
    leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool"]) | text},
    optional={"content": json_value, "tool_calls": json_value, "name": json_value},
)
VALUES: dict[str, st.SearchStrategy[Any]] = {
    "messages": st.lists(message, max_size=3) | json_value,
    "max_tokens": st.integers(-1, 6) | json_value,
    "n": st.integers(0, 3) | json_value,
    "tokens": st.lists(small_int, max_size=5) | json_value,
}


VALID = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    "/v1/completions": {"prompt": "hi", "max_tokens": 3},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1, 2]},
}
"""A valid body per endpoint: fuzzing one or two fields on it reaches the handlers' checks."""


def body_for(path: str) -> st.SearchStrategy[dict[str, Any]]:
    fields = FIELDS[path]
    anything = st.fixed_dictionaries(
        {}, optional={f: VALUES.get(f, json_value) for f in fields}
    ).map(lambda b: {"max_tokens": 3, **b} if "max_tokens" in fields else b)
    one_field_off = st.dictionaries(
        st.sampled_from(fields), json_value, min_size=1, max_size=2
    ).map(lambda b: {**VALID[path], **b})
    return anything | one_field_off


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_no_body_gets_a_5xx(server: ChildProcess, data: st.DataObject) -> None:
    path = data.draw(st.sampled_from(sorted(FIELDS)))
    body = data.draw(body_for(path))
    raw = json.dumps(body).encode()  # lone surrogates travel as \\uXXXX escapes
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code < 500, (path, body, r.text)
        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_the_server_is_healthy_after_the_fuzzing(server: ChildProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
