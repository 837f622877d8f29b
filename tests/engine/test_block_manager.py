"""Property tests: blocks are never leaked or freed twice; reference counts return to zero."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.runtime.engine.block_manager import BlockManager
from conveyor.runtime.engine.sequence import Sequence
from conveyor.runtime.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=1)

ops = st.lists(
    st.one_of(
        st.tuples(st.just("new"), st.integers(0, 3), st.integers(1, 40)),  # prefix family, length
        st.tuples(st.just("append"), st.integers(0, 50), st.integers(1, 9)),
        st.tuples(st.just("free"), st.integers(0, 50), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops=ops, num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 16]))
def test_random_allocate_append_share_free(ops, num_blocks, block_size):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    live: list[Sequence] = []
    families = {f: [f * 1000 + i for i in range(64)] for f in range(4)}
    for n, (op, a, b) in enumerate(ops):
        if op == "new":
            seq = Sequence(f"s{n}", families[a][:b], b, PARAMS, arrival_time=0.0)
            cached = bm.find_cached_prefix(seq)
            seq.num_computed_tokens = len(cached) * block_size
            assert seq.num_computed_tokens < len(seq.token_ids)
            if bm.allocate(seq, len(seq.token_ids) - seq.num_computed_tokens, cached):
                seq.num_computed_tokens = len(seq.token_ids)
                bm.cache_full_blocks(seq)
                live.append(seq)
            else:
                assert not seq.block_table, "a refused allocation must leave nothing behind"
        elif op == "append" and live:
            seq = live[a % len(live)]
            before = list(seq.block_table)
            if bm.allocate(seq, b):
                seq.token_ids += [7] * b
                seq.num_computed_tokens += b
                bm.cache_full_blocks(seq)
                assert seq.block_table[: len(before)] == before
                assert len(seq.block_table) * block_size >= len(seq.token_ids)
            else:
                assert seq.block_table == before
        elif op == "free" and live:
            bm.free(live.pop(a % len(live)))
        bm.check_invariants(live)
        assert bm.num_used_blocks <= num_blocks
    for seq in live:
        bm.free(seq)
    bm.check_invariants([])
    assert bm.num_free_blocks == num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_shared_prefix_blocks_are_shared_not_copied():
    bm = BlockManager(16, 4)
    a = Sequence("a", list(range(10)), 10, PARAMS, 0.0)
    assert bm.allocate(a, 10)
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)
    b = Sequence("b", list(range(9)) + [99], 10, PARAMS, 0.0)
    cached = bm.find_cached_prefix(b)
    assert cached == a.block_table[:2]
    assert bm.allocate(b, 2, cached)
    assert b.block_table[:2] == a.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    bm.check_invariants([a, b])


def test_freed_cached_blocks_are_found_again_until_evicted():
    bm = BlockManager(4, 2)
    a = Sequence("a", [1, 2, 3, 4, 5], 5, PARAMS, 0.0)
    assert bm.allocate(a, 5)
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    bm.free(a)
    again = Sequence("again", [1, 2, 3, 4, 9], 5, PARAMS, 0.0)
    assert len(bm.find_cached_prefix(again)) == 2
    filler = Sequence("filler", [8] * 8, 8, PARAMS, 0.0)
    assert bm.allocate(filler, 8)  # takes every block: the cached ones are evicted
    assert bm.find_cached_prefix(again) == []


def test_a_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(8, 2)
    a = Sequence("a", [1, 2, 3, 4], 4, PARAMS, 0.0)
    assert bm.allocate(a, 4)
    a.num_computed_tokens = 4
    bm.cache_full_blocks(a)
    b = Sequence("b", [1, 2, 3, 4], 4, PARAMS, 0.0)
    assert len(bm.find_cached_prefix(b)) == 1  # not 2: the last token must run
