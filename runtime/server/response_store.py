"""The responses one replica keeps (``POST /v1/responses`` with ``store``): the newest
``--responses-store-size`` of them, in memory, for ``previous_response_id`` and
``GET`` / ``DELETE /v1/responses/{id}``."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]
    """The response as ``GET /v1/responses/{id}`` returns it."""
    conversation: list[dict[str, Any]]
    """Its chat messages, input and output, without ``instructions`` (which a response that
    continues it does not inherit, as OpenAI has it)."""


class ResponseStore:
    """The newest ``size`` stored responses of one replica (0: none is kept)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.size == 0:
            return
        self._items[response_id] = stored
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None
