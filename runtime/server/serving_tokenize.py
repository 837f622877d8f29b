"""``POST /tokenize`` and ``POST /detokenize``, as vLLM serves them: what the model would
see for a prompt or a conversation, and the text of token ids."""

from __future__ import annotations

from functools import partial
from typing import Any

from conveyor.runtime.server.chat_template import render_chat
from conveyor.runtime.server.context import ServerContext
from conveyor.runtime.server.errors import bad_request
from conveyor.runtime.server.protocol import DetokenizeRequest, TokenizeRequest
from conveyor.runtime.server.serving_common import check_engine, check_model, tokenize
from conveyor.runtime.server.tool_prompt import TOOL_PROMPTS


async def create_tokenize(ctx: ServerContext, req: TokenizeRequest) -> dict[str, Any]:
    check_model(ctx, req.model)
    check_engine(ctx)
    engine = ctx.client.engine
    assert engine is not None
    if (req.prompt is None) == (req.messages is None):
        raise bad_request(
            "give exactly one of prompt (a string) or messages (a chat conversation)",
            param="prompt" if req.prompt is not None else "messages",
        )
    if req.messages is not None:
        messages = req.messages
        ids = await tokenize(
            ctx,
            lambda: render_chat(
                engine,
                messages,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                template_kwargs=req.chat_template_kwargs,
                tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
                tool_prompt=TOOL_PROMPTS.get(ctx.settings.tool_call_parser or ""),
                add_special_tokens=bool(req.add_special_tokens),
            ),
            "messages",
        )
    else:
        assert req.prompt is not None
        special = req.add_special_tokens is not False
        ids = await tokenize(ctx, partial(engine.encode_prompt, req.prompt, special), "prompt")
    body: dict[str, Any] = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
    body["token_strs"] = (
        engine.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    )
    return body


async def create_detokenize(ctx: ServerContext, req: DetokenizeRequest) -> dict[str, Any]:
    check_model(ctx, req.model)
    check_engine(ctx)
    engine = ctx.client.engine
    assert engine is not None
    vocab = engine.runner.vocab_size
    for t in req.tokens:
        if not 0 <= t < vocab:
            raise bad_request(f"tokens must be token ids in [0, {vocab}), got {t}", param="tokens")
    return {"prompt": engine.tokenizer.decode(req.tokens)}
