"""``POST /v1/chat/completions``: messages through the tokenizer's chat template."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response

from conveyor.runtime.sampling_params import StructuredOutputParams
from conveyor.runtime.server.chat_template import render_chat
from conveyor.runtime.server.choices import Choice, Delta, finite
from conveyor.runtime.server.context import ServerContext
from conveyor.runtime.server.errors import bad_request
from conveyor.runtime.server.protocol import ChatCompletionRequest
from conveyor.runtime.server.reasoning import ReasoningParser, ReasoningStream
from conveyor.runtime.server.serving_common import tokenize
from conveyor.runtime.server.serving_generate import GenerateRequest
from conveyor.runtime.server.tool_calls import ToolCalling, ToolCallStream

if TYPE_CHECKING:
    from conveyor.runtime.engine.sequence import TokenLogprob

MAX_TOP_LOGPROBS = 20


async def create_chat_completion(
    ctx: ServerContext, req: ChatCompletionRequest, request: Request
) -> Response:
    return await ChatCompletion(ctx, req).create(request)


class ChatCompletion(GenerateRequest[ChatCompletionRequest]):
    id_prefix = "chatcmpl"
    body_object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    prompt_param = "messages"

    def __init__(self, ctx: ServerContext, req: ChatCompletionRequest) -> None:
        super().__init__(ctx, req)
        self.tools: ToolCalling | None = None
        self._tool_streams: dict[int, ToolCallStream] = {}
        """Per choice index, when the request has tools (used when it streams)."""
        name = ctx.settings.reasoning_parser
        self.reasoning = ReasoningParser(name) if name is not None else None
        self._reasoning_streams: dict[int, ReasoningStream] = {}
        """Per choice index, with ``--reasoning-parser`` (used when it streams)."""

    def check(self) -> None:
        req = self.req
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
            if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
                raise bad_request(
                    f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}",
                    param="top_logprobs",
                )
        self.tools = ToolCalling.from_request(req, self.ctx.settings.tool_call_parser)
        if self.tools is not None:
            self._tool_streams = {i: ToolCallStream(self.tools) for i in range(req.n)}
        if self.reasoning is not None:
            self._reasoning_streams = {i: ReasoningStream(self.reasoning) for i in range(req.n)}

    def structured_output(self) -> tuple[StructuredOutputParams, str] | None:
        """The request's own constraint, or the one a forced tool choice brings."""
        structured = super().structured_output()
        tools = self.tools
        if tools is None or not tools.forced:
            return structured
        if structured is not None:
            raise bad_request(
                f"tool_choice {tools.mode} is forced by a grammar, so it cannot be combined "
                f"with {structured[1]}; drop one of them",
                param=structured[1],
            )
        constraint = tools.constraint()
        assert constraint is not None
        return constraint, "tools"

    async def prompts(self) -> AsyncGenerator[list[int], None]:
        req, engine, tools = self.req, self.engine, self.tools
        yield await tokenize(
            self.ctx,
            lambda: render_chat(
                engine,
                req.messages,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                template_kwargs=req.chat_template_kwargs,
                tools=tools.template_tools() if tools is not None else None,
                tool_prompt=tools.tool_prompt if tools is not None else None,
                max_tokens=engine.max_model_len,
                keep_last=self.keep,
            ),
            "messages",
        )

    def max_tokens(self) -> tuple[int | None, str]:
        if self.req.max_completion_tokens is not None:
            return self.req.max_completion_tokens, "max_completion_tokens"
        return self.req.max_tokens, "max_tokens"

    def default_max_tokens(self) -> int:
        return self.engine.max_model_len  # chat's default: whatever the context leaves

    def num_logprobs(self) -> int | None:
        return (self.req.top_logprobs or 0) if self.req.logprobs else None

    # -- the response ----------------------------------------------------------------------

    def _logprobs_content(
        self, choice: Choice, logprobs: list[TokenLogprob]
    ) -> list[dict[str, Any]]:
        """``logprobs``, the tail of the choice's, as OpenAI's ``logprobs.content``."""
        out = []
        texts = self.output_logprob_texts(choice, logprobs)
        for lp, (text, alternatives) in zip(logprobs, texts, strict=True):
            top = [
                {"token": t, "logprob": finite(logprob), "bytes": list(t.encode())}
                for t, (_, logprob) in zip(alternatives, lp.top, strict=True)
            ]
            out.append(
                {
                    "token": text,
                    "logprob": finite(lp.logprob),
                    "bytes": list(text.encode()),
                    "top_logprobs": top,
                }
            )
        return out

    def body_extras(self) -> dict[str, Any]:
        """vLLM's ``prompt_logprobs`` of the one prompt every choice shares, when asked."""
        if self.req.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": self.prompt_logprobs_body(self.choices[0])}

    def choice_body(self, choice: Choice) -> dict[str, Any]:
        lp = (
            {"content": self._logprobs_content(choice, choice.logprobs)}
            if choice.want_logprobs
            else None
        )
        reasoning: str | None = None
        answer: str | None = choice.text
        if self.reasoning is not None:  # the thinking apart; tool calls are in the answer
            reasoning, answer = self.reasoning.split(choice.text)
        message: dict[str, Any] = {"role": "assistant", "content": answer}
        finish_reason = choice.finish_reason
        calls = self.tools.extract(answer or "") if self.tools is not None else None
        if calls is not None and calls[1]:
            message = {"role": "assistant", "content": calls[0], "tool_calls": calls[1]}
            if self.tools is not None:
                finish_reason = self.tools.finish_reason(answer or "", finish_reason)
        elif calls is not None:  # an empty list of calls: the rest is the answer
            message["content"] = calls[0] or ""
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return {
            "index": choice.index,
            "message": message,
            "logprobs": lp,
            "finish_reason": finish_reason,
            "stop_reason": choice.stop_reason,
        }

    def first_chunks(self) -> list[dict[str, Any]]:
        return [
            self._chunk(c, {"role": "assistant", "content": ""}, None, None) for c in self.choices
        ]

    def chunk_choices(self, choice: Choice, delta: Delta) -> list[dict[str, Any]]:
        finish = delta.finish_reason
        text, thought = delta.text, ""
        if self.reasoning is not None:
            thought, text = self._reasoning_streams[choice.index].update(text, finish is not None)
        if self.tools is None:
            deltas = [{"content": text} if text or (delta.num_tokens and not thought) else {}]
        else:
            deltas, called = self._tool_streams[choice.index].update(text, finish is not None)
            finish = "tool_calls" if called else finish
        if thought:  # the thinking first, then the answer's deltas that say something
            deltas = [{"reasoning_content": thought}, *(d for d in deltas if d)]
        elif self.tools is not None and finish is None and not delta.logprobs and deltas == [{}]:
            return []  # a token held back (a call's wrapper): nothing to send for it
        last = len(deltas) - 1
        return [
            self._chunk(
                choice,
                d,
                delta.logprobs if k == last else None,
                finish if k == last else None,
                choice.stop_reason if k == last and finish else None,
            )
            for k, d in enumerate(deltas)
        ]

    def _chunk(
        self,
        c: Choice,
        delta: dict[str, Any],
        logprobs: list[TokenLogprob] | None,
        finish: str | None,
        stop_reason: str | int | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": c.index,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish,
        }
        if logprobs:
            choice["logprobs"] = {"content": self._logprobs_content(c, logprobs)}
        if finish is not None:
            choice["stop_reason"] = stop_reason
        return choice
