"""The request path of the generating endpoints, in the order a request takes it.

``GenerateRequest.create`` is the whole path of ``POST /v1/completions``,
``POST /v1/chat/completions`` and ``POST /v1/responses``: check the request, tokenise each
prompt, turn the request into ``SamplingParams`` (once: the engine and the sampler take them
as they are), make one ``Choice`` per generated choice (``choices.py``), submit them to the
engine, then stream or collect the engine's outputs. Each endpoint
(``serving_completions.py``, ``serving_chat.py``, and ``serving_responses.py`` on chat's)
is a subclass holding only what differs: its checks, its prompts, its ``max_tokens``, and
how it writes a choice in a response body and in a stream chunk.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from conveyor.runtime.engine.bad_words import BadWords
from conveyor.runtime.sampling_params import SamplingParams, StructuredOutputParams
from conveyor.runtime.server.choices import (
    Choice,
    Delta,
    choice_params,
    finite,
    run_choices,
    submit,
    usage,
)
from conveyor.runtime.server.context import ServerContext
from conveyor.runtime.server.engine_client import OutputStream
from conveyor.runtime.server.errors import (
    bad_request,
    from_value_error,
)
from conveyor.runtime.server.logprob_text import MAX_CONTEXT, REPLACEMENT, completed_text
from conveyor.runtime.server.protocol import GenerateRequestBody
from conveyor.runtime.server.serving_common import (
    EngineStreamingResponse,
    check_engine,
    check_model,
    new_id,
    sse,
    sse_stream,
    unless_disconnected,
)
from conveyor.runtime.server.structured_outputs import compile_grammar, structured_output

if TYPE_CHECKING:
    from conveyor.runtime.engine.llm_engine import LLMEngine
    from conveyor.runtime.engine.sequence import TokenLogprob

SAMPLING_PARAM_NAMES = {f.name for f in dataclasses.fields(SamplingParams)}

RequestT = TypeVar("RequestT", bound=GenerateRequestBody)


class GenerateRequest(ABC, Generic[RequestT]):
    """One API call of a generating endpoint, from its request body to its response."""

    id_prefix: ClassVar[str]
    """Of the response's ``id``: ``cmpl``, ``chatcmpl``."""
    body_object: ClassVar[str]
    """The response body's ``object``."""
    chunk_object: ClassVar[str]
    """A stream chunk's ``object``."""
    prompt_param: ClassVar[str]
    """The field a prompt the engine refuses is reported under."""

    def __init__(self, ctx: ServerContext, req: RequestT) -> None:
        self.ctx = ctx
        self.req = req
        self.request_id = new_id(self.id_prefix)
        self.choices: list[Choice] = []
        self.created = 0
        """When the choices were submitted (Unix seconds), as OpenAI reports it."""
        self.keep: int | None = None
        """The prompt's last tokens ``truncate_prompt_tokens`` keeps (``keep_tokens``)."""
        self.lora: str | None = None
        """The LoRA adapter the request's ``model`` names; None: the base model."""

    async def create(self, request: Request) -> Response:
        """The request's response: a JSON body, or a stream of Server-Sent Events."""
        arrival = time.monotonic()
        ctx, req = self.ctx, self.req
        self.lora = check_model(ctx, req.model)
        check_engine(ctx)
        if req.stream_options is not None and not req.stream:
            raise bad_request(
                "stream_options is only allowed with stream: true; set stream or remove it",
                param="stream_options",
            )
        self.check()
        self.keep = self.keep_tokens()  # out of range: a 400 before any tokenising
        if req.stream and req.prompt_logprobs is not None:
            raise bad_request(
                "prompt_logprobs are answered whole, not streamed (as vLLM's); set stream to "
                "false or remove prompt_logprobs",
                param="prompt_logprobs",
            )
        check_priority(ctx, req.priority)
        structured = self.structured_output()
        async with aclosing(self.prompts()) as prompts:
            async for whole in prompts:
                prompt_ids = self.truncated(whole)
                params = self.sampling_params(len(prompt_ids), structured)
                check_prompt(ctx, prompt_ids, params, self.prompt_param)
                self._add_choices(prompt_ids, params)
        grammar = await compile_grammar(ctx, *structured) if structured else None
        words = self.choices[0].params.bad_words if self.choices else None
        bad_words = await tokenize_bad_words(ctx, words) if words else None
        stream = submit(
            ctx, self.choices, arrival, grammar, req.priority, req.cache_salt, bad_words, self.lora
        )

        self.created = int(time.time())
        if req.stream:
            return self.streaming_response(stream)
        body = await unless_disconnected(request, self._collect(stream), stream)
        return JSONResponse(body)

    def streaming_response(self, stream: OutputStream) -> Response:
        """The stream of chunks, as OpenAI's completions and chat completions send it."""
        options = self.req.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and bool(options and options.continuous_usage_stats)
        return EngineStreamingResponse(
            sse_stream(self._stream(include_usage, stream, continuous)), stream
        )

    # -- what each endpoint says -----------------------------------------------------------

    def check(self) -> None:
        """Refuse what this endpoint does not support (400), before any tokenising."""

    def structured_output(self) -> tuple[StructuredOutputParams, str] | None:
        """The constraint on the output and the field it came in, if any."""
        return structured_output(self.req)

    @abstractmethod
    def prompts(self) -> AsyncGenerator[list[int], None]:
        """Each prompt's token ids, in order; the next one is tokenised only once the one
        before was checked."""

    @abstractmethod
    def max_tokens(self) -> tuple[int | None, str]:
        """The requested most tokens to generate (None: the default) and its field's name."""

    @abstractmethod
    def default_max_tokens(self) -> int:
        """Most tokens to generate when the request names none (the context caps it too)."""

    @abstractmethod
    def num_logprobs(self) -> int | None:
        """Top alternatives to report with each token's logprob; None: no logprobs."""

    def absorb(self, choice: Choice, delta: Delta) -> None:
        """Take note of ``delta`` while a response body is being collected."""

    @abstractmethod
    def choice_body(self, choice: Choice) -> dict[str, Any]:
        """A finished choice, as the response body lists it."""

    def first_chunks(self) -> list[dict[str, Any]]:
        """Chunk choices streamed before any output."""
        return []

    @abstractmethod
    def chunk_choices(self, choice: Choice, delta: Delta) -> list[dict[str, Any]]:
        """The chunk choices that stream ``delta`` (one chunk each)."""

    # -- the shared steps ------------------------------------------------------------------

    @property
    def engine(self) -> LLMEngine:
        engine = self.ctx.client.engine
        assert engine is not None  # check_engine() refused the request otherwise
        return engine

    def keep_tokens(self) -> int | None:
        """How many of the prompt's last tokens ``truncate_prompt_tokens`` keeps (vLLM's; -1:
        as many as the context holds beside the ``max_tokens`` asked for, or one token);
        None without it."""
        keep = self.req.truncate_prompt_tokens
        if keep is None:
            return None
        limit = self.engine.max_model_len
        if keep == -1:
            asked, _ = self.max_tokens()
            return max(1, limit - max(1, asked or 1))
        if not 1 <= keep <= limit:
            raise bad_request(
                f"truncate_prompt_tokens must be -1 (as much as the context holds) or from 1 "
                f"to this model's context length, {limit} tokens; got {keep}",
                param="truncate_prompt_tokens",
            )
        return keep

    def truncated(self, prompt_ids: list[int]) -> list[int]:
        """The prompt's last ``truncate_prompt_tokens`` tokens; all of it without."""
        return prompt_ids if self.keep is None else prompt_ids[-self.keep :]

    def sampling_params(
        self, prompt_len: int, structured: tuple[StructuredOutputParams, str] | None
    ) -> SamplingParams:
        """The request's ``SamplingParams`` for a prompt of ``prompt_len`` tokens; 400 naming
        the field at fault."""
        asked, param = self.max_tokens()
        max_model_len = self.engine.max_model_len
        room = max_model_len - prompt_len
        model_default = self.engine.default_sampling.get("max_tokens")
        if asked is None:
            max_tokens = max(1, min(model_default or self.default_max_tokens(), room))
        else:
            max_tokens = asked
            if asked >= 1 and model_default and self.engine.generation_config_given:
                # A generation config given by --generation-config also caps what a request
                # asks for (vLLM's override_max_tokens); the model's own is only a default.
                max_tokens = min(asked, model_default)
        if asked is not None and max_tokens >= 1 and room < 1:
            # The prompt alone fills the context: no max_tokens fits, so the prompt is at fault.
            raise bad_request(
                f"this model's context length is {max_model_len} tokens, but the prompt is "
                f"{prompt_len} tokens and {param} is {max_tokens}; shorten the prompt to at "
                f"most {max_model_len - min(max_tokens, max_model_len - 1)} tokens",
                param=self.prompt_param,
                code="context_length_exceeded",
            )
        if asked is not None and max_tokens >= 1 and max_tokens > room:
            raise bad_request(
                f"this model's context length is {max_model_len} tokens, but the prompt is "
                f"{prompt_len} tokens and {param} is {max_tokens}; lower {param} to at most "
                f"{max(room, 0)} or shorten the prompt",
                param=param,
                code="context_length_exceeded",
            )
        try:
            return self.req.to_sampling_params(
                max_tokens=max_tokens,
                logprobs=self.num_logprobs(),
                structured_output=structured[0] if structured else None,
                defaults=self.engine.default_sampling,
                prompt_logprobs=self.req.prompt_logprobs,
            )
        except ValueError as exc:
            err = from_value_error(exc, SAMPLING_PARAM_NAMES)
            if err.param == "max_tokens":
                err.param = param
                err.message = err.message.replace("max_tokens", param, 1)
            if err.param == "structured_output" and structured:
                err.param = structured[1]
                err.message = err.message.replace("structured_output", structured[1], 1)
            raise err from None

    def _add_choices(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The ``n`` choices of the next prompt."""
        n = self.req.n
        prompt_index = len(self.choices) // n
        for i in range(n):
            index = prompt_index * n + i
            self.choices.append(
                Choice(
                    self.ctx,
                    index,
                    f"{self.request_id}-{index}",
                    prompt_ids,
                    choice_params(params, i),
                    prompt_index,
                )
            )

    def token_text(self, token_id: int) -> str:
        """One token's text alone (cached for the server's lifetime)."""
        text = self.ctx.token_text.get(token_id)
        if text is None:
            text = self.engine.tokenizer.decode([token_id])
            self.ctx.token_text[token_id] = text
        return text

    def output_logprob_texts(
        self, choice: Choice, logprobs: Sequence[TokenLogprob]
    ) -> list[tuple[str, list[str]]]:
        """For ``logprobs``, the tail of the choice's output's: each sampled token's text and
        its alternatives' (``logprob_text``), read after the output's tokens before it."""
        start = len(choice.logprobs) - len(logprobs)
        sampled = [lp.token_id for lp in choice.logprobs[max(0, start - MAX_CONTEXT) :]]
        texts = []
        for i, lp in enumerate(logprobs):
            at = min(start, MAX_CONTEXT) + i  # this token's place in ``sampled``
            alternatives = [self.logprob_text(token_id, sampled, at) for token_id, _ in lp.top]
            texts.append((self.logprob_text(lp.token_id, sampled, at), alternatives))
        return texts

    def logprob_text(self, token_id: int, sampled: Sequence[int], position: int) -> str:
        """A candidate token as logprobs name it at ``position`` of the tokens ``sampled``
        (the prompt's, or the output's): ``token_id:ID`` when the request asks for ids
        (``return_tokens_as_token_ids``), else its ``decoded_token``."""
        as_ids = self.req.return_tokens_as_token_ids
        if as_ids if as_ids is not None else self.ctx.settings.return_tokens_as_token_ids:
            return f"token_id:{token_id}"
        return self.decoded_token(token_id, sampled, position)

    def decoded_token(self, token_id: int, sampled: Sequence[int], position: int) -> str:
        """A candidate token's text at ``position`` of ``sampled``: its own, or, for a byte
        of a UTF-8 character, what it completes after the tokens before it
        (``logprob_text.py``, as vLLM reports it)."""
        text = self.token_text(token_id)
        if not text.endswith(REPLACEMENT):
            return text
        before = sampled[max(0, position - MAX_CONTEXT) : position]
        return completed_text(self.engine.tokenizer.decode, token_id, before)

    @property
    def model_name(self) -> str:
        """The name answers carry: the adapter's, or the base model's."""
        return self.lora or self.ctx.model_name

    def _head(self, object_: str) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": object_,
            "created": self.created,
            "model": self.model_name,
        }

    def prompt_logprobs_body(self, choice: Choice) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's ``prompt_logprobs`` of a choice's prompt: null for the first token, then for
        each a map from token id to its logprob, rank and text, for the prompt's own token and
        the ``prompt_logprobs`` likeliest ones."""
        n = self.req.prompt_logprobs or 0
        out: list[dict[str, dict[str, Any]] | None] = []
        prompt = choice.prompt_ids
        for i, (token_id, lp) in enumerate(zip(prompt, choice.prompt_logprobs or [], strict=False)):
            if lp is None:
                out.append(None)
                continue
            entry = {
                str(token_id): {
                    "logprob": finite(lp.logprob),
                    "rank": lp.rank,
                    "decoded_token": self.decoded_token(token_id, prompt, i),
                }
            }
            for rank, (alt_id, logprob) in enumerate(lp.top[:n], start=1):
                entry.setdefault(
                    str(alt_id),
                    {
                        "logprob": finite(logprob),
                        "rank": rank,
                        "decoded_token": self.decoded_token(alt_id, prompt, i),
                    },
                )
            out.append(entry)
        return out

    def body_extras(self) -> dict[str, Any]:
        """Fields of the whole response besides its choices and usage."""
        return {}

    async def _collect(self, stream: OutputStream) -> dict[str, Any]:
        async for choice, delta in run_choices(self.ctx, self.choices, stream):
            self.absorb(choice, delta)
        return {
            **self._head(self.body_object),
            "choices": [self.choice_body(c) for c in self.choices],
            "usage": usage(self.choices),
            **self.body_extras(),
        }

    async def _stream(
        self, include_usage: bool, stream: OutputStream, continuous: bool = False
    ) -> AsyncGenerator[str, None]:
        """``include_usage``: a last chunk with the usage (``null`` in the others, as OpenAI
        has it); ``continuous``: every chunk with the usage so far (vLLM's
        ``continuous_usage_stats``)."""
        head = self._head(self.chunk_object)
        extra: dict[str, Any] = {"usage": None} if include_usage else {}
        for part in self.first_chunks():
            if continuous:
                extra = {"usage": usage(self.choices)}
            yield sse({**head, "choices": [part], **extra})
        async for choice, delta in run_choices(self.ctx, self.choices, stream):
            if continuous:
                extra = {"usage": usage(self.choices)}
            for part in self.chunk_choices(choice, delta):
                yield sse({**head, "choices": [part], **extra})
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(self.choices)})


def check_prompt(
    ctx: ServerContext, prompt_ids: list[int], params: SamplingParams, param: str
) -> None:
    """What the engine would refuse, as a 400 naming the field at fault."""
    assert ctx.client.engine is not None
    try:
        ctx.client.engine.check_request(prompt_ids, params)
    except ValueError as exc:
        code = "context_length_exceeded" if "context length" in str(exc) else None
        named = str(exc).split(" ", 1)[0]
        param = named if named in SAMPLING_PARAM_NAMES else param
        raise bad_request(str(exc), param=param, code=code) from None


async def tokenize_bad_words(ctx: ServerContext, words: list[str]) -> BadWords | None:
    """``bad_words`` as token sequences, made on the tokenizer pool (not the engine's
    thread, whose every request would wait for it)."""
    assert ctx.client.engine is not None
    tokenizer = ctx.client.engine.tokenizer
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(ctx.tokenize_pool, BadWords.of, tokenizer, words)


def check_priority(ctx: ServerContext, priority: int) -> None:
    """A priority the server's scheduling policy does not read: a 400, not ignored."""
    assert ctx.client.engine is not None
    try:
        ctx.client.engine.check_priority(priority)
    except ValueError as exc:
        raise bad_request(str(exc), param="priority") from None
