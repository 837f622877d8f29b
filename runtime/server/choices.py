"""One choice of a generated response, from its submission to its last delta: its engine
request and incremental detokeniser (``Choice``), what each engine output adds to it
(``Delta``), admission to the engine (``submit``), the loop that reads the engine's outputs
(``run_choices``), and OpenAI's ``usage`` of them. Each endpoint's request path
(``serving_generate.py``) makes the choices and writes what they said in its own shape.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from conveyor.runtime.detokenizer import IncrementalDetokenizer
from conveyor.runtime.engine.settings import AdapterError
from conveyor.runtime.sampling_params import SEED_MIN, SamplingParams
from conveyor.runtime.server.context import ServerContext
from conveyor.runtime.server.engine_client import EngineDeadError, EngineRequest, OutputStream
from conveyor.runtime.server.errors import INTERNAL, NOT_FOUND, UNAVAILABLE, APIError
from conveyor.runtime.server.serving_common import check_queue

if TYPE_CHECKING:
    import xgrammar

    from conveyor.runtime.engine.bad_words import BadWords
    from conveyor.runtime.engine.outputs import RequestOutput
    from conveyor.runtime.engine.sequence import TokenLogprob

MIN_LOGPROB = -9999.0
"""-inf is not JSON; OpenAI clients expect a finite number."""


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The ``index``-th of ``n`` choices: distinct but reproducible when a seed is given."""
    if params.seed is None or index == 0:
        return params
    seed = (params.seed + index - SEED_MIN) % 2**64 + SEED_MIN  # wraps within 64 bits
    return dataclasses.replace(params, seed=seed)


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
        self._detok = IncrementalDetokenizer(ctx.client.engine.tokenizer, params)
        self._observe = ctx.metrics.detokenize.observe
        self.emitted_len = 0
        """Characters of text handed out so far."""
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        """With ``params.prompt_logprobs``: each prompt token's (None for the first)."""
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
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.finish_reason = finish
        return Delta(text, len(out.new_token_ids), logprobs, finish)


def submit(
    ctx: ServerContext,
    choices: list[Choice],
    arrival: float,
    grammar: xgrammar.CompiledGrammar | None = None,
    priority: int = 0,
    cache_salt: str | None = None,
    bad_words: BadWords | None = None,
    lora: str | None = None,
) -> OutputStream:
    """Admit the choices (429 above the queue bound) and hand them to the engine, with no
    ``await`` in between, so concurrent requests cannot all pass the same check.
    ``grammar``: the choices' compiled structured output, if they have one; ``bad_words``
    their ``bad_words`` as tokens; ``lora``: the LoRA adapter they run with."""
    check_queue(ctx, len(choices))
    if lora is not None and lora not in ctx.loras:  # unloaded while the prompt was tokenised
        raise APIError(
            NOT_FOUND, f"LoRA adapter {lora!r} is not loaded", param="model", code="model_not_found"
        )
    try:
        return ctx.client.submit(
            [
                EngineRequest(
                    c.request_id,
                    c.prompt_ids,
                    c.params,
                    arrival,
                    grammar,
                    priority,
                    cache_salt,
                    bad_words,
                    lora,
                )
                for c in choices
            ]
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
    except AdapterError as exc:  # unloaded between the request's check and the engine
        raise APIError(NOT_FOUND, str(exc), param="model", code="model_not_found") from exc
    finally:
        stream.close()


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


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB
