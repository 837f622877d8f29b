"""OpenAI-style errors (``conveyor.contracts.openai_error``: the body and its vocabulary),
raised in handlers and rendered with their status.

Every message says what to change. Bad input never becomes a 500.
"""

from __future__ import annotations

import re

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from conveyor.contracts.openai_error import ErrorBody, error_body, error_type

# (status, OpenAI error type)
INVALID_REQUEST = (400, error_type(400))
UNAUTHORIZED = (401, error_type(401))
NOT_FOUND = (404, error_type(404))
TOO_MANY_REQUESTS = (429, error_type(429))
CLIENT_CLOSED = (499, error_type(499))
INTERNAL = (500, error_type(500))
UNAVAILABLE = (503, error_type(503))


class APIError(Exception):
    """Raised anywhere in a handler; rendered as the OpenAI error body."""

    def __init__(
        self,
        kind: tuple[int, str],
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.type = kind
        assert self.type == error_type(self.status), f"{kind} is not in the error vocabulary"
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> ErrorBody:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def draining(retry_after: int) -> APIError:
    """The refusal of a new request while the replica shuts down (SIGTERM)."""
    return APIError(
        UNAVAILABLE,
        "this replica is shutting down; retry on another one",
        code="draining",
        headers={"Retry-After": str(retry_after)},
    )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(INVALID_REQUEST, message, param=param, code=code)


def from_value_error(exc: ValueError, known_params: set[str] | None = None) -> APIError:
    """A ``ValueError`` from ``SamplingParams`` or the engine names its parameter first."""
    message = str(exc)
    first = message.split(" ", 1)[0]
    param = first if known_params is None or first in known_params else None
    return bad_request(message, param=param)


UNION_BRANCH = re.compile(r"^(str|int|float|bool|none|[a-z-]+\[.*\]|[A-Z]\w*)$")
"""How pydantic names a branch of a field of several types in an error's ``loc``: ``str``,
``list[int]``, ``literal['none','auto']``, a model's class name. Not a request field."""


def _field_path(loc: tuple[int | str, ...]) -> list[str]:
    """The request fields of an error's ``loc``, without pydantic's union branch names."""
    return [
        str(p)
        for p in loc
        if p not in ("body", "query") and not (isinstance(p, str) and UNION_BRANCH.match(p))
    ]


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "the request body is not valid", None
    first = _field_path(errors[0].get("loc", ()))
    # A field of several types fails once per type: report the branch that got furthest
    # into the value (``content.0.type`` over ``content`` not being a string).
    group = [e for e in errors if _field_path(e.get("loc", ()))[: len(first)] == first]
    e = max(group, key=lambda e: len(e.get("loc", ())))
    param = ".".join(_field_path(e.get("loc", ()))) or None
    if e.get("type") == "json_invalid":
        ctx = e.get("ctx") or {}
        return (
            f"the request body is not valid JSON ({ctx.get('error', e.get('msg'))}); "
            "send a JSON object with Content-Type: application/json"
        ), None
    if e.get("type") == "missing":
        if param is None:
            return "the request body is empty; send a JSON object", None
        return f"missing required field {param!r}", param
    if e.get("type") == "extra_forbidden":
        return f"unknown field {param!r}; remove it", param
    msg = e.get("msg", "invalid value")
    got = e.get("input")
    if param is None and isinstance(got, bytes):  # not read as JSON: another content type
        return (
            "the request body was not read as JSON; send a JSON object with the header "
            "Content-Type: application/json"
        ), None
    got_text = (
        repr(got) if not isinstance(got, (dict, list)) or len(str(got)) < 80 else type(got).__name__
    )
    where = f"field {param!r}" if param else "the request body"
    others = len(errors) - len(group)
    extra = f" ({others} more problem(s) after this one)" if others else ""
    return f"{where}: {msg}, got {got_text}{extra}", param


async def validation_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param = _describe_validation(exc)
    return bad_request(message, param=param).response()


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


BODY_PARSE_ERROR = "There was an error parsing the body"
"""FastAPI's detail when the body is not even JSON text it can decode."""


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    kind = (exc.status_code, error_type(exc.status_code))
    message = str(exc.detail)
    if exc.status_code == 400 and message == BODY_PARSE_ERROR:
        message = (
            "the request body could not be read as JSON (not UTF-8, nested too deep, or a "
            "number of thousands of digits); "
            "send a JSON object in UTF-8 with Content-Type: application/json"
        )
    elif exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}; see GET /v1/models and POST /v1/chat/completions"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    return APIError(kind, message).response()


async def internal_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """A bug, not the client's fault: still an OpenAI error body (Starlette re-raises the
    exception afterwards, so the server logs its traceback)."""
    return APIError(
        INTERNAL,
        f"internal error ({type(exc).__name__}); this is a bug in the server, not in the request",
        code="internal_error",
    ).response()
