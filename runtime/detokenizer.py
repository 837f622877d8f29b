"""Incremental detokenisation with stop strings, where the engine's outputs are read.

The engine hands back token ids only. Their text is made by whoever reads its outputs: the
HTTP server on its event loop, one detokeniser per choice (``server/choices.py``),
and the offline ``LLM`` between steps; never inside a step. Torch-free.

Text is produced from token ids as they arrive (the ``tokenizers`` library's
``DecodeStream`` keeps multi-byte characters whole). Stop strings are searched
in the text; the part of the text that could still turn out to be the start of
a stop string is held back, so a client never sees text that is then retracted.
"""

from __future__ import annotations

from typing import Any

from conveyor.runtime.sampling_params import SamplingParams


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = getattr(tokenizer, "backend_tokenizer", None) or tokenizer._tokenizer
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self._stops = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        self._holdback = max((len(s) for s in self._stops), default=1) - 1
        self.text = ""  # everything decoded so far (cut at a stop string once found)
        self._emitted = 0  # how much of ``text`` was already returned
        self.stopped_by: str | None = None

    def update(self, new_token_ids: list[int]) -> str:
        """Decode ``new_token_ids``; return the text that can be emitted now."""
        if self.stopped_by is not None:
            return ""
        searched_from = max(0, len(self.text) - self._holdback)
        for token_id in new_token_ids:
            piece = self._stream.step(self._backend, token_id)
            if piece:
                self.text += piece
        if self._stops and self._find_stop(searched_from):
            return self._emit(len(self.text))
        return self._emit(len(self.text) - self._holdback if self._stops else len(self.text))

    def flush(self) -> str:
        """At the end of the request: everything not emitted yet."""
        return self._emit(len(self.text))

    def _find_stop(self, start: int) -> bool:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            i = self.text.find(stop, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return False
        i, stop = best
        self.stopped_by = stop
        self.text = self.text[: i + len(stop)] if self._include_stop else self.text[:i]
        return True

    def _emit(self, upto: int) -> str:
        upto = max(upto, self._emitted)
        out = self.text[self._emitted : upto]
        self._emitted = upto
        return out
