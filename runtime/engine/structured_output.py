"""Grammars for constrained requests (JSON schema, regex, choice, EBNF), with xgrammar.

Compiling happens wherever the caller is (the server does it on a worker thread, never on
the engine thread) and is cached by the library, keyed by the grammar's text and options.
Matching happens on the engine thread: one matcher per request, advanced by each sampled
token; before a step samples, every constrained row gets a bitmask of the tokens that can
continue its match, and the sampler masks the others for the whole batch at once.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from conveyor.runtime.sampling_params import StructuredOutputParams

if TYPE_CHECKING:
    import xgrammar
    from transformers import PreTrainedTokenizerBase

    from conveyor.runtime.engine.sequence import Sequence

COMPILER_THREADS = 2
"""xgrammar's compiler threads per grammar: the runtime's machines share cores with the
engine, and a test schema compiles in milliseconds."""

GRAMMAR_CACHE_BYTES = 512 << 20
"""Compiled grammars kept for reuse, by schema; vLLM's default. Unbounded, a server fed
ever-new schemas would grow without end."""

ADMITTING_REMEMBERED = 4096
"""Specs ``compile`` remembers as checked, so that a schema sent again is not checked again."""

_LIBRARY_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
"""xgrammar's errors start with ``[time] file.cc:line: ``; users need only the reason."""


class GrammarError(ValueError):
    """The grammar cannot be compiled; the message names the construct."""


class StructuredOutputs:
    """The engine's grammars: a compiler (thread-safe) and the matchers of live requests."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._matchers: dict[str, _Match] = {}
        self._vocab: _VocabMasks | None = None  # built with the compiler
        self._admitting: OrderedDict[StructuredOutputParams, None] = OrderedDict()
        """Specs whose grammar was seen to admit a first token (``compile``), newest last."""

    # -- any thread --------------------------------------------------------------------

    def prepare(self) -> None:
        """Index the vocabulary for grammars now (a second on a 50k vocabulary), so the first
        constrained request does not wait for it; the server calls it once loaded."""
        self._get_compiler()

    def compile(self, spec: StructuredOutputParams) -> xgrammar.CompiledGrammar:
        """The compiled grammar of ``spec``; GrammarError saying what the library refused, or
        that it admits no output at all."""
        grammar = self._compile(spec)
        with self._lock:
            checked = spec in self._admitting
        if not checked:
            if not _admits_a_first_token(grammar):
                raise GrammarError(
                    "it admits no output at all (a schema that only refers to itself, or "
                    "whose constraints exclude every value); give one that some value matches"
                )
            with self._lock:
                self._admitting[spec] = None
                while len(self._admitting) > ADMITTING_REMEMBERED:
                    self._admitting.popitem(last=False)
        return grammar

    def _compile(self, spec: StructuredOutputParams) -> xgrammar.CompiledGrammar:
        try:
            compiler = self._get_compiler()
        except (ImportError, RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(
                f"structured outputs are not available on this server ({exc}); install "
                "xgrammar (the runtime extra has it) or use a tokenizer it reads"
            ) from exc
        try:
            if spec.json is not None:
                return compiler.compile_json_schema(
                    spec.json, any_whitespace=False, strict_mode=spec.strict
                )
            if spec.json_object:
                return compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False, strict_mode=False
                )
            if spec.regex is not None:
                return compiler.compile_regex(spec.regex)
            if spec.choice is not None:
                return compiler.compile_grammar(choice_grammar(spec.choice))
            assert spec.grammar is not None
            return compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            reason = _LIBRARY_PREFIX.sub("", str(exc)).strip()
            raise GrammarError(reason) from None

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        """Built on first use (or ``prepare``): the offline ``LLM`` and most benchmarks never
        need it, and importing xgrammar costs a second where transformers is not loaded yet."""
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer,
                    vocab_size=self._vocab_size,
                    stop_token_ids=self._stop_token_ids,
                )
                self._vocab = _VocabMasks.build(info.decoded_vocab)
                self._compiler = xgrammar.GrammarCompiler(
                    info, max_threads=COMPILER_THREADS, cache_limit_bytes=GRAMMAR_CACHE_BYTES
                )
            return self._compiler

    # -- the engine thread -------------------------------------------------------------

    def add(
        self, request_id: str, spec: StructuredOutputParams, grammar: xgrammar.CompiledGrammar
    ) -> None:
        import xgrammar

        is_json = spec.json is not None or spec.json_object
        self._matchers[request_id] = _Match(xgrammar.GrammarMatcher(grammar), is_json)

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance the request's matcher; False if the grammar does not allow ``token_id``."""
        match = self._matchers.get(request_id)
        if match is None:
            return True
        match.last_token = token_id
        return bool(match.matcher.accept_token(token_id))

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def bitmask(self, seqs: list[Sequence]) -> tuple[torch.Tensor, list[int]] | None:
        """(N, ceil(V / 32)) int32 on the CPU, bit ``t % 32`` of word ``t // 32`` set where
        token ``t`` may come next (every bit set for unconstrained rows), and the constrained
        rows. None if no row is constrained."""
        rows = [
            (i, m)
            for i, s in enumerate(seqs)
            if (m := self._matchers.get(s.request_id)) is not None
        ]
        if not rows:
            return None
        words = -(-self._vocab_size // 32)
        mask = torch.full((len(seqs), words), -1, dtype=torch.int32)  # (N, W)
        vocab = self._vocab
        assert vocab is not None
        for i, match in rows:
            match.matcher.fill_next_token_bitmask(mask, i)
            if match.is_json:
                mask[i] &= vocab.no_control_bytes
            if match.last_token in vocab.ends_in_surrogate_lead:
                mask[i] &= vocab.no_surrogate_tail
        return mask, [i for i, _ in rows]


@dataclass
class _Match:
    matcher: xgrammar.GrammarMatcher
    is_json: bool
    last_token: int | None = None


@dataclass(frozen=True)
class _VocabMasks:
    """Where xgrammar 0.2.8 lets through bytes that make the output invalid, per token.

    JSON never holds a raw byte below 0x20 (RFC 8259, and our JSON is compact), but the
    library lets length-bounded strings take them. And its character classes take the
    UTF-16 surrogates U+D800-U+DFFF, which are not UTF-8 (ED A0-BF xx): they decode to
    U+FFFD, so a string outgrows its maxLength. A token that ends in the lead byte ED is
    therefore never followed by one that starts with A0-BF.
    """

    no_control_bytes: torch.Tensor  # (W,) int32: bit set for tokens without a byte < 0x20
    no_surrogate_tail: torch.Tensor  # (W,) int32: bit set for tokens not starting A0-BF
    ends_in_surrogate_lead: frozenset[int]

    @classmethod
    def build(cls, decoded_vocab: list[bytes]) -> _VocabMasks:
        return cls(
            no_control_bytes=_pack([all(b >= 0x20 for b in t) for t in decoded_vocab]),
            no_surrogate_tail=_pack([not (t and 0xA0 <= t[0] <= 0xBF) for t in decoded_vocab]),
            ends_in_surrogate_lead=frozenset(
                i for i, t in enumerate(decoded_vocab) if t.endswith(b"\xed")
            ),
        )


def _admits_a_first_token(grammar: xgrammar.CompiledGrammar) -> bool:
    """Whether any token may start an output of ``grammar``. One whose language is empty
    (``{"$ref": "#"}``) masks every token at the first step, and the sampler then picks a
    token the grammar refuses: the request ended in an abort with that token as its text."""
    import xgrammar

    matcher = xgrammar.GrammarMatcher(grammar)
    mask = xgrammar.allocate_token_bitmask(1, grammar.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(mask, 0)
    return bool(mask.any())


def _pack(allowed: list[bool]) -> torch.Tensor:
    """Per-token booleans -> (ceil(V / 32),) int32 words, as xgrammar lays out its bitmasks."""
    words = -(-len(allowed) // 32)
    bits = torch.zeros(words * 32, dtype=torch.int64)
    bits[: len(allowed)] = torch.tensor(allowed, dtype=torch.int64)
    values = (bits.view(words, 32) << torch.arange(32)).sum(dim=1)  # (W,) in [0, 2^32)
    return torch.where(values >= 2**31, values - 2**32, values).to(torch.int32)


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF for "exactly one of these strings"; JSON string escapes are EBNF's too."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
