"""Server-Sent Events on the proxied path: where a stream's first token is, and the event
that ends a stream which broke after its first byte went out."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

from conveyor.gateway.errors import error_json


async def read_to_first_token(chunks: AsyncIterator[bytes]) -> bytes:
    """Read ``chunks`` until they hold an event beyond a role-only opening chunk (or end).

    A chat stream's role-only opening chunk (a response's ``response.created`` and
    ``response.in_progress``) is sent before prefill: holding it back makes the
    first byte the client sees carry the first token, so a replica that dies while queueing or
    prefilling is still retried elsewhere.
    """
    first = b""
    async for chunk in chunks:
        first += chunk
        if has_token(first):
            break
    return first


def has_token(buffer: bytes) -> bool:
    """Whether ``buffer`` holds a complete SSE event beyond a role-only opening chunk."""
    return any(not is_role_only(event) for event in buffer.split(b"\n\n")[:-1])


OPENING_EVENTS = (b"event: response.created", b"event: response.in_progress")
"""The Responses API's opening events, sent before prefill as a chat's role-only chunk is."""


def is_role_only(event: bytes) -> bool:
    """A chat's role-only opening chunk, or a response's opening event: sent before any
    output."""
    event = event.strip()
    if event.startswith(OPENING_EVENTS):
        return True
    data = event.removeprefix(b"data:").strip()
    if not data.startswith(b"{") or b'"role"' not in data:
        return False
    try:
        choices = json.loads(data).get("choices")
    except ValueError:
        return False
    if not isinstance(choices, list) or not choices:
        return False
    for choice in choices:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(delta, dict) or choice.get("finish_reason") is not None:
            return False
        if delta.get("content") or delta.keys() - {"role", "content"}:
            return False
    return True


DONE = b"data: [DONE]\n\n"
"""The event that ends an OpenAI stream; nothing follows it (a chunk that ends with it is a
stream's last)."""


class StreamEnd:
    """Where a proxied stream stands, from the chunks that went out: whether its last event
    did (``[DONE]`` for chat and completions; ``response.completed``, ``.failed`` or
    ``.incomplete`` whole for a response), and what ends it if it breaks. Only a response's
    chunks are read, for its events' sequence numbers; chat's are only looked at the end of."""

    def __init__(self, first: bytes) -> None:
        self.first = first
        self.responses = first.startswith(b"event: response.")
        self.sequence = -1
        """A response's highest ``sequence_number`` sent."""
        self.closing = False
        """A response's last event has begun."""
        self._carry = b""
        """A response's latest chunk's end: a number or event name cut by the chunk boundary
        is read whole with the next chunk."""
        self._whole = True
        """The chunks sent so far end at an event's end."""
        self.ended = self.sent(first)

    def sent(self, chunk: bytes) -> bool:
        """Note ``chunk`` as gone out; whether the stream is over with it."""
        self._whole = chunk.endswith(b"\n\n")
        if not self.responses:
            return chunk.endswith(DONE)
        seen = self._carry + chunk
        self._carry = seen[-64:]
        if numbers := _SEQUENCE.findall(seen):
            self.sequence = max(self.sequence, *(int(n) for n in numbers))
        self.closing = self.closing or any(kind in seen for kind in LAST_EVENTS)
        return self.closing and self._whole

    def error(self, message: str, status: int = 502) -> bytes:
        """The events that end the stream where it broke: for chat and completions an error
        chunk and ``[DONE]``; for a response an ``error`` event and a ``response.failed``,
        numbered on from the events sent, as a replica ends a response that fails."""
        lead = b"" if self._whole else b"\n\n"  # the event cut part-way is left behind
        if not self.responses:
            return lead + b"data: " + error_json(status, message) + b"\n\n" + DONE
        sequence = self.sequence + 1
        error = {"type": "error", "sequence_number": sequence, "code": "server_error",
                 "message": message, "param": None}  # fmt: skip
        events = [_event(error)]
        if (response := _created_response(self.first)) is not None:
            response.update(status="failed", error={"code": "server_error", "message": message})
            events.append(
                _event(
                    {
                        "type": "response.failed",
                        "sequence_number": sequence + 1,
                        "response": response,
                    }
                )
            )
        return lead + b"".join(events)


LAST_EVENTS = tuple(
    b"\nevent: response.%s\n" % kind for kind in (b"completed", b"failed", b"incomplete")
)
"""The events that end a response's stream (it has no ``[DONE]``), as lines: an event's
data is one line of JSON, so generated text cannot hold them."""
_SEQUENCE = re.compile(rb'"sequence_number":\s*(\d+)')


def _created_response(first: bytes) -> dict[str, Any] | None:
    """The response object of the ``response.created`` event at the start of ``first``."""
    head = first.split(b"\n\n", 1)[0]
    if not head.startswith(b"event: response.created"):
        return None
    for line in head.split(b"\n"):
        if line.startswith(b"data:"):
            try:
                response = json.loads(line[5:]).get("response")
            except (ValueError, AttributeError):
                return None
            return response if isinstance(response, dict) else None
    return None


def _event(payload: dict[str, Any]) -> bytes:
    data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"event: {payload['type']}\ndata: {data}\n\n".encode()
