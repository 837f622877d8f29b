"""vLLM's ``bad_words``: words a request must not generate.

Each word is banned as the token sequences it tokenises to, on its own and after a space
(a word starts a text without one and follows another word with one). A word of one token
is banned at every step; a longer one only its last token, at a step whose output so far
ends with the tokens before it. So the word never appears as those tokens, and the output
may still hold its tokens apart or the word spelled by other tokens, as with vLLM.

vLLM 0.32 bans the spaced form only when it is as many tokens as the bare word: "Berlin"
is two tokens on SmolLM2 and " Berlin" one, so there "The capital of Germany is" still
ends " Berlin" with ``bad_words: ["Berlin"]``; here it does not.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Protocol


class Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass
class BadWords:
    """One request's bad words as token sequences, looked up by the output's last token."""

    always: list[int] = field(default_factory=list)
    """The last tokens of the one-token words: banned at every step."""
    after: dict[int, list[tuple[tuple[int, ...], int]]] = field(default_factory=dict)
    """A longer word's token before its last -> (the tokens before its last, its last)."""

    @classmethod
    def of(cls, tokenizer: Encoder, words: list[str]) -> BadWords | None:
        """The words' token sequences (None when none tokenises to anything)."""
        sequences: set[tuple[int, ...]] = set()
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(tokenizer.encode(text, add_special_tokens=False))
                if ids:
                    sequences.add(ids)
        if not sequences:
            return None
        out = cls()
        after: dict[int, list[tuple[tuple[int, ...], int]]] = defaultdict(list)
        for ids in sorted(sequences):
            if len(ids) == 1:
                out.always.append(ids[0])
            else:
                after[ids[-2]].append((ids[:-1], ids[-1]))
        out.after = dict(after)
        return out

    def banned(self, token_ids: list[int], num_output: int) -> list[int]:
        """The tokens banned at the next step of a sequence holding ``token_ids``, whose last
        ``num_output`` are its output (a word is matched within the output only)."""
        banned = list(self.always)
        if num_output and (candidates := self.after.get(token_ids[-1])):
            for before, last in candidates:
                n = len(before)
                if n <= num_output and tuple(token_ids[-n:]) == before:
                    banned.append(last)
        return banned
