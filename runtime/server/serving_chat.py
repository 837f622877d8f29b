"""``POST /v1/chat/completions``: messages through the tokenizer's chat template."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from conveyor.runtime.server.chat_template import render_chat
from conveyor.runtime.server.context import ServerContext
from conveyor.runtime.server.engine_client import OutputStream
from conveyor.runtime.server.errors import bad_request
from conveyor.runtime.server.protocol import ChatCompletionRequest
from conveyor.runtime.server.serving_common import (
    Choice,
    EngineStreamingResponse,
    check_engine,
    check_model,
    check_prompt,
    choice_params,
    finite,
    new_id,
    run_choices,
    sampling_params,
    sse,
    sse_stream,
    submit,
    token_text,
    tokenize,
    unless_disconnected,
    usage,
)
from conveyor.runtime.server.structured_outputs import compile_grammar, structured_output
from conveyor.runtime.server.tool_calls import ToolCalling, ToolCallStream

MAX_TOP_LOGPROBS = 20


async def create_chat_completion(
    ctx: ServerContext, req: ChatCompletionRequest, request: Request
) -> Response:
    arrival = time.monotonic()
    check_model(ctx, req.model)
    check_engine(ctx)
    _check_unsupported(req)
    tools = ToolCalling.from_request(req, ctx.settings.tool_call_parser)
    structured = structured_output(req)
    if tools is not None and tools.forced:
        if structured is not None:
            raise bad_request(
                f"tool_choice {tools.mode} is forced by a grammar, so it cannot be combined "
                f"with {structured[1]}; drop one of them",
                param=structured[1],
            )
        constraint = tools.constraint()
        assert constraint is not None
        structured = (constraint, "tools")
    engine = ctx.client.engine
    assert engine is not None

    prompt_ids = await tokenize(
        ctx,
        lambda: render_chat(
            engine,
            req.messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            template_kwargs=req.chat_template_kwargs,
            tools=tools.template_tools() if tools is not None else None,
            tool_prompt=tools.tool_prompt if tools is not None else None,
        ),
        "messages",
    )
    max_tokens_param = (
        "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    )
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(
        req,
        max_tokens=req.max_completion_tokens
        if req.max_completion_tokens is not None
        else req.max_tokens,
        default_max_tokens=engine.max_model_len,  # chat's default: whatever the context leaves
        prompt_len=len(prompt_ids),
        max_model_len=engine.max_model_len,
        logprobs=logprobs,
        max_tokens_param=max_tokens_param,
        structured=structured,
    )
    check_prompt(ctx, prompt_ids, params, "messages")
    grammar = await compile_grammar(ctx, *structured) if structured else None
    request_id = new_id("chatcmpl")
    choices = [
        Choice(ctx, i, f"{request_id}-{i}", prompt_ids, choice_params(params, i))
        for i in range(req.n)
    ]
    stream = submit(ctx, choices, arrival, grammar)

    created = int(time.time())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        events = _stream(ctx, request_id, created, choices, include_usage, tools, stream)
        return EngineStreamingResponse(sse_stream(events), stream)
    body = await unless_disconnected(
        request, _collect(ctx, request_id, created, choices, tools, stream), stream
    )
    return JSONResponse(body)


def _check_unsupported(req: ChatCompletionRequest) -> None:
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}",
                param="top_logprobs",
            )


def _logprobs_content(ctx: ServerContext, logprobs: list[Any]) -> list[dict[str, Any]]:
    out = []
    for lp in logprobs:
        text = token_text(ctx, lp.token_id)
        top = []
        for token_id, logprob in lp.top:
            t = token_text(ctx, token_id)
            top.append({"token": t, "logprob": finite(logprob), "bytes": list(t.encode())})
        out.append(
            {
                "token": text,
                "logprob": finite(lp.logprob),
                "bytes": list(text.encode()),
                "top_logprobs": top,
            }
        )
    return out


async def _collect(
    ctx: ServerContext,
    request_id: str,
    created: int,
    choices: list[Choice],
    tools: ToolCalling | None,
    stream: OutputStream,
) -> dict[str, Any]:
    async for _ in run_choices(ctx, choices, stream):
        pass
    out = []
    for c in choices:
        lp = {"content": _logprobs_content(ctx, c.logprobs)} if c.want_logprobs else None
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        finish_reason = c.finish_reason
        calls = tools.extract(c.text) if tools is not None else None
        if calls is not None and calls[1]:
            message = {"role": "assistant", "content": calls[0], "tool_calls": calls[1]}
            finish_reason = "tool_calls"
        elif calls is not None:  # an empty list of calls: the rest is the answer
            message["content"] = calls[0] or ""
        out.append(
            {
                "index": c.index,
                "message": message,
                "logprobs": lp,
                "finish_reason": finish_reason,
                "stop_reason": c.stop_reason,
            }
        )
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": ctx.model_name,
        "choices": out,
        "usage": usage(choices),
    }


async def _stream(
    ctx: ServerContext,
    request_id: str,
    created: int,
    choices: list[Choice],
    include_usage: bool,
    tools: ToolCalling | None,
    stream: OutputStream,
) -> AsyncIterator[str]:
    head = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": ctx.model_name,
    }
    extra = {"usage": None} if include_usage else {}

    def chunk(
        index: int,
        delta: dict[str, Any],
        logprobs: list[Any] | None,
        finish: str | None,
        stop_reason: str | int | None = None,
    ) -> str:
        choice: dict[str, Any] = {
            "index": index,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish,
        }
        if logprobs:
            choice["logprobs"] = {"content": _logprobs_content(ctx, logprobs)}
        if finish is not None:
            choice["stop_reason"] = stop_reason
        return sse({**head, "choices": [choice], **extra})

    for c in choices:
        yield chunk(c.index, {"role": "assistant", "content": ""}, None, None)
    tool_streams = {c.index: ToolCallStream(tools) for c in choices} if tools else {}
    async for choice, delta in run_choices(ctx, choices, stream):
        finish = delta.finish_reason
        if tools is None:
            deltas = [{"content": delta.text} if delta.text or delta.num_tokens else {}]
        else:
            deltas, called = tool_streams[choice.index].update(delta.text, finish is not None)
            finish = "tool_calls" if called else finish
        for k, d in enumerate(deltas):
            last = k == len(deltas) - 1
            yield chunk(
                choice.index,
                d,
                delta.logprobs if last else None,
                finish if last else None,
                choice.stop_reason if last and finish else None,
            )
    if include_usage:
        yield sse({**head, "choices": [], "usage": usage(choices)})
