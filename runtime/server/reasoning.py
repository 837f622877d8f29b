"""A reasoning model's thinking, apart from its answer (vLLM's ``--reasoning-parser``).

Qwen3 and DeepSeek-R1 (and its distilled Qwen2 and Llama models) think first, between
``<think>`` and ``</think>``, then answer. With ``--reasoning-parser``, a chat completion
gives the thinking as ``reasoning_content`` and only the answer as ``content`` (the field
vLLM and DeepSeek's API use), whole or streamed; tool calls are read from the answer only.

- ``qwen3``: the model opens ``<think>`` itself. Output without ``</think>`` is all answer
  (thinking turned off with ``chat_template_kwargs: {"enable_thinking": false}``, whose
  template closes an empty ``<think></think>`` in the prompt).
- ``deepseek_r1``: the chat template opens ``<think>`` in the prompt, so the output starts
  inside the thinking: everything before ``</think>`` is reasoning, and output without it
  (cut off by ``max_tokens``) is all reasoning. A ``<think>`` the model writes anyway is
  dropped.

Both read text, so the tags must survive detokenisation: they are ordinary added tokens in
these models' tokenizers, not special ones that ``skip_special_tokens`` removes.
"""

from __future__ import annotations

START, END = "<think>", "</think>"

REASONING_PARSERS = ("qwen3", "deepseek_r1")
"""``--reasoning-parser``'s choices."""


class ReasoningParser:
    def __init__(self, name: str) -> None:
        if name not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {name!r}"
            )
        self.name = name
        self.opens_in_prompt = name == "deepseek_r1"

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole output -> (reasoning, answer); None for a part that is not there."""
        body = text.removeprefix(START) if self.opens_in_prompt or text.startswith(START) else None
        if body is None or END not in body:
            if self.opens_in_prompt and body is not None:
                return body, None  # still thinking when it stopped
            return None, text
        reasoning, _, answer = body.partition(END)
        return reasoning, answer or None


class ReasoningStream:
    """One streamed choice: each new piece of text -> (reasoning delta, answer delta).

    Text that may be the start of a tag (``<thi``) is held back until the next piece says
    whether it is one, so that a tag never leaks into either field."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.pending = ""
        """Text not yet given out (a possible tag's start)."""
        self.state = "reasoning" if parser.opens_in_prompt else "start"
        """``start`` (may open with <think>), ``reasoning`` or ``answer``."""

    def update(self, new_text: str, finished: bool) -> tuple[str, str]:
        text = self.pending + new_text
        self.pending = ""
        reasoning = answer = ""
        while text:
            if self.state == "start":
                if text.startswith(START):
                    text, self.state = text[len(START) :], "reasoning"
                elif START.startswith(text) and not finished:
                    self.pending, text = text, ""
                else:
                    self.state = "answer"
            elif self.state == "reasoning":
                if self.parser.opens_in_prompt and text.startswith(START):
                    text = text[len(START) :]  # written again by the model: not thinking
                    continue
                i = text.find(END)
                if i >= 0:
                    reasoning += text[:i]
                    text, self.state = text[i + len(END) :], "answer"
                    continue
                keep = 0 if finished else _tag_prefix(text, (END, START))
                reasoning += text[: len(text) - keep]
                self.pending, text = text[len(text) - keep :], ""
            else:
                answer += text
                text = ""
        return reasoning, answer


def _tag_prefix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that begins one of ``tags``."""
    for n in range(min(len(text), max(len(t) for t in tags) - 1), 0, -1):
        if any(t.startswith(text[-n:]) for t in tags):
            return n
    return 0
