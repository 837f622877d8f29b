"""``BadWords``: which tokens a request's bad words ban at its next step."""

from __future__ import annotations

from conveyor.runtime.engine.bad_words import BadWords


class Chars:
    """A tokenizer of one token per character (its code point)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


def test_a_word_is_banned_alone_and_after_a_space_within_the_output_only() -> None:
    words = BadWords.of(Chars(), ["  cat", "x"])
    assert words is not None
    a, c, t, x, space = (ord(ch) for ch in "actx ")
    prompt = [ord(ch) for ch in "the ca"]
    # "x" always; "cat"'s t after "ca" of the output, " cat"'s t after " ca"
    assert sorted(words.banned([*prompt, c, a], 2)) == sorted([x, t])
    assert words.banned([*prompt, space, c, a], 3).count(t) == 2  # both spellings end so
    assert words.banned(prompt, 0) == [x]  # "ca" was the prompt's, not the output's
    assert words.banned([*prompt, a], 1) == [x]  # only the "a" is output
    assert words.banned([*prompt, c, t], 2) == [x]


def test_words_that_tokenise_to_nothing_ban_nothing() -> None:
    class Empty:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return []

    assert BadWords.of(Empty(), ["word"]) is None
