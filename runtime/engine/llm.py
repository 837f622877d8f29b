"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from conveyor.runtime.detokenizer import IncrementalDetokenizer
from conveyor.runtime.engine.llm_engine import LLMEngine
from conveyor.runtime.engine.outputs import RequestOutput, RequestTimeline
from conveyor.runtime.engine.sequence import TokenLogprob
from conveyor.runtime.engine.settings import EngineSettings
from conveyor.runtime.sampling_params import SamplingParams


@dataclass
class GenerationResult(RequestTimeline):
    """One prompt's result: text, token ids, why it ended, and when things happened."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        if self.finish_time is None or self.first_token_time is None or len(self.token_ids) < 2:
            return None
        return (self.finish_time - self.first_token_time) / (len(self.token_ids) - 1)


class LLM:
    """Generate for a list of prompts with continuous batching, offline (no server)."""

    def __init__(self, model: str = EngineSettings.model, **settings: object):
        """``settings``: any ``EngineSettings`` field, e.g. ``tensor_parallel_size=2``."""
        self.engine = LLMEngine(EngineSettings(model=model, **settings))  # type: ignore[arg-type]
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's tensor-parallel ranks, if any (they also end with this process)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> LLM:
        return cls(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)})

    def generate(
        self,
        prompts: str | list[int] | Seq[str | list[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        priority: Seq[int] | None = None,
        lora: str | Seq[str | None] | None = None,
    ) -> list[GenerationResult]:
        """Every prompt is checked before any enters the batch; results keep the prompts' order.
        ``priority``: one per prompt, lower runs sooner (with ``scheduling_policy="priority"``).
        ``lora``: the name of a LoRA adapter of ``lora_modules`` for all prompts, or one per
        prompt (None: the base model)."""
        prompt_list = _prompt_list(prompts)
        loras = [lora] * len(prompt_list) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(prompt_list):
            raise ValueError(f"got {len(prompt_list)} prompts but {len(loras)} lora names")
        priorities = [0] * len(prompt_list) if priority is None else list(priority)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"got {len(prompt_list)} prompts but {len(priorities)} priorities")
        if sampling_params is None:  # the model's defaults, as vLLM's LLM takes them
            sampling_params = SamplingParams(**self.engine.default_sampling)
        params = (
            [sampling_params] * len(prompt_list)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompt_list):
            raise ValueError(f"got {len(prompt_list)} prompts but {len(params)} sampling params")
        for name in {n for n in loras if n is not None}:
            self.engine.check_lora(name)
        encoded = [self.engine.encode_prompt(p) for p in prompt_list]
        for i, (ids, p, pri) in enumerate(zip(encoded, params, priorities, strict=True)):
            try:
                self.engine.check_request(ids, p, pri)
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}") from None
        grammars = [
            self.engine.structured_outputs.compile(p.structured_output)
            if p.structured_output is not None
            else None
            for p in params
        ]
        request_ids = [f"offline-{next(self._ids)}" for _ in prompt_list]
        detoks = {
            rid: IncrementalDetokenizer(self.tokenizer, p)
            for rid, p in zip(request_ids, params, strict=True)
        }
        for rid, ids, p, g, pri, name in zip(
            request_ids, encoded, params, grammars, priorities, loras, strict=True
        ):
            self.engine.add_request(rid, ids, p, grammar=g, priority=pri, lora=name)
        finals: dict[str, RequestOutput] = {}
        logprobs: dict[str, list[TokenLogprob]] = {rid: [] for rid in request_ids}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.request_id in finals:
                    continue  # the engine's echo of a stop-string abort
                logprobs[out.request_id] += out.new_logprobs
                det = detoks[out.request_id]
                det.update(out.new_token_ids)
                if det.stopped_by is not None and not out.finished:
                    self.engine.abort_request(out.request_id)
                    out.finished, out.finish_reason, out.stop_reason = True, "stop", det.stopped_by
                if out.finished:
                    finals[out.request_id] = out
        return [self._result(finals[rid], detoks[rid], logprobs[rid]) for rid in request_ids]

    @staticmethod
    def _result(
        out: RequestOutput, det: IncrementalDetokenizer, logprobs: list[TokenLogprob]
    ) -> GenerationResult:
        det.flush()
        token_ids = out.output_token_ids
        return GenerationResult(
            request_id=out.request_id,
            prompt_token_ids=out.prompt_token_ids,
            text=det.text,
            token_ids=token_ids,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            logprobs=logprobs,
            num_cached_tokens=out.num_cached_tokens,
            num_preemptions=out.num_preemptions,
            arrival_time=out.arrival_time,
            first_scheduled_time=out.first_scheduled_time,
            first_token_time=out.first_token_time,
            finish_time=out.finish_time,
        )


def _prompt_list(prompts: str | list[int] | Seq[str | list[int]]) -> list[str | list[int]]:
    """One prompt (text or token ids) or a sequence of them, as a list of prompts."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]
