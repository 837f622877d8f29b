"""What rank 0 of a tensor-parallel replica tells the other ranks each step: what changed.

Every rank needs the step's layout (``step_inputs.StepLayout``): token ids, positions, KV
slots and each sequence's block table. Sent whole, the block tables dominate a decode step's
message and grow with the context (32 sequences of 2,000 tokens: 4,000 block ids a step, to
add 32 tokens). So each rank keeps a mirror of the block tables of the sequences it has
seen, and rank 0 sends only the block ids a table gained since the last step (a table that
changed in any other way, a preempted sequence's freed and then reallocated, is sent again
whole), the sequences that finished, the step's token ids and each sequence's context and
query lengths; a rank rebuilds positions and slots from those. Every sequence has a small
integer key instead of its request id. Rank 0's ``StepSender`` and the other ranks'
``StepReceiver`` are plain Python (the sender imports no torch), tested against
``layout_step`` on real schedules.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import count
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor.runtime.engine.scheduler import ScheduledBatch
    from conveyor.runtime.engine.step_inputs import StepLayout


@dataclass(frozen=True)
class StepMessage:
    """One step, as rank 0 sends it to the other ranks (pickled: plain ints and lists)."""

    token_ids: list[int]
    """The step's tokens, decodes first (as in the layout)."""
    seqs: list[int]
    """Each scheduled sequence's key, in the layout's order."""
    num_decodes: int
    context_lens: list[int]
    """Per sequence: its tokens in the KV cache once this step has run."""
    query_lens: list[int]
    """Per sequence: its tokens computed in this step."""
    tables: list[tuple[int, int, list[int]]]
    """(key, kept, new ids): that sequence's table keeps its first ``kept`` ids and gains
    ``new ids`` (kept is 0 for a table sent whole); tables that did not change are absent."""
    released: list[int]
    """Keys of sequences that finished since the last step: their tables are dropped."""
    sample_rows: list[int]
    """The rows (among the step's tokens) whose logits rank 0 samples from."""
    lora: list[int]
    """Each sequence's LoRA slot, as in the layout (empty: none uses an adapter)."""


class StepSender:
    """Rank 0's side: what the other ranks' mirrors hold, and the message that updates them."""

    def __init__(self) -> None:
        self._keys: dict[str, int] = {}
        self._sent: dict[str, list[int]] = {}
        """Each sequence's block table as the other ranks hold it."""
        self._next_key = count()
        self._released: list[int] = []

    def message(
        self, batch: ScheduledBatch, layout: StepLayout, sample_rows: list[int]
    ) -> StepMessage:
        keys, context_lens, tables = [], [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            rid, table = seq.request_id, seq.block_table
            key = self._keys.get(rid)
            if key is None:
                key = self._keys[rid] = next(self._next_key)
            keys.append(key)
            context_lens.append(seq.num_computed_tokens + n)
            sent = self._sent.get(rid)
            if sent is not None and len(sent) <= len(table) and table[: len(sent)] == sent:
                if len(sent) < len(table):  # blocks appended: the usual change
                    tables.append((key, len(sent), table[len(sent) :]))
                    sent.extend(table[len(sent) :])
            else:  # new to the ranks, or freed and allocated again (preempted)
                tables.append((key, 0, list(table)))
                self._sent[rid] = list(table)
        released, self._released = self._released, []
        return StepMessage(
            layout.token_ids, keys, batch.num_decodes, context_lens,
            list(batch.num_new_tokens), tables, released, sample_rows, layout.lora,
        )  # fmt: skip

    @property
    def keys(self) -> set[int]:
        """The sequences whose tables the other ranks hold once they read the last message."""
        return set(self._keys.values())

    def release(self, request_id: str) -> None:
        """``request_id`` is finished: the next message tells the ranks to drop its table."""
        key = self._keys.pop(request_id, None)
        self._sent.pop(request_id, None)
        if key is not None:
            self._released.append(key)


class StepReceiver:
    """A rank's side: the block tables mirrored from rank 0, and each step's layout."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.tables: dict[int, list[int]] = {}

    def layout(self, m: StepMessage) -> StepLayout:
        """The step's layout, as rank 0's ``layout_step`` laid it out."""
        from conveyor.runtime.engine.step_inputs import StepLayout, place_tokens

        for key in m.released:
            del self.tables[key]
        for key, kept, new in m.tables:
            table = self.tables.setdefault(key, [])
            del table[kept:]
            table.extend(new)
        positions: list[int] = []
        slots: list[int] = []
        tables = [self.tables[key] for key in m.seqs]
        for table, end, n in zip(tables, m.context_lens, m.query_lens, strict=True):
            place_tokens(table, end - n, end, self.block_size, positions, slots)
        d = m.num_decodes
        return StepLayout(
            m.token_ids, positions, slots, d, tables[:d], m.context_lens[:d],
            tables[d:], m.context_lens[d:], m.query_lens[d:], m.lora,
        )  # fmt: skip
