"""What the gateway answers instead of a replica: the OpenAI error body of
``conveyor.contracts.openai_error`` as bytes, a request it refuses itself, and a failure
before the first byte reached the client."""

from __future__ import annotations

import json
from dataclasses import dataclass

from conveyor.contracts.openai_error import error_body


def error_json(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> bytes:
    """The body of an error answered with HTTP ``status``."""
    return json.dumps(error_body(status, message, param=param, code=code)).encode()


class ClientError(Exception):
    """A request the gateway refuses itself; the message says what to change."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


@dataclass
class Failure:
    """A request that got no answer from a replica, before its first byte reached the client."""

    status: int
    message: str
    retry_after: bytes | None = None
    """The ``Retry-After`` header to send, if any."""
    code: str | None = None
