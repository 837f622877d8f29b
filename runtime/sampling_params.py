"""Per-request sampling parameters, checked before a request enters the batch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TypeGuard

SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1
"""A signed 64-bit seed: torch's generators refuse more."""
LOGIT_BIAS_LIMIT = 100.0
"""OpenAI's bound on a logit bias."""
MAX_BAD_WORDS = 256
"""Most ``bad_words`` per request: each is looked up at every step of its request."""
MAX_BAD_WORD_CHARS = 1000
"""Longest of ``bad_words``: a word or phrase, not a document to tokenise."""


@dataclass(frozen=True)
class StructuredOutputParams:
    """What the output must match; exactly one field is set. Enforced by a grammar that
    masks the tokens which cannot continue a match (``engine/structured_output.py``)."""

    json: str | None = None
    """A JSON schema, serialised."""
    json_object: bool = False
    """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF grammar in xgrammar's dialect (GBNF-like), whose root rule is ``root``."""
    strict: bool = True
    """For ``json``: no properties beyond those the schema names, unless it allows more
    (OpenAI's ``strict``); False follows JSON Schema, where extra properties are allowed."""

    def validate(self) -> None:
        given = [
            name
            for name, value in (
                ("json", self.json),
                ("json_object", self.json_object or None),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise ValueError(
                "structured_output must set exactly one of json, json_object, regex, choice "
                f"and grammar, got {given or 'none'}"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(
                f"structured_output choice must be non-empty strings, got {self.choice!r}"
            )


@dataclass
class SamplingParams:
    """What to generate and how; names and meanings follow the OpenAI API and vLLM."""

    max_tokens: int = 16
    """Most tokens to generate (OpenAI's default for completions is 16)."""
    min_tokens: int = 0
    """EOS and stop token ids are ignored until this many tokens were generated."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0) keeps every token."""
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    """HF-style: > 1 discourages any token already in the prompt or output."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    """Makes a sampled request reproducible, whatever else is in the batch."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: the output is cut before the first one."""
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    """Return the sampled token's logprob and this many top alternatives (0..20)."""
    prompt_logprobs: int | None = None
    """Return each prompt token's logprob (given the tokens before it; None for the first)
    and this many top alternatives (0..20), as vLLM's. Such a prompt is computed whole,
    never read from the prefix cache."""
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Token id -> value added to its logit before sampling, in [-100, 100] as OpenAI has it
    (-100 all but bans the token, +100 all but forces it)."""
    structured_output: StructuredOutputParams | None = None
    """Constrain the output to a JSON schema, a regex, a choice or a grammar."""
    allowed_token_ids: list[int] | None = None
    """vLLM's: only these token ids may be generated (a classifier's labels, say)."""
    bad_words: list[str] = field(default_factory=list)
    """vLLM's: words not to generate, each as its tokens alone and after a space
    (``engine/bad_words.py``)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.bad_words = list(self.bad_words or [])
        self.validate()

    def validate(self) -> None:
        _int_at_least("max_tokens", self.max_tokens, 1)
        _int_at_least("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        _float_in("temperature", self.temperature, 0.0, None, "must be >= 0 (0 means greedy)")
        if not (_is_number(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(
                f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}"
            )
        _float_in("min_p", self.min_p, 0.0, 1.0, "must be in [0, 1]")
        if not (_is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0):
            raise ValueError(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}"
            )
        _float_in("presence_penalty", self.presence_penalty, -2.0, 2.0, "must be in [-2, 2]")
        _float_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "must be in [-2, 2]")
        if self.seed is not None and (
            not isinstance(self.seed, int)
            or isinstance(self.seed, bool)
            or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            raise ValueError(
                f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _int_at_least(name, value, 0)
                if value > 20:
                    raise ValueError(f"{name} must be in [0, 20], got {value}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}")
        if self.structured_output is not None:
            self.structured_output.validate()
            if self.ignore_eos or self.min_tokens:
                raise ValueError(
                    "structured_output cannot be combined with ignore_eos or min_tokens: the "
                    "grammar decides where the output ends"
                )
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise ValueError(
                f"bad_words holds {len(self.bad_words)} words; at most {MAX_BAD_WORDS} are taken"
            )
        for word in self.bad_words:
            if not isinstance(word, str) or not word.strip():
                raise ValueError(f"bad_words must be words (non-blank strings), got {word!r}")
            if len(word) > MAX_BAD_WORD_CHARS:
                raise ValueError(
                    f"bad_words holds a word of {len(word)} characters; at most "
                    f"{MAX_BAD_WORD_CHARS} each"
                )
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError(
                    "allowed_token_ids must list at least one token id (leave it out to allow "
                    "every token)"
                )
            for t in self.allowed_token_ids:
                _int_at_least("allowed_token_ids", t, 0)
        for t, bias in self.logit_bias.items():
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {t!r}")
            _float_in(
                "logit_bias",
                bias,
                -LOGIT_BIAS_LIMIT,
                LOGIT_BIAS_LIMIT,
                "values must be in [-100, 100]",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _is_number(x: object) -> TypeGuard[float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _int_at_least(name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _float_in(name: str, value: object, low: float, high: float | None, says: str) -> None:
    if not _is_number(value) or value < low or (high is not None and value > high):
        raise ValueError(f"{name} {says}, got {value!r}")
