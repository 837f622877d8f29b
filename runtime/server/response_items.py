"""The output items of a response (``POST /v1/responses``), built from the deltas chat's
stream writes, and the typed events that stream them.

``OutputItems`` reads what ``ChatCompletion.chunk_choices`` makes of each engine output
(content, ``reasoning_content``, ``tool_calls``) and keeps the response's ``output``: a
reasoning item, a message, function calls, each opened (``response.output_item.added``),
filled by deltas and closed (``response.output_item.done``) when another kind of output
begins or the response ends. A whole response is built the same way without the events, so
the two answers of one generation are the same items.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

LogprobList = list[dict[str, Any]]


class EventWriter:
    """Server-Sent Events named by their type, numbered in order."""

    def __init__(self) -> None:
        self.sequence = 0

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n"


class OutputItems:
    """A response's output items as its chat deltas arrive; with an ``EventWriter``, the
    events that stream them too (``take`` and ``finish`` return them)."""

    def __init__(self, out: EventWriter | None = None, want_logprobs: bool = False) -> None:
        self.out = out
        self.want_logprobs = want_logprobs
        self.done: list[dict[str, Any]] = []
        """Closed items, in order: the response's ``output``."""
        self.open: dict[str, Any] | None = None
        self.open_call: int | None = None
        """The chat index of the open function call."""
        self.text = ""
        self.logprobs: LogprobList = []
        self.reasoning_tokens = 0
        self._events: list[str] = []

    @property
    def index(self) -> int:
        return len(self.done)

    @property
    def open_type(self) -> str | None:
        return None if self.open is None else self.open["type"]

    def _event(self, kind: str, **fields: Any) -> None:
        if self.out is not None:
            self._events.append(self.out.event(kind, **fields))

    def _flush(self) -> list[str]:
        events, self._events = self._events, []
        return events

    def take(self, parts: list[dict[str, Any]], num_tokens: int) -> list[str]:
        """The events of one engine output: ``parts`` are chat's chunk choices for it
        (``ChatCompletion.chunk_choices``), ``num_tokens`` the tokens it brought."""
        said = False
        for part in parts:
            delta = part["delta"]
            thought, calls, content = (
                delta.get("reasoning_content"),
                delta.get("tool_calls"),
                delta.get("content"),
            )
            # chat puts an output's logprobs on its last part: the message's when that part
            # is text, or says nothing yet (a character not complete) while the message is
            # what is open; a thought's or a call's tokens are no part of the message's
            logprobs = (part.get("logprobs") or {}).get("content") if self.want_logprobs else None
            if thought:
                self._reasoning(thought)
            silent = not thought and not calls and self.open_type in (None, "message")
            if content or (logprobs and silent):
                said = said or bool(content)
                self._text(content or "", logprobs)
            for call in calls or []:
                said = True
                self._call(call)
        if not said and any(p["delta"].get("reasoning_content") for p in parts):
            self.reasoning_tokens += num_tokens
        return self._flush()

    def finish(self, cut_short: bool) -> list[str]:
        """The last events: the open item closed (a function call ``cut_short`` by
        max_output_tokens is ``incomplete``), and an empty message when the response said
        nothing else (a whole answer has one too)."""
        answered = any(item["type"] in ("message", "function_call") for item in self.done)
        if not answered and (self.open is None or self.open["type"] == "reasoning"):
            self._text("", None)
        if cut_short and self.open is not None and self.open["type"] == "function_call":
            self.open["status"] = "incomplete"
        self._close()
        return self._flush()

    def _reasoning(self, text: str) -> None:
        if self.open is None or self.open["type"] != "reasoning":
            self._close()
            self.open = {**reasoning_item(""), "content": []}
            self.text = ""
            self._event("response.output_item.added", output_index=self.index, item=self.open)
        self.text += text
        self._event(
            "response.reasoning_text.delta",
            item_id=self.open["id"], output_index=self.index, content_index=0, delta=text,
        )  # fmt: skip

    def _text(self, text: str, logprobs: LogprobList | None) -> None:
        if self.open is None or self.open["type"] != "message":
            self._close()
            self.open = {**message_item("", None), "status": "in_progress", "content": []}
            self.text, self.logprobs = "", []
            self._event("response.output_item.added", output_index=self.index, item=self.open)
            self._event(
                "response.content_part.added",
                item_id=self.open["id"], output_index=self.index, content_index=0,
                part=text_part("", [] if self.want_logprobs else None),
            )  # fmt: skip
        if not text and not logprobs:
            return
        self.text += text
        self.logprobs += logprobs or []
        self._event(
            "response.output_text.delta",
            item_id=self.open["id"], output_index=self.index, content_index=0, delta=text,
            logprobs=logprobs or [],
        )  # fmt: skip

    def _call(self, call: dict[str, Any]) -> None:
        """A chat tool-call delta: one with an ``id`` begins a call; the others continue the
        open one (chat's ``ToolCallStream`` streams one call at a time)."""
        if "id" in call:
            self._close()
            fn = call["function"]
            self.open = {**call_item(call["id"], fn), "arguments": "", "status": "in_progress"}
            self.open_call = call["index"]
            self._event("response.output_item.added", output_index=self.index, item=self.open)
            arguments = fn.get("arguments") or ""
        else:
            assert self.open is not None and self.open_call == call["index"], (call, self.open)
            arguments = call.get("function", {}).get("arguments") or ""
        if arguments:
            self.open["arguments"] += arguments
            self._event(
                "response.function_call_arguments.delta",
                item_id=self.open["id"], output_index=self.index, delta=arguments,
            )  # fmt: skip

    def _close(self) -> None:
        """Close the open item, if any."""
        item, at = self.open, self.index
        if item is None:
            return
        self.open = self.open_call = None
        if item["type"] == "message":
            part = text_part(self.text, self.logprobs if self.want_logprobs else None)
            item = {**item, "status": "completed", "content": [part]}
            self._event(
                "response.output_text.done",
                item_id=item["id"], output_index=at, content_index=0, text=self.text,
                logprobs=self.logprobs,
            )  # fmt: skip
            self._event(
                "response.content_part.done",
                item_id=item["id"], output_index=at, content_index=0, part=part,
            )  # fmt: skip
        elif item["type"] == "reasoning":
            item = reasoning_item(self.text, item["id"])
            self._event(
                "response.reasoning_text.done",
                item_id=item["id"], output_index=at, content_index=0, text=self.text,
            )  # fmt: skip
        else:
            if item["status"] == "in_progress":
                item = {**item, "status": "completed"}
            self._event(
                "response.function_call_arguments.done",
                item_id=item["id"], output_index=at, name=item["name"],
                arguments=item["arguments"],
            )  # fmt: skip
        self.done.append(item)
        self._event("response.output_item.done", output_index=at, item=item)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def text_part(text: str, logprobs: LogprobList | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return part


def message_item(text: str, logprobs: LogprobList | None) -> dict[str, Any]:
    return {
        "type": "message",
        "id": _item_id("msg"),
        "status": "completed",
        "role": "assistant",
        "content": [text_part(text, logprobs)],
    }


def reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id or _item_id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def call_item(call_id: str, function: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": _item_id("fc"),
        "call_id": call_id,
        "name": function["name"],
        "arguments": function.get("arguments") or "",
        "status": "completed",
    }


def said_items(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output items as input items of the response that continues this one: its message
    and function calls (its reasoning left out, as chat templates leave out earlier turns'
    thinking)."""
    said: list[dict[str, Any]] = []
    for item in items:
        if item["type"] == "message":
            text = item["content"][0]["text"]
            said.append({"type": "message", "role": "assistant", "content": text})
        elif item["type"] == "function_call":
            said.append({k: item[k] for k in ("type", "call_id", "name", "arguments")})
    return said
