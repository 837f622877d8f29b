"""The load record of one replica: Conveyor's ``GET /load`` document (ARCHITECTURE.md), also
sent with every API response in the ``x-conveyor-load`` header.

The runtime writes it (:meth:`ReplicaLoad.to_json`); the gateway's poller and the
autoscaler read it (:meth:`ReplicaLoad.from_json`). The reader is tolerant of what the
document may grow (unknown fields are ignored; ``max_queued_requests``, ``model``,
``in_flight`` and ``steps`` may be missing) and strict about what it needs: a field of the wrong type is a
``ValueError`` that names it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

LOAD_HEADER = "x-conveyor-load"
"""Response header in which a replica also says its load, on every answer to ``/v1/*``: the
``/load`` document, compact JSON without ``model``. A gateway that reads it has fresh load at
every response and polls ``/load`` only replicas it has not heard from for a poll interval,
which under traffic is none (each poll is a request the replica serves, on its own CPU)."""

JsonValue = None | bool | int | float | str | list["JsonValue"] | dict[str, "JsonValue"]


@dataclass(frozen=True)
class ReplicaLoad:
    """How busy one replica is, and whether it takes requests."""

    running: int
    """Requests in the running batch."""
    waiting: int
    """Requests queued (the queue depth)."""
    kv_cache_usage: float
    """Used KV blocks / total KV blocks, 0..1."""
    max_running_requests: int
    """Batch capacity; at least 1."""
    max_queued_requests: int | None
    """Queue bound (a request past it gets 429); None: unbounded."""
    ready: bool
    """Loaded, alive and not draining."""
    model: str | None = None
    """The served model name, where the replica says it."""
    in_flight: int | None = None
    """API requests the replica's server has open, where it says it."""
    steps: int | None = None
    """Engine steps taken since the replica started, where it says it: a replica whose count
    stops while it holds requests is stuck, however its server answers."""
    engine: str | None = None
    """The engine whose ``/metrics`` the record was read from (``vllm``, ``sglang``); None
    for Conveyor's ``/load`` (not part of the document)."""

    def to_json(self) -> dict[str, JsonValue]:
        """The ``/load`` document; ``model``, ``in_flight`` and ``steps`` only where known."""
        doc: dict[str, JsonValue] = {
            "running": self.running,
            "waiting": self.waiting,
            "kv_cache_usage": self.kv_cache_usage,
            "max_running_requests": self.max_running_requests,
            "max_queued_requests": self.max_queued_requests,
            "ready": self.ready,
        }
        if self.model is not None:
            doc["model"] = self.model
        if self.in_flight is not None:
            doc["in_flight"] = self.in_flight
        if self.steps is not None:
            doc["steps"] = self.steps
        return doc

    def to_header(self) -> bytes:
        """The ``LOAD_HEADER`` value: ASCII, whatever the model's name."""
        doc = self.to_json()
        doc.pop("model", None)
        return json.dumps(doc, separators=(",", ":")).encode("ascii")

    @classmethod
    def from_header(cls, value: str | bytes) -> ReplicaLoad:
        """Read a ``LOAD_HEADER`` value; ValueError when it is not a load document."""
        try:
            doc = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"{LOAD_HEADER} is not JSON: {exc}") from None
        return cls.from_json(doc)

    @classmethod
    def from_json(cls, doc: object) -> ReplicaLoad:
        """Read a parsed ``/load`` document; ValueError naming the field that is wrong."""
        if not isinstance(doc, Mapping):
            raise ValueError(f"/load must return a JSON object, got {type(doc).__name__}")
        running = _integer(doc, "running")
        waiting = _integer(doc, "waiting")
        kv_cache_usage = float(_number(doc, "kv_cache_usage"))
        max_running = max(1, _integer(doc, "max_running_requests"))
        max_queued = (
            None if doc.get("max_queued_requests") is None else _integer(doc, "max_queued_requests")
        )
        ready = doc.get("ready")
        if not isinstance(ready, bool):
            raise ValueError(f"/load field 'ready' must be true or false, got {ready!r}")
        model = doc.get("model")
        if model is not None and not isinstance(model, str):
            raise ValueError(f"/load field 'model' must be a string, got {model!r}")
        in_flight = None if doc.get("in_flight") is None else _integer(doc, "in_flight")
        steps = None if doc.get("steps") is None else _integer(doc, "steps")
        return cls(
            running=running,
            waiting=waiting,
            kv_cache_usage=kv_cache_usage,
            max_running_requests=max_running,
            max_queued_requests=max_queued,
            ready=ready,
            model=model,
            in_flight=in_flight,
            steps=steps,
        )


def _number(doc: Mapping[str, object], name: str) -> int | float:
    value = doc.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"/load field {name!r} must be a number, got {value!r}")
    return value


def _integer(doc: Mapping[str, object], name: str) -> int:
    return int(_number(doc, name))
