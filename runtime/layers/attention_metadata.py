"""What every attention layer of one engine step needs to know about the batch.

Token layout of a step: the decode tokens come first (one per decoding
sequence), then the prefill chunks, each contiguous. The KV cache of a layer is
``k_cache``/``v_cache`` of shape (num_blocks, block_size, num_kv_heads, head_dim);
a token's slot is ``block_id * block_size + offset``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """(num_tokens,) int64: where each new token's K/V is written; -1 = padding, not written."""
    num_decode_tokens: int
    """The first ``num_decode_tokens`` tokens are decodes, one per sequence."""
    decode_context_lens: torch.Tensor
    """(num_decodes,) int32: context length of each decode, including its new token."""
    decode_block_tables: torch.Tensor
    """(num_decodes, max_blocks) int32: block ids, padded with 0 past the context."""
    prefill_query_start_loc: torch.Tensor
    """(num_prefills + 1,) int32: offsets of each chunk within the prefill tokens."""
    prefill_context_lens: torch.Tensor
    """(num_prefills,) int32: cached prefix + this chunk, per prefill."""
    prefill_block_tables: torch.Tensor
    """(num_prefills, max_blocks) int32."""
    max_decode_context_len: int = 0
    max_prefill_query_len: int = 0
    max_prefill_context_len: int = 0
    # Host copies for the torch backend's per-sequence loop (no device sync needed).
    prefill_query_lens_host: tuple[int, ...] = ()
    prefill_context_lens_host: tuple[int, ...] = ()

    @property
    def num_decodes(self) -> int:
        return self.num_decode_tokens

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_query_lens_host)
