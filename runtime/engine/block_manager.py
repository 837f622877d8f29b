"""Paged KV-cache bookkeeping: fixed-size blocks, reference counts, a prefix cache.

No torch: the model runner owns the tensors, this owns which block holds what.

A full block is identified by a chained hash: hash(parent block's hash, the
block's token ids); a request's ``cache_salt`` and LoRA adapter stand in for the first
block's parent.
Two requests whose prompts share a prefix share those blocks (reference count > 1). A block whose last user finished keeps its hash
and sits in the free list; it can be found again by a later prompt until it is
evicted, least recently freed first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from conveyor.runtime.engine.sequence import Sequence


def hash_block(parent: bytes | None, token_ids: Seq[int]) -> bytes:
    """Chained hash of one full block: it names the block's whole prefix, not just its tokens."""
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def chain_root(seq: Sequence) -> bytes | None:
    """The parent of a prompt's first block, from its ``cache_salt`` and its LoRA adapter:
    two salts (or a salt and none), two adapters (or one and the base model) never give the
    same chain, so their blocks are never found by each other."""
    if seq.cache_salt is None and seq.lora_key is None:
        return None
    h = hashlib.blake2b(digest_size=16, person=b"chain_root")
    for part in (seq.cache_salt, seq.lora_key):
        h.update(b"\x00" if part is None else b"\x01" + part.encode() + b"\xff")
    return h.digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    """Set once the block is full and registered in the prefix cache."""


class BlockManager:
    """Allocates KV blocks to sequences and keeps the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, least recently freed first (the next to be evicted).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        # Chained hashes of each running sequence's full blocks, by request id.
        self._seq_hashes: dict[str, list[bytes]] = {}

    # -- queries -----------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Blocks held by requests / all blocks (cached free blocks count as free)."""
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of ``seq``'s tokens.

        At least one token is always left to compute (its logits give the next
        token), so a prompt that is entirely cached still runs its last block.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hashes = seq.prefix_hashes  # computed once per block: lookups repeat while it waits
        found: list[int] = []
        for i in range((len(seq.token_ids) - 1) // bs):
            if i == len(hashes):
                parent = hashes[-1] if hashes else chain_root(seq)
                hashes.append(hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs]))
            block_id = self._cached.get(hashes[i])
            if block_id is None:
                break
            found.append(block_id)
        return found

    # -- allocation --------------------------------------------------------------------

    def allocate(
        self, seq: Sequence, num_new_tokens: int, cached_blocks: Seq[int] = (), reserve: int = 0
    ) -> bool:
        """Give ``seq`` blocks for ``num_computed_tokens + num_new_tokens`` tokens.

        ``cached_blocks`` (from ``find_cached_prefix``, only for a sequence that
        holds no blocks yet) are shared instead of allocated. ``reserve`` blocks
        must stay free afterwards. Returns False, changing nothing, when there
        are not enough free blocks.
        """
        if cached_blocks:
            assert not seq.block_table, "cached blocks are only taken by a fresh sequence"
        total_tokens = seq.num_computed_tokens + num_new_tokens
        if cached_blocks:
            total_tokens = max(total_tokens, len(cached_blocks) * self.block_size + num_new_tokens)
        have = len(seq.block_table) + len(cached_blocks)
        need_new = max(0, self.blocks_needed(total_tokens) - have)
        revived = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        if need_new + revived + reserve > len(self._free):
            return False
        for block_id in cached_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        if cached_blocks and self.enable_prefix_caching:
            self._seq_hashes[seq.request_id] = [self._hash_of(b) for b in cached_blocks]
        for _ in range(need_new):
            seq.block_table.append(self._take_free_block())
        return True

    def _hash_of(self, block_id: int) -> bytes:
        block_hash = self.blocks[block_id].block_hash
        assert block_hash is not None, "a block found in the prefix cache has its hash"
        return block_hash

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``; the last block goes to the eviction front last."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
        seq.block_table = []
        self._seq_hashes.pop(seq.request_id, None)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register ``seq``'s blocks that are full of computed tokens in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        hashes = self._seq_hashes.setdefault(seq.request_id, [])
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        for i in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else chain_root(seq)
            h = hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs])
            hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None and h not in self._cached:
                block.block_hash = h
                self._cached[h] = block.block_id

    def reset_prefix_cache(self) -> None:
        """Forget cached hashes of free blocks (e.g. after a weight reload)."""
        for block_id in self._free:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._cached.pop(block.block_hash, None)
                block.block_hash = None

    # -- invariants (used by the property tests) ---------------------------------------

    def check_invariants(self, live: Seq[Sequence]) -> None:
        refs = [0] * self.num_blocks
        for seq in live:
            for block_id in seq.block_table:
                refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count}, held {refs[block.block_id]}"
            )
            assert (block.ref_count == 0) == (block.block_id in self._free), (
                f"block {block.block_id}: free list disagrees with ref_count {block.ref_count}"
            )
        for h, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == h
