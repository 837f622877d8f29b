"""What completions and chat completions share: admission, sampling parameters, the
per-choice detokenising state, logprobs, usage and Server-Sent Events.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from conveyor.runtime.engine.detokenizer import IncrementalDetokenizer
from conveyor.runtime.sampling_params import SEED_MIN, SamplingParams, StructuredOutputParams
from conveyor.runtime.server.context import ServerContext
from conveyor.runtime.server.engine_client import EngineDeadError, EngineRequest, OutputStream
from conveyor.runtime.server.errors import (
    INTERNAL,
    NOT_FOUND,
    TOO_MANY_REQUESTS,
    UNAVAILABLE,
    APIError,
    bad_request,
    from_value_error,
)
from conveyor.runtime.server.protocol import _Sampling

if TYPE_CHECKING:
    from conveyor.runtime.engine.outputs import RequestOutput
    from conveyor.runtime.engine.sequence import TokenLogprob

SAMPLING_PARAM_NAMES = {f.name for f in SamplingParams.__dataclass_fields__.values()}
MIN_LOGPROB = -9999.0
"""-inf is not JSON; OpenAI clients expect a finite number."""


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_model(ctx: ServerContext, model: str | None) -> None:
    if model is not None and model != ctx.model_name:
        raise APIError(
            NOT_FOUND,
            f"model {model!r} is not served here; this replica serves {ctx.model_name!r} "
            "(see GET /v1/models)",
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
    of text no tokenizer can take (``encode_prompt``) is a 400 naming ``param``."""

    def timed() -> list[int]:
        start = time.perf_counter()
        try:
            return fn()
        except ValueError as exc:
            raise bad_request(str(exc), param=param) from None
        finally:
            ctx.metrics.tokenize.observe(time.perf_counter() - start)

    return await asyncio.get_running_loop().run_in_executor(ctx.tokenize_pool, timed)


def sampling_params(
    req: _Sampling,
    *,
    max_tokens: int | None,
    default_max_tokens: int,
    prompt_len: int,
    max_model_len: int,
    logprobs: int | None,
    max_tokens_param: str = "max_tokens",
    structured: tuple[StructuredOutputParams, str] | None = None,
) -> SamplingParams:
    """The request's sampling fields as engine ``SamplingParams``; 400 naming the bad field."""
    room = max_model_len - prompt_len
    if max_tokens is None:
        max_tokens = max(1, min(default_max_tokens, room))
    elif max_tokens >= 1 and max_tokens > room:
        raise bad_request(
            f"this model's context length is {max_model_len} tokens, but the prompt is {prompt_len} "
            f"tokens and {max_tokens_param} is {max_tokens}; lower {max_tokens_param} to at most "
            f"{max(room, 0)} or shorten the prompt",
            param=max_tokens_param,
            code="context_length_exceeded",
        )
    fields: dict[str, Any] = {
        "max_tokens": max_tokens,
        "min_tokens": req.min_tokens,
        "stop": [req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        "stop_token_ids": list(req.stop_token_ids or []),
        "ignore_eos": req.ignore_eos,
        "logprobs": logprobs,
        "seed": req.seed,
        "skip_special_tokens": req.skip_special_tokens,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "logit_bias": _logit_bias(req.logit_bias),
        "structured_output": structured[0] if structured else None,
    }
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ):
        value = getattr(req, name)
        if value is not None:
            fields[name] = value
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        err = from_value_error(exc, SAMPLING_PARAM_NAMES)
        if err.param == "max_tokens":
            err.param = max_tokens_param
            err.message = err.message.replace("max_tokens", max_tokens_param, 1)
        if err.param == "structured_output" and structured:
            err.param = structured[1]
            err.message = err.message.replace("structured_output", structured[1], 1)
        raise err from None


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float]:
    """OpenAI sends token ids as JSON object keys, so as strings."""
    out: dict[int, float] = {}
    for key, value in (raw or {}).items():
        try:
            out[int(key)] = value
        except ValueError:
            raise bad_request(
                f'logit_bias keys must be token ids such as "50256", got {key!r}',
                param="logit_bias",
            ) from None
    return out


def check_prompt(
    ctx: ServerContext, prompt_ids: list[int], params: SamplingParams, param: str
) -> None:
    assert ctx.client.engine is not None
    try:
        ctx.client.engine.check_request(prompt_ids, params)
    except ValueError as exc:
        code = "context_length_exceeded" if "context length" in str(exc) else None
        named = str(exc).split(" ", 1)[0]
        param = named if named in SAMPLING_PARAM_NAMES else param
        raise bad_request(str(exc), param=param, code=code) from None


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The ``index``-th of ``n`` choices: distinct but reproducible when a seed is given."""
    if params.seed is None or index == 0:
        return params
    seed = (params.seed + index - SEED_MIN) % 2**64 + SEED_MIN  # wraps within 64 bits
    return SamplingParams(**{**params.__dict__, "seed": seed})


@dataclass
class Delta:
    """What one engine output adds to one choice."""

    text: str
    """May be empty while tokens arrive (a character not complete yet, a special token)."""
    num_tokens: int
    logprobs: list[TokenLogprob]
    finish_reason: str | None


class Choice:
    """One choice of a response: an engine request and its incremental detokeniser."""

    def __init__(
        self,
        ctx: ServerContext,
        index: int,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        prompt_index: int = 0,
    ) -> None:
        assert ctx.client.engine is not None
        self.index = index
        self.prompt_index = prompt_index
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.want_logprobs = params.logprobs is not None
        self._detok = IncrementalDetokenizer(ctx.client.engine.tokenizer, params, prompt_ids)
        self._observe = ctx.metrics.detokenize.observe
        self.emitted_len = 0
        """Characters of text handed out so far."""
        self.logprobs: list[TokenLogprob] = []
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    @property
    def text(self) -> str:
        """The whole output text (complete once the choice has finished)."""
        return self._detok.text

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    def update(self, out: RequestOutput) -> Delta | None:
        """Detokenise ``out``; None once finished (the engine's final abort after a stop string)."""
        if self.finish_reason is not None:
            return None
        start = time.perf_counter()
        text = self._detok.update(out.new_token_ids)
        finish = None
        if self._detok.stopped_by is not None:
            finish, self.stop_reason = "stop", self._detok.stopped_by
        elif out.finished:
            text += self._detok.flush()
            finish, self.stop_reason = out.finish_reason, out.stop_reason
        self._observe(time.perf_counter() - start)
        self.emitted_len += len(text)
        self.num_output_tokens = len(out.output_token_ids)
        self.num_cached_tokens = out.num_cached_tokens
        logprobs = out.new_logprobs if self.want_logprobs else []
        if logprobs:
            self.logprobs.extend(logprobs)
        self.finish_reason = finish
        return Delta(text, len(out.new_token_ids), logprobs, finish)


def submit(
    ctx: ServerContext, choices: list[Choice], arrival: float, grammar: object | None = None
) -> OutputStream:
    """Admit the choices (429 above the queue bound) and hand them to the engine, with no
    ``await`` in between, so concurrent requests cannot all pass the same check.
    ``grammar``: the choices' compiled structured output, if they have one."""
    check_queue(ctx, len(choices))
    try:
        return ctx.client.submit(
            [EngineRequest(c.request_id, c.prompt_ids, c.params, arrival, grammar) for c in choices]
        )
    except EngineDeadError as exc:
        raise APIError(UNAVAILABLE, f"the engine stopped: {exc}", code="engine_dead") from exc


async def run_choices(
    ctx: ServerContext, choices: list[Choice], stream: OutputStream
) -> AsyncIterator[tuple[Choice, Delta]]:
    """Yield each choice's non-empty deltas as steps complete, until every choice finished.

    A choice stopped by a stop string is aborted in the engine at once (its finish reason
    stays ``stop``). Leaving early, for any reason, aborts what is still running.
    """
    by_id = {c.request_id: c for c in choices}
    remaining = len(choices)
    try:
        async for out in stream:
            choice = by_id[out.request_id]
            delta = choice.update(out)
            if delta is None:
                continue
            if delta.finish_reason is not None:
                remaining -= 1
                if not out.finished:  # a stop string: the engine does not know yet
                    ctx.client.abort(out.request_id, finish_reason="stop")
            # One chunk per step that produced tokens, even when their text is not out yet
            # (as vLLM does): clients time every token.
            if delta.num_tokens or delta.text or delta.finish_reason is not None:
                yield choice, delta
            if remaining == 0:
                return
    except EngineDeadError as exc:
        raise APIError(
            INTERNAL, f"the engine stopped: {exc}; the replica needs a restart", code="engine_dead"
        ) from exc
    finally:
        stream.close()


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


def usage(choices: list[Choice]) -> dict[str, Any]:
    """OpenAI's usage: each prompt counted once, however many choices it has."""
    per_prompt: dict[int, Choice] = {}
    for c in choices:
        per_prompt.setdefault(c.prompt_index, c)
    prompt_tokens = sum(c.prompt_len for c in per_prompt.values())
    completion_tokens = sum(c.num_output_tokens for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": sum(c.num_cached_tokens for c in per_prompt.values())
        },
    }


def token_text(ctx: ServerContext, token_id: int) -> str:
    text = ctx.token_text.get(token_id)
    if text is None:
        assert ctx.client.engine is not None
        text = ctx.client.engine.tokenizer.decode([token_id])
        ctx.token_text[token_id] = text
    return text


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def sse_stream(events: AsyncIterator[str]) -> AsyncIterator[str]:
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
