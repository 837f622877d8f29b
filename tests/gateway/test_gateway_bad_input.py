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
    [(b'{"model": 5}', "must be a string"), (b'{"model": ["m"]}', "must be a string")],
)
def test_a_mistyped_model_says_which(body: bytes, says: str) -> None:
    with pytest.raises(ClientError) as info:
        _parse(body)
    assert info.value.status == 400 and info.value.param == "model"
    assert says in str(info.value)


@pytest.mark.parametrize("body", [{}, {"model": None}, {"model": ""}])
def test_no_model_with_no_model_served_says_it_is_required(body: dict) -> None:
    with TestClient(build_app(GatewaySettings())) as client:  # no backends: no model
        r = client.post("/v1/completions", json={**body, "prompt": "x"})
    assert_openai_error(r.json(), 400, r.status_code)
    assert r.json()["error"]["param"] == "model"
    assert "'model' is required: this gateway serves 0 models" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("content_type", "json_read"),
    [
        ("text/plain", False),
        ("application/x-www-form-urlencoded", False),
        ("multipart/form-data; boundary=x", False),
        ("application/json", True),
        ("Application/JSON; charset=utf-8", True),
        ("application/vnd.api+json", True),
    ],
)
def test_a_body_is_read_as_json_only_with_a_json_content_type(
    content_type: str, json_read: bool
) -> None:
    with TestClient(build_app(GatewaySettings())) as client:
        r = client.post(
            "/v1/completions", content=b'{"prompt": "x"}', headers={"content-type": content_type}
        )
    assert_openai_error(r.json(), 400, r.status_code)
    said = r.json()["error"]["message"]
    # read as JSON, it gets as far as the model it names (none: 400 on model)
    assert ("'model' is required" in said) is json_read
    assert ("not read as JSON" in said) is not json_read


def test_a_401_says_the_scheme_it_wants() -> None:
    with TestClient(build_app(GatewaySettings(api_keys=("k",)))) as client:
        answers = [
            client.post("/v1/completions", json={"model": "m", "prompt": "x"}),
            client.get("/v1/models"),
        ]
    for r in answers:
        assert_openai_error(r.json(), 401, r.status_code)
        assert r.headers["www-authenticate"] == "Bearer"
