"""What every endpoint that reaches the engine shares: admission (the model, the engine, the
queue bound), tokenising off the event loop, and the transport of a response (Server-Sent
Events, a client that goes away). The generating endpoints' request path is
``serving_generate.py``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from conveyor.runtime.server.context import ServerContext
from conveyor.runtime.server.engine_client import OutputStream
from conveyor.runtime.server.errors import (
    NOT_FOUND,
    TOO_MANY_REQUESTS,
    UNAVAILABLE,
    APIError,
    bad_request,
)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_model(ctx: ServerContext, model: str | None) -> str | None:
    """The LoRA adapter ``model`` names (None: the base model); a 404 for any other name."""
    if model is None or model == ctx.model_name:
        return None
    if model in ctx.loras:
        return model
    served = ", ".join(repr(m) for m in [ctx.model_name, *ctx.loras])
    raise APIError(
        NOT_FOUND,
        f"model {model!r} is not served here; this replica serves {served} (see GET /v1/models)",
        param="model",
        code="model_not_found",
    )


def check_engine(ctx: ServerContext) -> None:
    retry = {"Retry-After": str(ctx.settings.retry_after)}
    if ctx.drain.draining:
        raise APIError(
            UNAVAILABLE,
            "this replica is shutting down; retry on another one",
            code="draining",
            headers=retry,
        )
    if not ctx.client.loaded:
        if ctx.client.error is not None:
            raise APIError(
                UNAVAILABLE, f"the engine failed: {ctx.client.error!r}", code="engine_dead"
            )
        raise APIError(
            UNAVAILABLE,
            "the model is still loading; retry when GET /ready returns 200",
            code="loading",
            headers=retry,
        )


def check_queue(ctx: ServerContext, num_new: int) -> None:
    """429 when admitting ``num_new`` requests would leave more than --max-queued-requests waiting."""
    limit = ctx.settings.max_queued_requests
    if limit is None:
        return
    snap = ctx.client.snapshot()
    max_running = snap.max_running_requests or ctx.settings.engine.max_running_requests
    if num_new > max_running + limit:
        # Refused even by an idle replica: a 429 would have the client retry forever.
        raise bad_request(
            f"this request needs {num_new} engine requests (n times the prompts), but this "
            f"replica runs at most {max_running} and queues at most {limit}; lower n (or "
            f"send fewer prompts) to at most {max_running + limit} in all",
            param="n",
        )
    free_slots = max(0, (snap.max_running_requests or 0) - snap.num_running)
    would_wait = max(0, snap.num_waiting + num_new - free_slots)
    if would_wait > limit:
        raise APIError(
            TOO_MANY_REQUESTS,
            f"{snap.num_waiting} requests are waiting and this replica queues at most {limit}; "
            f"retry after {ctx.settings.retry_after}s or send to another replica",
            code="queue_full",
            headers={"Retry-After": str(ctx.settings.retry_after)},
        )


async def tokenize(ctx: ServerContext, fn: Callable[[], list[int]], param: str) -> list[int]:
    """Run ``fn`` (tokenising one prompt) on the tokenizer pool, timed; the ``ValueError``
    of text no tokenizer can take, or too long to fit (``encode_prompt``), is a 400 naming
    ``param``."""

    def timed() -> list[int]:
        start = time.perf_counter()
        try:
            return fn()
        except ValueError as exc:
            code = "context_length_exceeded" if "context length" in str(exc) else None
            raise bad_request(str(exc), param=param, code=code) from None
        finally:
            ctx.metrics.tokenize.observe(time.perf_counter() - start)

    return await asyncio.get_running_loop().run_in_executor(ctx.tokenize_pool, timed)


class EngineStreamingResponse(StreamingResponse):
    """An SSE response that closes its engine stream however the response ends (finished,
    client gone before the first byte, or cancelled)."""

    def __init__(self, content: AsyncIterator[str], stream: OutputStream) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._stream = stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.close()


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def sse_stream(events: AsyncGenerator[str, None]) -> AsyncIterator[str]:
    """Relay ``events``; an error after the first byte ends the stream with an error event."""
    try:
        async with aclosing(events) as it:
            async for event in it:
                yield event
    except APIError as exc:
        yield sse(exc.body())
    yield SSE_DONE


async def unless_disconnected(request: Request, work: Awaitable[Any], stream: OutputStream) -> Any:
    """Await ``work``; cancel it (aborting its engine requests) if the client goes away first.

    Streams need no such guard: the streaming response cancels its body on disconnect.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise APIError((499, "client_closed_request"), "the client closed the connection")
    finally:
        watcher.cancel()
        task.cancel()
        stream.close()


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
