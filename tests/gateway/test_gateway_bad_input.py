"""Bad input the gateway answers itself: a 4xx in OpenAI's error shape, never a 500."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from conveyor.gateway.app import build_app
from conveyor.gateway.errors import ClientError
from conveyor.gateway.proxy import _parse
from conveyor.gateway.settings import GatewaySettings


def assert_openai_error(body: object, status: int, response_status: int) -> None:
    assert response_status == status, body
    assert isinstance(body, dict) and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"model": "m", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    ],
)
def test_a_body_nested_too_deep_for_the_parser_is_a_400(raw: bytes) -> None:
    with pytest.raises(ClientError) as info:
        _parse(raw)
    assert info.value.status == 400
    assert "not valid JSON" in str(info.value)


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("POST", "/v1/embeddings", 404), ("GET", "/nope", 404), ("GET", "/v1/chat/completions", 405)],
)
def test_unknown_routes_and_methods_answer_in_openai_error_shape(
    method: str, path: str, status: int
) -> None:
    # Not entered as a context manager: no lifespan, so no discovery; routing needs none.
    client = TestClient(build_app(GatewaySettings()))
    r = client.request(method, path, json={})
    assert_openai_error(r.json(), status, r.status_code)
    assert path in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"{}", "is required"),
        (b'{"model": null}', "is required"),
        (b'{"model": ""}', "is required"),
        (b'{"model": 5}', "must be a string"),
        (b'{"model": ["m"]}', "must be a string"),
    ],
)
def test_a_missing_or_mistyped_model_says_which(body: bytes, says: str) -> None:
    with pytest.raises(ClientError) as info:
        _parse(body)
    assert info.value.status == 400 and info.value.param == "model"
    assert says in str(info.value)
