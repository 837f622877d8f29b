"""``POST /v1/responses``, OpenAI's Responses API, and the responses a replica keeps.

A response is served as the chat completion its request becomes
(``ResponsesRequest.to_chat``): the same checks, chat template, tools, structured output and
reasoning parser. What differs is the answer's shape: ``output`` is a list of items (the
reasoning, the message, each function call: ``response_items.py``), and a stream is a
sequence of typed events (``response.created``, ``response.output_text.delta``, ...,
``response.completed``), each with a ``sequence_number``. A whole response is built from the
same deltas as a streamed one, so the two are the same items.

Responses are kept (``store``, true by default as OpenAI has it) in memory, the newest
within ``--responses-store-mb`` (``response_store.py``): a later request continues one with
``previous_response_id``, ``GET`` / ``DELETE /v1/responses/{id}`` read and remove it, and
``GET /v1/responses/{id}/input_items`` lists what its request sent. The
id names the replica that holds it, so the gateway sends those requests there
(``conveyor/contracts/response_id.py``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from conveyor.contracts.response_id import REPLICA_TAG_HEADER, new_response_id
from conveyor.runtime.server.choices import run_choices, usage
from conveyor.runtime.server.context import ServerContext
from conveyor.runtime.server.engine_client import OutputStream
from conveyor.runtime.server.errors import NOT_FOUND, APIError, bad_request
from conveyor.runtime.server.response_items import EventWriter, OutputItems, said_items
from conveyor.runtime.server.response_store import StoredResponse
from conveyor.runtime.server.responses_protocol import (
    NamedFunctionChoice,
    ResponsesRequest,
    input_items,
    input_messages,
)
from conveyor.runtime.server.serving_chat import ChatCompletion
from conveyor.runtime.server.serving_common import EngineStreamingResponse

CHAT_NAMES = {
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
}
"""Fields of the chat request a response is served as, by their Responses names: what a 400
from the chat path names."""


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(
        NOT_FOUND,
        f"no stored response {response_id!r} on this replica: a response is kept in memory on "
        "the replica that made it (the newest, within --responses-store-mb), and only with "
        "store: true",
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
        history = previous.messages()
    conversation = [*history, *input_messages(req.input)]
    response_id = new_response_id(request.headers.get(REPLICA_TAG_HEADER))
    try:
        generation = ResponseGeneration(ctx, req, conversation, response_id)
        return await generation.create(request)
    except APIError as exc:
        raise in_responses_terms(exc) from None


def in_responses_terms(exc: APIError) -> APIError:
    """A 400 of the chat path, naming the Responses field at fault."""
    param = exc.param or ""
    head, _, rest = param.partition(".")
    if head in CHAT_NAMES:
        exc.param = CHAT_NAMES[head] + (f".{rest}" if rest else "")
    elif head == "tools":
        exc.param = "tools"
    for chat, ours in CHAT_NAMES.items():
        exc.message = exc.message.replace(chat, ours)
    return exc


def get_response(ctx: ServerContext, response_id: str) -> Response:
    stored = ctx.responses.get(response_id)
    if stored is None:
        raise not_found(response_id)
    return Response(stored.body, media_type="application/json")


def delete_response(ctx: ServerContext, response_id: str) -> dict[str, Any]:
    if not ctx.responses.delete(response_id):
        raise not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def list_input_items(
    ctx: ServerContext,
    response_id: str,
    after: str | None = None,
    before: str | None = None,
    limit: int = 20,
    order: str = "desc",
) -> dict[str, Any]:
    """``GET /v1/responses/{id}/input_items``: a page of the items its request's ``input``
    held, newest first unless ``order`` is ``asc``, as OpenAI lists them. ``after`` and
    ``before`` are item ids of the same listing (one the response does not have is a 400):
    the page is the ``limit`` items just after ``after``, or else just before ``before``."""
    stored = ctx.responses.get(response_id)
    if stored is None:
        raise not_found(response_id)
    items = stored.items()
    if order == "desc":
        items.reverse()
    ids = [item["id"] for item in items]
    start, end = 0, len(items)
    for param, at in (("after", after), ("before", before)):
        if at is None:
            continue
        if at not in ids:
            raise bad_request(
                f"{param}: response {response_id!r} has no input item {at!r}; send an id "
                "from its input_items",
                param=param,
            )
        if param == "after":
            start = ids.index(at) + 1
        else:
            end = ids.index(at)
    window = items[start:end]
    page = window[-limit:] if before is not None and after is None else window[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(window) > limit,
    }


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

    def _items(self, out: EventWriter | None = None) -> OutputItems:
        return OutputItems(out, want_logprobs=self.source.wants_logprobs)

    async def _collect(self, stream: OutputStream) -> dict[str, Any]:
        items = self._items()
        async for choice, delta in run_choices(self.ctx, self.choices, stream):
            items.take(self.chunk_choices(choice, delta), delta.num_tokens)
        items.finish(self._cut_short)
        return self._finish(items)

    def streaming_response(self, stream: OutputStream) -> Response:
        return EngineStreamingResponse(self._events(stream), stream)

    async def _events(self, stream: OutputStream) -> AsyncIterator[str]:
        """The response's events; an error after the first byte is an ``error`` event and a
        ``response.failed``, as OpenAI ends a stream that fails."""
        out = EventWriter()
        items = self._items(out)
        yield out.event("response.created", response=self._body("in_progress", []))
        yield out.event("response.in_progress", response=self._body("in_progress", []))
        try:
            async for choice, delta in run_choices(self.ctx, self.choices, stream):
                for event in items.take(self.chunk_choices(choice, delta), delta.num_tokens):
                    yield event
            for event in items.finish(self._cut_short):
                yield event
            # response.completed also for an incomplete one (its status says so), as vLLM
            # sends it: the OpenAI SDK's stream helper waits for that event alone.
            yield out.event("response.completed", response=self._finish(items))
        except APIError as exc:
            error = exc.body()["error"]
            yield out.event(
                "error", code=error.get("code"), message=error["message"], param=error.get("param")
            )
            failed = self._body("failed", items.done)
            failed["error"] = {"code": "server_error", "message": error["message"]}
            yield out.event("response.failed", response=failed)

    @property
    def _cut_short(self) -> bool:
        return self.choices[0].finish_reason == "length"

    def _finish(self, items: OutputItems) -> dict[str, Any]:
        """The finished response (stored when asked), from its output items."""
        body = self._body("completed", items.done)
        if self._cut_short:
            body["status"] = "incomplete"
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        u = usage(self.choices)
        cached = u["prompt_tokens_details"]["cached_tokens"]
        body["usage"] = {
            "input_tokens": u["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": cached,
                "cache_write_tokens": self._cache_writes(u["prompt_tokens"], cached),
            },
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": items.reasoning_tokens},
            "total_tokens": u["total_tokens"],
        }
        if self.source.store and self.ctx.responses.enabled:
            said = input_messages(said_items(items.done))
            sent = input_items(self.source.input)
            stored = StoredResponse.of(body, [*self.conversation, *said], sent)
            self.ctx.responses.put(self.request_id, stored)
        return body

    def _cache_writes(self, prompt_tokens: int, cached: int) -> int:
        """Prompt tokens this request added to the prefix cache: its whole blocks that were
        not found there."""
        settings = self.engine.settings
        if not settings.enable_prefix_caching:
            return 0
        whole = prompt_tokens // settings.block_size * settings.block_size
        return max(0, whole - cached)

    def _body(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        req = self.source
        params = self.choices[0].params if self.choices else None
        tool_choice = req.tool_choice
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
            "model": self.model_name,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
            "service_tier": "default",
            "store": req.store and self.ctx.responses.enabled,
            "temperature": params.temperature if params else req.temperature,
            "text": {"format": req.text_format or {"type": "text"}},
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
