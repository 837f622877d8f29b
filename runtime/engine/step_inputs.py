"""One engine step's inputs: the scheduled batch laid out flat, then as the model's tensors.

``layout_step`` turns a batch into plain lists (decodes first, then prefill chunks): the
``StepLayout`` that a tensor-parallel rank 0 also sends the other ranks. ``step_tensors``
turns a layout into the token ids, positions and attention metadata on the device, which
every rank does for itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from conveyor.runtime.engine.scheduler import ScheduledBatch
from conveyor.runtime.layers.attention_metadata import AttentionMetadata


@dataclass(frozen=True)
class StepLayout:
    """One step's tokens laid out flat, as plain lists (what rank 0 sends the other ranks)."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    num_decodes: int
    decode_tables: list[list[int]]
    decode_lens: list[int]
    prefill_tables: list[list[int]]
    prefill_ctx: list[int]
    prefill_q: list[int]
    lora: list[int] = dataclasses.field(default_factory=list)
    """Each sequence's LoRA slot (-1: the base model), in the layout's order; empty when no
    sequence of the step uses an adapter."""

    def lora_token_slots(self) -> list[int]:
        """Each token's LoRA slot (a decode has one token, a prefill chunk its query)."""
        counts = [1] * self.num_decodes + self.prefill_q
        return [slot for slot, n in zip(self.lora, counts, strict=True) for _ in range(n)]


def place_tokens(
    table: list[int], start: int, end: int, block_size: int, positions: list[int], slots: list[int]
) -> None:
    """Append positions ``start..end-1`` of a sequence and their KV slots (the block its table
    holds for the position, and the offset in that block)."""
    positions.extend(range(start, end))
    slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))


def layout_step(batch: ScheduledBatch, block_size: int) -> tuple[StepLayout, list[tuple[int, int]]]:
    """The step's tokens laid out flat (decodes first, then prefill chunks), and for each
    sequence that samples, its index in the batch and its row among the T tokens."""
    bs = block_size
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    sample_rows: list[tuple[int, int]] = []
    decode_tables, decode_lens = [], []
    prefill_tables, prefill_ctx, prefill_q = [], [], []
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
        start = seq.num_computed_tokens
        end = start + n
        ids += seq.token_ids[start:end]
        table = seq.block_table
        place_tokens(table, start, end, bs, pos, slots)
        if end == len(seq.token_ids):
            sample_rows.append((i, len(ids) - 1))
        if i < batch.num_decodes:
            decode_tables.append(table)
            decode_lens.append(end)
        else:
            prefill_tables.append(table)
            prefill_ctx.append(end)
            prefill_q.append(n)
    lora = [seq.lora_slot for seq in batch.seqs]
    layout = StepLayout(
        ids, pos, slots, batch.num_decodes,
        decode_tables, decode_lens, prefill_tables, prefill_ctx, prefill_q,
        lora if any(slot >= 0 for slot in lora) else [],
    )  # fmt: skip
    return layout, sample_rows


def step_tensors(
    layout: StepLayout, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """The step's token ids (T,), positions (T,) and attention metadata on ``device``."""
    decode_lens, prefill_q, prefill_ctx = (
        layout.decode_lens,
        layout.prefill_q,
        layout.prefill_ctx,
    )
    meta = AttentionMetadata(
        slot_mapping=to_device(layout.slots, torch.int64, device),
        num_decode_tokens=layout.num_decodes,
        decode_context_lens=to_device(decode_lens, torch.int32, device),
        decode_block_tables=to_device(_pad(layout.decode_tables), torch.int32, device),
        prefill_query_start_loc=to_device(_cumsum0(prefill_q), torch.int32, device),
        prefill_context_lens=to_device(prefill_ctx, torch.int32, device),
        prefill_block_tables=to_device(_pad(layout.prefill_tables), torch.int32, device),
        max_decode_context_len=max(decode_lens, default=0),
        max_prefill_query_len=max(prefill_q, default=0),
        max_prefill_context_len=max(prefill_ctx, default=0),
        prefill_query_lens_host=tuple(prefill_q),
        prefill_context_lens_host=tuple(prefill_ctx),
    )
    ids = to_device(layout.token_ids, torch.int64, device)
    pos = to_device(layout.positions, torch.int64, device)
    return ids, pos, meta


def to_device(
    data: list[int] | list[float] | list[list[int]], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``data`` as a tensor on ``device`` (copied through pinned memory, without waiting, to a GPU)."""
    t = torch.tensor(data, dtype=dtype)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _pad(tables: list[list[int]]) -> list[list[int]]:
    width = max((len(t) for t in tables), default=0)
    return [t + [0] * (width - len(t)) for t in tables] if tables else []


def _cumsum0(values: list[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out
