"""The scheduler on fake token ids: budgets, decode-first, modes, preemption order."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.runtime.engine.block_manager import BlockManager
from conveyor.runtime.engine.scheduler import Scheduler
from conveyor.runtime.engine.sequence import FinishReason, Sequence, SequenceStatus
from conveyor.runtime.sampling_params import SamplingParams


def seq(rid: str, n: int, max_tokens: int = 4) -> Sequence:
    return Sequence(
        rid,
        list(range(100 + len(rid), 100 + len(rid) + n)),
        n,
        SamplingParams(max_tokens=max_tokens),
        arrival_time=0.0,
    )


def advance(sched: Scheduler, max_tokens: dict[str, int] | None = None) -> list[Sequence]:
    """One fake step: schedule, 'compute', append a token to sequences that reached their end."""
    batch = sched.schedule()
    assert batch.num_tokens <= sched.token_budget
    assert len(sched.running) <= sched.max_running
    sched.update_after_step(batch)
    finished = []
    for s in batch.seqs:
        if s.num_computed_tokens == len(s.token_ids):
            s.token_ids.append(1)
            if s.num_output_tokens >= s.params.max_tokens:
                sched.finish(s, FinishReason.LENGTH)
                finished.append(s)
    return finished


def make(num_blocks=64, block_size=4, max_running=4, budget=16, mode="continuous"):
    return Scheduler(
        BlockManager(num_blocks, block_size),
        max_running=max_running,
        token_budget=budget,
        mode=mode,
    )


def test_decodes_go_first_and_prefill_chunks_fill_the_rest():
    sched = make(budget=10)
    a = seq("a", 3)
    sched.add(a)
    advance(sched)  # a prefilled, has 1 output
    sched.add(seq("b", 30))
    batch = sched.schedule()
    assert batch.seqs[0] is a and batch.num_new_tokens[0] == 1
    assert batch.num_decodes == 1
    assert batch.num_new_tokens[1] == 9  # the rest of the budget: a chunk of b's prompt


def test_finished_slot_is_refilled_at_the_next_step():
    sched = make(max_running=2, budget=64)
    short, long_, waiting = seq("s", 2, max_tokens=1), seq("l", 2, max_tokens=50), seq("w", 2)
    for s in (short, long_, waiting):
        sched.add(s)
    done = advance(sched)
    assert done == [short]
    batch = sched.schedule()
    assert waiting in batch.seqs, "continuous batching admits the waiting request right away"


def test_static_mode_admits_nobody_until_the_batch_is_done():
    sched = make(max_running=2, budget=64, mode="static")
    short, long_, waiting = seq("s", 2, max_tokens=1), seq("l", 2, max_tokens=3), seq("w", 2)
    for s in (short, long_, waiting):
        sched.add(s)
    advance(sched)
    for _ in range(2):
        batch = sched.schedule()
        assert waiting not in batch.seqs
        sched.update_after_step(batch)
        for s in batch.seqs:
            s.token_ids.append(1)
            if s.num_output_tokens >= s.params.max_tokens:
                sched.finish(s, FinishReason.LENGTH)
    assert long_.is_finished
    assert waiting in sched.schedule().seqs


def test_none_mode_runs_one_at_a_time():
    sched = make(max_running=8, mode="none")
    for i in range(3):
        sched.add(seq(f"r{i}", 3))
    batch = sched.schedule()
    assert len(batch.seqs) == 1 and len(sched.running) == 1


def test_preemption_takes_the_most_recently_admitted():
    sched = make(num_blocks=4, block_size=2, max_running=4, budget=64)
    a, b = seq("a", 4), seq("b", 3)
    sched.add(a)
    sched.add(b)
    advance(sched)  # a: 2 blocks (5 tokens needs 3 later), b: 2 blocks
    assert a.status is b.status is SequenceStatus.RUNNING
    batch = sched.schedule()  # a needs a third block: b goes back to the queue
    assert b in batch.preempted and b.status is SequenceStatus.WAITING
    assert sched.waiting[0] is b and b.num_computed_tokens == 0
    assert a in batch.seqs


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=12),
    budget=st.integers(1, 48),
    max_running=st.integers(1, 6),
    num_blocks=st.integers(13, 40),
    mode=st.sampled_from(["continuous", "static", "none"]),
)
def test_every_request_finishes_within_budget(lengths, budget, max_running, num_blocks, mode):
    sched = make(
        num_blocks=num_blocks, block_size=4, max_running=max_running, budget=budget, mode=mode
    )
    seqs = [seq(f"r{i}", n, max_tokens=m) for i, (n, m) in enumerate(lengths)]
    for s in seqs:
        sched.add(s)
    for _ in range(5000):
        if not sched.has_unfinished():
            break
        advance(sched)
    assert all(s.is_finished for s in seqs)
    assert all(s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert sched.bm.num_used_blocks == 0
