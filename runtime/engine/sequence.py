"""One request's state in the engine: its tokens, its KV blocks, its timings. No torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from conveyor.runtime.engine.bad_words import BadWords
from conveyor.runtime.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # the client went away, or a stop string was found downstream


@dataclass
class TokenLogprob:
    """The sampled token's logprob and the top alternatives, as OpenAI reports them."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None
    """1 + how many tokens were likelier (a prompt token's; vLLM reports it)."""


@dataclass(eq=False)
class Sequence:
    """A request inside the engine.

    ``num_computed_tokens`` counts the tokens whose keys and values are in the
    KV cache (found in the prefix cache or computed). The next step computes
    ``token_ids[num_computed_tokens:]``, or a chunk of them.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    """Lower is scheduled sooner under ``--scheduling-policy priority`` (vLLM's meaning)."""
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    """Prompt tokens found in the prefix cache at the first admission."""
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended it, as vLLM reports it."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    """With ``params.prompt_logprobs``: prompt token i's logprob at index i (None for the
    first), filled in as the prompt's chunks are computed."""
    bad_words: BadWords | None = field(default=None, repr=False)
    """``params.bad_words`` as token sequences (``bad_words.py``)."""
    cache_salt: str | None = field(default=None, repr=False)
    """Its blocks are found in and shared through the prefix cache only by requests with the
    same salt (vLLM's ``cache_salt``): it seeds the chain of block hashes."""
    lora_slot: int = -1
    """The device slot of the LoRA adapter it runs with (``layers/lora.py``); -1: none."""
    lora_key: str | None = field(default=None, repr=False)
    """Its adapter's name and load, which seeds the chain of block hashes with the salt: an
    adapter's KV differs from the base model's for the same tokens."""
    prefix_hashes: list[bytes] = field(default_factory=list, repr=False)
    """Chained hashes of the first full blocks of ``token_ids``, as far as prefix-cache
    lookups have needed them (the ids are only ever appended to, so these never change)."""

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]
