"""``POST /v1/completions``: text in, text out (OpenAI's legacy completions API)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator
from functools import partial
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from conveyor.runtime.sampling_params import SamplingParams, StructuredOutputParams
from conveyor.runtime.server.choices import Choice, Delta, finite
from conveyor.runtime.server.context import ServerContext
from conveyor.runtime.server.errors import bad_request
from conveyor.runtime.server.protocol import CompletionRequest
from conveyor.runtime.server.serving_common import tokenize
from conveyor.runtime.server.serving_generate import GenerateRequest

DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for completions."""


async def create_completion(
    ctx: ServerContext, req: CompletionRequest, request: Request
) -> Response:
    return await Completion(ctx, req).create(request)


class Completion(GenerateRequest[CompletionRequest]):
    id_prefix = "cmpl"
    body_object = "text_completion"
    chunk_object = "text_completion"
    prompt_param = "prompt"

    def __init__(self, ctx: ServerContext, req: CompletionRequest) -> None:
        super().__init__(ctx, req)
        self._prompts: list[str | list[int]] = []
        self._logprobs: dict[int, dict[str, Any]] = {}
        """Per choice index: the logprobs collected for the response body."""

    def check(self) -> None:
        req = self.req
        if req.suffix:
            raise bad_request("suffix is not supported; remove it", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request(
                f"best_of must equal n ({req.n}) or be omitted; this server returns every "
                "choice it generates",
                param="best_of",
            )
        if req.echo and req.logprobs is not None and req.stream:
            raise bad_request(
                "echo with logprobs (the prompt's logprobs) is answered whole, not streamed; "
                "send stream: false, or drop echo or logprobs",
                param="echo",
            )

    async def prompts(self) -> AsyncGenerator[list[int], None]:
        self._prompts = _prompts(self.req.prompt)
        for prompt in self._prompts:
            if isinstance(prompt, str):
                encode = partial(
                    self.engine.encode_prompt,
                    prompt,
                    max_tokens=self.engine.max_model_len,
                    keep_last=self.keep,
                )
                yield await tokenize(self.ctx, encode, "prompt")
            else:
                yield list(prompt)

    def max_tokens(self) -> tuple[int | None, str]:
        return self.req.max_tokens, "max_tokens"

    def default_max_tokens(self) -> int:
        return DEFAULT_MAX_TOKENS

    def num_logprobs(self) -> int | None:
        return self.req.logprobs

    def sampling_params(
        self, prompt_len: int, structured: tuple[StructuredOutputParams, str] | None
    ) -> SamplingParams:
        """With ``echo`` and ``logprobs``, the prompt's logprobs too (what lm-evaluation-harness
        scores a continuation by)."""
        params = super().sampling_params(prompt_len, structured)
        if self.req.echo and self.req.logprobs is not None:
            wanted = max(self.req.logprobs, params.prompt_logprobs or 0)
            params = dataclasses.replace(params, prompt_logprobs=wanted)
        return params

    # -- the response ----------------------------------------------------------------------

    def _echo(self, choice: Choice) -> str:
        """The choice's prompt when the request asks for it back (``echo``), else nothing."""
        if not self.req.echo:
            return ""
        prompt = self._prompts[choice.prompt_index]
        if isinstance(prompt, str) and self.req.truncate_prompt_tokens is None:
            return prompt
        return self.engine.tokenizer.decode(choice.prompt_ids)  # what was run, truncated or not

    def _delta_logprobs(self, choice: Choice, delta: Delta) -> dict[str, Any]:
        tokens, token_logprobs, top, offsets = [], [], [], []
        offset = choice.emitted_len - len(delta.text)
        texts = self.output_logprob_texts(choice, delta.logprobs)
        for lp, (text, alternative_texts) in zip(delta.logprobs, texts, strict=True):
            tokens.append(text)
            token_logprobs.append(finite(lp.logprob))
            alternatives = {text: finite(lp.logprob)}
            for alt, (_, logprob) in zip(alternative_texts, lp.top, strict=True):
                alternatives.setdefault(alt, finite(logprob))
            top.append(alternatives)
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def absorb(self, choice: Choice, delta: Delta) -> None:
        if choice.want_logprobs and delta.logprobs:
            part = self._delta_logprobs(choice, delta)
            acc = self._logprobs.setdefault(choice.index, {k: [] for k in part})
            for k, v in part.items():
                acc[k].extend(v)

    def _prompt_logprobs(self, choice: Choice) -> dict[str, list[Any]]:
        """The echoed prompt's part of ``logprobs``: its tokens, their logprobs (null for the
        first, as OpenAI's), alternatives and offsets into the echoed text."""
        part: dict[str, list[Any]] = {
            "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []
        }  # fmt: skip
        offset = 0
        n = self.req.logprobs or 0
        prompt = choice.prompt_ids
        for i, (token_id, lp) in enumerate(zip(prompt, choice.prompt_logprobs or [], strict=False)):
            text = self.logprob_text(token_id, prompt, i)
            part["tokens"].append(text)
            part["text_offset"].append(offset)
            offset += len(text)
            if lp is None:
                part["token_logprobs"].append(None)
                part["top_logprobs"].append(None)
                continue
            part["token_logprobs"].append(finite(lp.logprob))
            alternatives = {text: finite(lp.logprob)}
            for alt_id, logprob in lp.top[:n]:
                alternatives.setdefault(self.logprob_text(alt_id, prompt, i), finite(logprob))
            part["top_logprobs"].append(alternatives)
        return part

    def choice_body(self, choice: Choice) -> dict[str, Any]:
        lp = None
        if choice.want_logprobs:
            lp = self._logprobs.get(
                choice.index,
                {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []},
            )
            if self.req.echo:  # the prompt's first, the generated text's offsets after it
                shift = len(self._echo(choice))
                prompt = self._prompt_logprobs(choice)
                lp = {
                    k: prompt[k] + ([o + shift for o in v] if k == "text_offset" else v)
                    for k, v in lp.items()
                }
        body = {
            "index": choice.index,
            "text": self._echo(choice) + choice.text,
            "logprobs": lp,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }
        if self.req.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.prompt_logprobs_body(choice)
        return body

    def first_chunks(self) -> list[dict[str, Any]]:
        if not self.req.echo:
            return []
        return [_chunk(c.index, self._echo(c), None, None) for c in self.choices]

    def chunk_choices(self, choice: Choice, delta: Delta) -> list[dict[str, Any]]:
        lp = self._delta_logprobs(choice, delta) if choice.want_logprobs else None
        finish = delta.finish_reason
        return [
            _chunk(choice.index, delta.text, lp, finish, choice.stop_reason if finish else None)
        ]


def _chunk(
    index: int,
    text: str,
    logprobs: dict[str, Any] | None,
    finish: str | None,
    stop_reason: str | int | None = None,
) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish,
        "stop_reason": stop_reason,
    }


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
