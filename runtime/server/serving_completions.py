"""``POST /v1/completions``: text in, text out (OpenAI's legacy completions API)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from conveyor.runtime.server.context import ServerContext
from conveyor.runtime.server.engine_client import OutputStream
from conveyor.runtime.server.errors import bad_request
from conveyor.runtime.server.protocol import CompletionRequest
from conveyor.runtime.server.serving_common import (
    Choice,
    Delta,
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

DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for completions."""


async def create_completion(
    ctx: ServerContext, req: CompletionRequest, request: Request
) -> Response:
    arrival = time.monotonic()
    check_model(ctx, req.model)
    check_engine(ctx)
    if req.suffix:
        raise bad_request("suffix is not supported; remove it", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(
            f"best_of must equal n ({req.n}) or be omitted; this server returns every "
            "choice it generates",
            param="best_of",
        )
    if req.echo and req.logprobs is not None:
        raise bad_request(
            "echo together with logprobs is not supported (no prompt logprobs); drop one of them",
            param="echo",
        )
    structured = structured_output(req)
    engine = ctx.client.engine
    assert engine is not None

    prompts = _prompts(req.prompt)
    choices: list[Choice] = []
    echoes: list[str] = []
    request_id = new_id("cmpl")
    for p_index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            prompt_ids = await tokenize(ctx, lambda p=prompt: engine.encode_prompt(p), "prompt")
        else:
            prompt_ids = list(prompt)
        params = sampling_params(
            req,
            max_tokens=req.max_tokens,
            default_max_tokens=DEFAULT_MAX_TOKENS,
            prompt_len=len(prompt_ids),
            max_model_len=engine.max_model_len,
            logprobs=req.logprobs,
            structured=structured,
        )
        check_prompt(ctx, prompt_ids, params, "prompt")
        if req.echo:
            echoes.append(
                prompt if isinstance(prompt, str) else engine.tokenizer.decode(prompt_ids)
            )
        for i in range(req.n):
            index = p_index * req.n + i
            choices.append(
                Choice(
                    ctx,
                    index,
                    f"{request_id}-{index}",
                    prompt_ids,
                    choice_params(params, i),
                    p_index,
                )
            )
    grammar = await compile_grammar(ctx, *structured) if structured else None
    stream = submit(ctx, choices, arrival, grammar)

    created = int(time.time())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        events = _stream(ctx, request_id, created, choices, echoes, include_usage, stream)
        return EngineStreamingResponse(sse_stream(events), stream)
    body = await unless_disconnected(
        request, _collect(ctx, request_id, created, choices, echoes, stream), stream
    )
    return JSONResponse(body)


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request(
            "prompt must not be empty: give a string, a list of strings, a list of "
            "token ids, or a list of lists of token ids",
            param="prompt",
        )
    if all(isinstance(p, int) for p in prompt):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


def _logprobs(ctx: ServerContext, delta: Delta, offset: int) -> dict[str, Any]:
    tokens, token_logprobs, top, offsets = [], [], [], []
    for lp in delta.logprobs:
        text = token_text(ctx, lp.token_id)
        tokens.append(text)
        token_logprobs.append(finite(lp.logprob))
        alternatives = {text: finite(lp.logprob)}
        for token_id, logprob in lp.top:
            alternatives.setdefault(token_text(ctx, token_id), finite(logprob))
        top.append(alternatives)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


async def _collect(
    ctx: ServerContext,
    request_id: str,
    created: int,
    choices: list[Choice],
    echoes: list[str],
    stream: OutputStream,
) -> dict[str, Any]:
    logprobs: dict[int, dict[str, Any]] = {}
    async for choice, delta in run_choices(ctx, choices, stream):
        if choice.want_logprobs and delta.logprobs:
            part = _logprobs(ctx, delta, choice.emitted_len - len(delta.text))
            acc = logprobs.setdefault(choice.index, {k: [] for k in part})
            for k, v in part.items():
                acc[k].extend(v)
    out = []
    for c in choices:
        lp = None
        if c.want_logprobs:
            lp = logprobs.get(
                c.index, {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            )
        prefix = echoes[c.prompt_index] if echoes else ""
        out.append(
            {
                "index": c.index,
                "text": prefix + c.text,
                "logprobs": lp,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
        )
    return {
        "id": request_id,
        "object": "text_completion",
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
    echoes: list[str],
    include_usage: bool,
    stream: OutputStream,
) -> AsyncIterator[str]:
    head = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": ctx.model_name,
    }
    extra = {"usage": None} if include_usage else {}

    def chunk(
        index: int,
        text: str,
        logprobs: dict[str, Any] | None,
        finish: str | None,
        stop_reason: str | int | None = None,
    ) -> str:
        return sse(
            {
                **head,
                "choices": [
                    {
                        "index": index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": finish,
                        "stop_reason": stop_reason,
                    }
                ],
                **extra,
            }
        )

    if echoes:
        for c in choices:
            yield chunk(c.index, echoes[c.prompt_index], None, None)
    async for choice, delta in run_choices(ctx, choices, stream):
        lp = (
            _logprobs(ctx, delta, choice.emitted_len - len(delta.text))
            if choice.want_logprobs
            else None
        )
        yield chunk(
            choice.index,
            delta.text,
            lp,
            delta.finish_reason,
            choice.stop_reason if delta.finish_reason else None,
        )
    if include_usage:
        yield sse({**head, "choices": [], "usage": usage(choices)})
