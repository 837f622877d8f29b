"""A token's text in logprobs, where a UTF-8 character spans several tokens.

A byte-level or byte-fallback tokenizer splits a multi-byte character (an emoji, a CJK
character, a curly quote) over tokens that each decode alone to U+FFFD. vLLM reports such a
token by what it adds to the text: ``""`` while the character is still unfinished, and the
whole character at the token that completes it, decoded with the sampled tokens before it
as context. Alternatives at the same position are read against the same context (never
against one another). Conveyor reports them the same way, so that a client's token strings
join into the text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"

MAX_CONTEXT = 4
"""A UTF-8 character has at most 4 bytes: 4 tokens before a byte always hold its start."""


def completed_text(decode: Callable[[list[int]], str], token_id: int, before: Sequence[int]) -> str:
    """What ``token_id``, whose own text ends in U+FFFD, adds to the text after the sampled
    tokens ``before`` (oldest first): the character it completes, with the bytes of it that
    earlier tokens carried (each of which reported ``""``), or ``""`` while unfinished."""
    before = list(before[-MAX_CONTEXT:])
    for n in range(1, len(before) + 1):
        context = before[-n:]
        full = decode([*context, token_id])
        if full.endswith(REPLACEMENT):
            continue  # the character started further back, or is still unfinished
        # The context's trailing bytes of this same character reported "" themselves: their
        # text belongs to this token, so the prefix to strip stops before them.
        clean = len(context)
        while clean and decode([context[clean - 1]]).endswith(REPLACEMENT):
            clean -= 1
        prefix = decode(context[:clean]) if clean else ""
        shared = (i for i, (a, b) in enumerate(zip(prefix, full, strict=False)) if a != b)
        return full[next(shared, min(len(prefix), len(full))) :]
    return ""
