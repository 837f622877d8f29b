"""The OpenAI error body, as the runtime and the gateway send it.

``{"error": {"message": str, "type": str, "param": str | null, "code": str | null}}``, the
shape OpenAI's API and vLLM send and the OpenAI SDKs parse. The vocabulary:

- ``type`` comes from the HTTP status, in OpenAI's snake_case ``*_error`` names (the ones the
  OpenAI SDK's exception classes stand for): 400, 405, 413 and 422
  ``invalid_request_error``, 401 ``authentication_error``, 403 ``permission_error``, 404
  ``not_found_error``, 429 ``rate_limit_error``, 500 ``internal_server_error``, 502 and 504
  ``upstream_error`` (the gateway's replica failed or timed out), 503
  ``service_unavailable_error``; 499 (nginx's: the client closed the connection, logged
  and counted only) ``client_closed_request``; any other 4xx ``invalid_request_error``, any
  other status ``api_error``.
- ``code`` is a short snake_case reason a client can branch on (``queue_full``, ``draining``,
  ``model_not_found``, ...) or null, as OpenAI's is; never the HTTP status, which the
  response already carries.
- ``param`` names the request field at fault, or null.
"""

from __future__ import annotations

ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "internal_server_error",
    502: "upstream_error",
    503: "service_unavailable_error",
    504: "upstream_error",
}
DEFAULT_ERROR_TYPE = "api_error"


ErrorBody = dict[str, dict[str, str | None]]
"""``{"error": {"message", "type", "param", "code"}}``."""


def error_type(status: int) -> str:
    """The ``type`` of an error answered with HTTP ``status``."""
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else DEFAULT_ERROR_TYPE


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> ErrorBody:
    """The body of an error answered with HTTP ``status``; ``message`` says what to change."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}
