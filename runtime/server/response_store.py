"""The responses one replica keeps (``POST /v1/responses`` with ``store``), in memory, for
``previous_response_id`` and ``GET`` / ``DELETE /v1/responses/{id}``: the newest, within
``--responses-store-mb``. Each is kept as JSON text, which is what it costs in memory (a
response with logprobs is megabytes as Python objects) and what ``GET`` sends."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    body: bytes
    """The response as ``GET /v1/responses/{id}`` returns it (JSON)."""
    conversation: bytes
    """Its chat messages, input and output, as JSON, without ``instructions`` (which a
    response that continues it does not inherit, as OpenAI has it)."""
    input_items: bytes
    """Its request's ``input`` as items (JSON), for ``GET /v1/responses/{id}/input_items``."""

    @classmethod
    def of(
        cls,
        body: dict[str, Any],
        conversation: list[dict[str, Any]],
        input_items: list[dict[str, Any]],
    ) -> StoredResponse:
        return cls(_json(body), _json(conversation), _json(input_items))

    @property
    def size(self) -> int:
        return len(self.body) + len(self.conversation) + len(self.input_items)

    def messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = json.loads(self.conversation)
        return messages

    def items(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = json.loads(self.input_items)
        return items


class ResponseStore:
    """The newest stored responses of one replica, at most ``max_bytes`` of them (0: none is
    kept; one larger than the whole budget is not kept either)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.used = 0
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if stored.size > self.max_bytes:
            return
        self._items[response_id] = stored
        self.used += stored.size
        while self.used > self.max_bytes:
            _, oldest = self._items.popitem(last=False)
            self.used -= oldest.size

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        stored = self._items.pop(response_id, None)
        if stored is None:
            return False
        self.used -= stored.size
        return True

    def __len__(self) -> int:
        return len(self._items)


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
