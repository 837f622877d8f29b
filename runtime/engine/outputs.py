"""What the engine hands back each step, and its counters. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.runtime.engine.sequence import TokenLogprob


@dataclass(kw_only=True)
class RequestTimeline:
    """When a request arrived, was first scheduled, got its first token and finished
    (monotonic seconds), and what the prefix cache and preemptions did to it on the way."""

    num_cached_tokens: int = 0
    num_preemptions: int = 0
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None


@dataclass
class RequestOutput(RequestTimeline):
    """A request's progress after one step: the new tokens and, at the end, why it ended."""

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    output_token_ids: list[int]
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """With ``SamplingParams.prompt_logprobs``, on the request's first output: each prompt
    token's logprob, None for the first."""
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class EngineStats:
    """A snapshot for /load and /metrics: gauges now, counters since start."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_total_blocks: int
    max_running_requests: int
    prompt_tokens: int
    generation_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int
    steps: int
    max_loras: int = 0
    """LoRA slots (0: LoRA is off)."""
    running_loras: tuple[str, ...] = ()
    """The adapters of running requests, and of waiting ones, by name."""
    waiting_loras: tuple[str, ...] = ()
