"""``POST /v1/responses``, OpenAI's Responses API, and the responses a replica keeps.

A response is served as the chat completion its request becomes
(``ResponsesRequest.to_chat``): the same checks, chat template, tools, structured output and
reasoning parser. What differs is the answer's shape: ``output`` is a list of items (the
reasoning, the message, each function call), and a stream is a sequence of typed events
(``response.created``, ``response.output_text.delta``, ..., ``response.completed``), each
with a ``sequence_number``.

Responses are kept (``store``, true by default as OpenAI has it) in a bounded store in
memory, newest first (``--responses-store-size``): a later request continues one with
``previous_response_id``, and ``GET`` / ``DELETE /v1/responses/{id}`` read and remove it. The
id names the replica that holds it, so the gateway sends those requests there
(``conveyor/contracts/response_id.py``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from conveyor.contracts.response_id import REPLICA_TAG_HEADER, new_response_id
from conveyor.runtime.server.choices import run_choices, usage
from conveyor.runtime.server.context import ServerContext
from conveyor.runtime.server.engine_client import OutputStream
from conveyor.runtime.server.errors import NOT_FOUND, APIError
from conveyor.runtime.server.response_store import StoredResponse
from conveyor.runtime.server.responses_protocol import (
    NamedFunctionChoice,
    ResponsesRequest,
    input_messages,
)
from conveyor.runtime.server.serving_chat import ChatCompletion
from conveyor.runtime.server.serving_common import EngineStreamingResponse


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(
        NOT_FOUND,
        f"no stored response {response_id!r} on this replica: a response is kept in memory on "
        "the replica that made it (the newest --responses-store-size), and only with store: true",
        param=param,
        code="response_not_found",
    )


async def create_response(ctx: ServerContext, req: ResponsesRequest, request: Request) -> Response:
    req.check()
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        previous = ctx.responses.get(req.previous_response_id)
        if previous is None:
            raise not_found(req.previous_response_id, param="previous_response_id")
        history = previous.conversation
    conversation = [*history, *input_messages(req.input)]
    response_id = new_response_id(request.headers.get(REPLICA_TAG_HEADER))
    return await ResponseGeneration(ctx, req, conversation, response_id).create(request)


def get_response(ctx: ServerContext, response_id: str) -> dict[str, Any]:
    stored = ctx.responses.get(response_id)
    if stored is None:
        raise not_found(response_id)
    return stored.body


def delete_response(ctx: ServerContext, response_id: str) -> dict[str, Any]:
    if not ctx.responses.delete(response_id):
        raise not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


class ResponseGeneration(ChatCompletion):
    """One ``POST /v1/responses``: a chat completion whose answer is written as a response."""

    prompt_param = "input"

    def __init__(
        self,
        ctx: ServerContext,
        source: ResponsesRequest,
        conversation: list[dict[str, Any]],
        response_id: str,
    ) -> None:
        super().__init__(ctx, source.to_chat(conversation))
        self.source = source
        self.conversation = conversation
        self.request_id = response_id

    # -- the whole answer ------------------------------------------------------------------

    async def _collect(self, stream: OutputStream) -> dict[str, Any]:
        async for _ in run_choices(self.ctx, self.choices, stream):
            pass
        choice = self.choices[0]
        message = self.choice_body(choice)["message"]
        logprobs = self._logprobs_content(choice.logprobs) if choice.want_logprobs else None
        items = []
        if message.get("reasoning_content"):
            items.append(_reasoning_item(message["reasoning_content"]))
        calls = message.get("tool_calls") or []
        if message.get("content") or not calls:
            items.append(_message_item(message.get("content") or "", logprobs))
        items.extend(_call_item(call["id"], call["function"]) for call in calls)
        return self._finish(items)

    def _finish(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        """The finished response (stored when asked), from its output items."""
        body = self._body("completed", items)
        if self.choices[0].finish_reason == "length":
            body["status"] = "incomplete"
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        u = usage(self.choices)
        body["usage"] = {
            "input_tokens": u["prompt_tokens"],
            "input_tokens_details": u["prompt_tokens_details"],
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"],
        }
        if self.source.store:
            said = _assistant_messages(items)
            self.ctx.responses.put(
                self.request_id, StoredResponse(body, [*self.conversation, *said])
            )
        return body

    def _body(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        req = self.source
        params = self.choices[0].params if self.choices else None
        tool_choice = req.tool_choice
        fmt = (req.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.request_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "model": self.ctx.model_name,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
            "service_tier": "default",
            "store": req.store and self.ctx.responses.size > 0,
            "temperature": params.temperature if params else req.temperature,
            "text": {"format": fmt},
            "tool_choice": (
                tool_choice.model_dump()
                if isinstance(tool_choice, NamedFunctionChoice)
                else tool_choice or "auto"
            ),
            "tools": req.tools or [],
            "top_logprobs": req.top_logprobs,
            "top_p": params.top_p if params else req.top_p,
            "truncation": req.truncation,
            "usage": None,
            "user": req.user,
        }

    # -- the stream of events --------------------------------------------------------------

    def streaming_response(self, stream: OutputStream) -> Response:
        return EngineStreamingResponse(self._events(stream), stream)

    async def _events(self, stream: OutputStream) -> AsyncIterator[str]:
        """The response's events; an error after the first byte is an ``error`` event and a
        ``response.failed``, as OpenAI ends a stream that fails."""
        out = EventWriter()
        items = StreamedItems(out)
        yield out.event("response.created", response=self._body("in_progress", []))
        yield out.event("response.in_progress", response=self._body("in_progress", []))
        try:
            async for choice, delta in run_choices(self.ctx, self.choices, stream):
                for part in self.chunk_choices(choice, delta):
                    for event in items.take(part):
                        yield event
            for event in items.finish():
                yield event
            # response.completed also for an incomplete one (its status says so), as vLLM
            # sends it: the OpenAI SDK's stream helper waits for that event alone.
            yield out.event("response.completed", response=self._finish(items.done))
        except APIError as exc:
            error = exc.body()["error"]
            yield out.event(
                "error", code=error.get("code"), message=error["message"], param=error.get("param")
            )
            failed = self._body("failed", items.done)
            failed["error"] = {
                "code": error.get("code") or "server_error",
                "message": error["message"],
            }
            yield out.event("response.failed", response=failed)


class EventWriter:
    """Server-Sent Events named by their type, numbered in order."""

    def __init__(self) -> None:
        self.sequence = 0

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n"


class StreamedItems:
    """The output items of a streamed response, built from chat's stream deltas: each item
    is opened (``output_item.added``), filled by deltas, and closed (``output_item.done``)
    when another kind of output begins or the response ends."""

    def __init__(self, out: EventWriter) -> None:
        self.out = out
        self.done: list[dict[str, Any]] = []
        """Closed items, in order: the response's ``output``."""
        self.open: dict[str, Any] | None = None
        self.text = ""
        self.logprobs: list[dict[str, Any]] = []
        self.calls: dict[int, dict[str, Any]] = {}
        """Open function calls by their chat index."""

    @property
    def index(self) -> int:
        return len(self.done)

    def take(self, part: dict[str, Any]) -> list[str]:
        """The events of one chat chunk choice (``ChatCompletion.chunk_choices``)."""
        delta, events = part["delta"], []
        if thought := delta.get("reasoning_content"):
            events += self._text("reasoning", thought, None)
        content = delta.get("content")
        logprobs = (part.get("logprobs") or {}).get("content")
        if content or logprobs:
            events += self._text("message", content or "", logprobs)
        for call in delta.get("tool_calls") or []:
            events += self._call(call)
        return events

    def _text(self, kind: str, text: str, logprobs: list[dict[str, Any]] | None) -> list[str]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self.close()
            events += self._open_text(kind)
        self.text += text
        item_id, at = self.open["id"], self.index  # type: ignore[index]
        if kind == "reasoning":
            return [
                *events,
                self.out.event(
                    "response.reasoning_text.delta",
                    item_id=item_id, output_index=at, content_index=0, delta=text,
                ),
            ]  # fmt: skip
        self.logprobs += logprobs or []
        return [
            *events,
            self.out.event(
                "response.output_text.delta",
                item_id=item_id, output_index=at, content_index=0, delta=text,
                logprobs=logprobs or [],
            ),
        ]  # fmt: skip

    def _open_text(self, kind: str) -> list[str]:
        if kind == "reasoning":
            self.open = {**_reasoning_item(""), "content": []}
        else:
            self.open = {**_message_item("", None), "status": "in_progress", "content": []}
        self.text, self.logprobs = "", []
        events = [
            self.out.event("response.output_item.added", output_index=self.index, item=self.open)
        ]
        if kind == "message":
            events.append(
                self.out.event(
                    "response.content_part.added",
                    item_id=self.open["id"], output_index=self.index, content_index=0,
                    part=_text_part("", []),
                )
            )  # fmt: skip
        return events

    def _call(self, call: dict[str, Any]) -> list[str]:
        events = []
        if "id" in call:  # a call begins
            events += self.close()
            fn = call["function"]
            self.open = {**_call_item(call["id"], fn), "arguments": "", "status": "in_progress"}
            self.calls[call["index"]] = self.open
            events.append(
                self.out.event(
                    "response.output_item.added", output_index=self.index, item=self.open
                )
            )
            arguments = fn.get("arguments") or ""
        else:
            arguments = call.get("function", {}).get("arguments") or ""
        if arguments and self.open is not None and self.open["type"] == "function_call":
            self.open["arguments"] += arguments
            events.append(
                self.out.event(
                    "response.function_call_arguments.delta",
                    item_id=self.open["id"], output_index=self.index, delta=arguments,
                )
            )  # fmt: skip
        return events

    def finish(self) -> list[str]:
        """The last events: the open item closed, or an empty message when nothing was said
        (as the whole answer has one)."""
        events = [] if self.done or self.open else self._text("message", "", None)
        return [*events, *self.close()]

    def close(self) -> list[str]:
        """Close the open item, if any: its last events."""
        item, at = self.open, self.index
        if item is None:
            return []
        self.open = None
        events = []
        if item["type"] == "message":
            part = _text_part(self.text, self.logprobs)
            item = {**item, "status": "completed", "content": [part]}
            events += [
                self.out.event(
                    "response.output_text.done",
                    item_id=item["id"], output_index=at, content_index=0, text=self.text,
                    logprobs=self.logprobs,
                ),
                self.out.event(
                    "response.content_part.done",
                    item_id=item["id"], output_index=at, content_index=0, part=part,
                ),
            ]  # fmt: skip
        elif item["type"] == "reasoning":
            item = _reasoning_item(self.text, item["id"])
            events.append(
                self.out.event(
                    "response.reasoning_text.done",
                    item_id=item["id"], output_index=at, content_index=0, text=self.text,
                )
            )  # fmt: skip
        else:
            item = {**item, "status": "completed"}
            events.append(
                self.out.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"], output_index=at, name=item["name"],
                    arguments=item["arguments"],
                )
            )  # fmt: skip
        self.done.append(item)
        events.append(self.out.event("response.output_item.done", output_index=at, item=item))
        return events


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return part


def _message_item(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {
        "type": "message",
        "id": _item_id("msg"),
        "status": "completed",
        "role": "assistant",
        "content": [_text_part(text, logprobs)],
    }


def _reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id or _item_id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def _call_item(call_id: str, function: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": _item_id("fc"),
        "call_id": call_id,
        "name": function["name"],
        "arguments": function.get("arguments") or "",
        "status": "completed",
    }


def _assistant_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output items as the chat messages a continuing response renders (its reasoning
    left out, as chat templates leave out earlier turns' thinking)."""
    said = [item for item in items if item["type"] in ("message", "function_call")]
    return input_messages(
        [
            {
                "type": "message",
                "role": "assistant",
                "content": item["content"][0]["text"],
            }
            if item["type"] == "message"
            else {k: item[k] for k in ("type", "call_id", "name", "arguments")}
            for item in said
        ]
    )
