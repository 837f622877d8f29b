"""A reasoning model's thinking, apart from its answer (vLLM's ``--reasoning-parser``).

Qwen3 and DeepSeek-R1 (and its distilled Qwen2 and Llama models) think first, between
``<think>`` and ``</think>``, then answer; Seed-OSS between ``<seed:think>`` and
``</seed:think>``. With ``--reasoning-parser``, a chat completion
gives the thinking as ``reasoning_content`` and only the answer as ``content`` (the field
vLLM and DeepSeek's API use), whole or streamed; tool calls are read from the answer only.

- ``qwen3``: the model opens ``<think>`` itself. Output without ``</think>`` is all answer
  (thinking turned off with ``chat_template_kwargs: {"enable_thinking": false}``, whose
  template closes an empty ``<think></think>`` in the prompt).
- ``deepseek_r1``: the chat template opens ``<think>`` in the prompt, so the output starts
  inside the thinking: everything before ``</think>`` is reasoning, and output without it
  (cut off by ``max_tokens``) is all reasoning. A ``<think>`` the model writes anyway is
  dropped.
- ``seed_oss``: Seed-OSS's tags, read as ``deepseek_r1`` reads its own (vLLM's): the model
  opens ``<seed:think>`` itself, but output without ``</seed:think>`` is all reasoning, and
  its thinking budget's reflections (``<seed:cot_budget_reflect>``) stay in it.

Both read text, so the tags must survive detokenisation: they are ordinary added tokens in
these models' tokenizers, not special ones that ``skip_special_tokens`` removes.
"""

from __future__ import annotations

PARSERS: dict[str, tuple[str, str, bool]] = {
    "qwen3": ("<think>", "</think>", False),
    "deepseek_r1": ("<think>", "</think>", True),
    "seed_oss": ("<seed:think>", "</seed:think>", True),
}
"""name -> (the tag that opens the thinking, the one that closes it, whether output is
thinking until the closing tag: opened in the prompt, or read as if it were)."""

REASONING_PARSERS = tuple(PARSERS)
"""``--reasoning-parser``'s choices."""


class ReasoningParser:
    def __init__(self, name: str) -> None:
        if name not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {name!r}"
            )
        self.name = name
        self.start, self.end, self.opens_in_prompt = PARSERS[name]

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole output -> (reasoning, answer); None for a part that is not there."""
        start, end = self.start, self.end
        body = text.removeprefix(start) if self.opens_in_prompt or text.startswith(start) else None
        if body is None or end not in body:
            if self.opens_in_prompt and body is not None:
                return body, None  # still thinking when it stopped
            return None, text
        reasoning, _, answer = body.partition(end)
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
        start, end = self.parser.start, self.parser.end
        text = self.pending + new_text
        self.pending = ""
        reasoning = answer = ""
        while text:
            if self.state == "start":
                if text.startswith(start):
                    text, self.state = text[len(start) :], "reasoning"
                elif start.startswith(text) and not finished:
                    self.pending, text = text, ""
                else:
                    self.state = "answer"
            elif self.state == "reasoning":
                if self.parser.opens_in_prompt and text.startswith(start):
                    text = text[len(start) :]  # written again by the model: not thinking
                    continue
                i = text.find(end)
                if i >= 0:
                    reasoning += text[:i]
                    text, self.state = text[i + len(end) :], "answer"
                    continue
                keep = 0 if finished else _tag_prefix(text, (end, start))
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
