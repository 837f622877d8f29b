"""Errors in OpenAI's format: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_error",
}


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> bytes:
    return json.dumps(
        {
            "error": {
                "message": message,
                "type": ERROR_TYPES.get(status, "api_error"),
                "param": param,
                "code": code if code is not None else status,
            }
        }
    ).encode()


def sse_error_event(message: str, status: int = 502) -> bytes:
    """The last event of a stream that broke after its first byte went out."""
    return b"data: " + error_body(status, message) + b"\n\ndata: [DONE]\n\n"
