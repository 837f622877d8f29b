"""What rank 0 sends the other ranks each step: their layout equals rank 0's, on real schedules.

The scheduler and block manager run on fake tokens, with prefix caching and a KV cache small
enough to preempt; every step's message goes through the pickling the command socket uses,
and the receiving rank's layout must equal ``layout_step``'s to the last block id.
"""

from __future__ import annotations

import random
from multiprocessing.reduction import ForkingPickler

from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.runtime.engine.block_manager import BlockManager
from conveyor.runtime.engine.scheduler import ScheduledBatch, Scheduler
from conveyor.runtime.engine.sequence import FinishReason, Sequence
from conveyor.runtime.engine.step_inputs import layout_step
from conveyor.runtime.engine.step_messages import StepMessage, StepReceiver, StepSender
from conveyor.runtime.sampling_params import SamplingParams


def sent(message: StepMessage) -> StepMessage:
    """``message`` as the other rank reads it off the socket."""
    copy = ForkingPickler.loads(ForkingPickler.dumps(message))
    assert isinstance(copy, StepMessage)
    return copy


def run(requests, num_blocks: int, block_size: int, budget: int, seed: int) -> dict[str, int]:
    """Serve ``requests`` (prompt, max_tokens) on fake tokens; every step, the receiver's layout
    must equal rank 0's. Returns how often the cases that change tables came up."""
    sched = Scheduler(BlockManager(num_blocks, block_size), max_running=4, token_budget=budget)
    sender, receiver = StepSender(), StepReceiver(block_size)
    rng = random.Random(seed)
    pending = [
        Sequence(f"r{i}", list(p), len(p), SamplingParams(max_tokens=m), arrival_time=0.0)
        for i, (p, m) in enumerate(requests)
    ]
    seen = {"steps": 0, "preemptions": 0, "cached_blocks": 0}
    while pending or sched.has_unfinished():
        assert seen["steps"] < 5000, "the schedule did not finish"
        if pending and rng.random() < 0.5:
            sched.add(pending.pop(0))
        batch = sched.schedule()
        if batch.is_empty:
            continue
        layout, sample_rows = layout_step(batch, block_size)
        message = sender.message(batch, layout, [r for _, r in sample_rows])
        assert receiver.layout(sent(message)) == layout
        assert set(receiver.tables) == sender.keys, "a finished sequence's table left behind"
        seen["steps"] += 1
        seen["cached_blocks"] += sum(s.num_cached_tokens for s in batch.seqs) // block_size
        sched.update_after_step(batch)
        for s in batch.seqs:
            if s.num_computed_tokens == len(s.token_ids):
                s.token_ids.append(rng.randrange(50))
                if s.num_output_tokens >= s.params.max_tokens:
                    sched.finish(s, FinishReason.LENGTH)
                    sender.release(s.request_id)
    seen["preemptions"] = sched.counters.preemptions
    return seen


PREFIXES = [[7] * 40, [3, 1, 4, 1, 5] * 6]
requests = st.lists(
    st.tuples(st.sampled_from([0, 1, None]), st.integers(1, 40), st.integers(1, 30)),
    min_size=1,
    max_size=10,
).map(
    lambda rs: [
        ((PREFIXES[f] if f is not None else []) + [9 + i] * n, m) for i, (f, n, m) in enumerate(rs)
    ]
)


@settings(max_examples=60, deadline=None)
@given(
    requests=requests,
    spare_blocks=st.integers(0, 24),
    block_size=st.sampled_from([2, 4, 8]),
    budget=st.integers(8, 64),
    seed=st.integers(0, 1000),
)
def test_the_other_ranks_lay_out_every_step_as_rank_0_does(
    requests, spare_blocks, block_size, budget, seed
):
    longest = max(len(p) + m for p, m in requests)  # the cache holds the longest, no more
    run(requests, -(-longest // block_size) + spare_blocks, block_size, budget, seed)


def test_preemption_and_prefix_caching_come_up_and_stay_in_step():
    requests = [(PREFIXES[i % 2] + [9 + i] * (5 + 7 * i), 30) for i in range(8)]
    seen = run(requests, num_blocks=40, block_size=4, budget=48, seed=1)
    assert seen["preemptions"] > 0 and seen["cached_blocks"] > 0, seen


def decode_batch(num_seqs: int, context: int, block_size: int) -> ScheduledBatch:
    """``num_seqs`` sequences decoding their next token after ``context`` tokens."""
    seqs = []
    for i in range(num_seqs):
        s = Sequence(f"r{i}", [5] * context, context, SamplingParams(), arrival_time=0.0)
        s.num_computed_tokens = context - 1
        blocks = -(-(context + 1) // block_size)  # room for this token and the next
        s.block_table = list(range(i * blocks, (i + 1) * blocks))
        seqs.append(s)
    return ScheduledBatch(seqs=seqs, num_new_tokens=[1] * num_seqs, num_decodes=num_seqs)


def test_a_decode_steps_message_does_not_grow_with_the_context():
    """Once the ranks hold the tables, a decode step sends tokens and lengths, not tables."""
    sizes = {}
    for context in (2000, 8000):
        batch, sender = decode_batch(32, context, 16), StepSender()
        layout, rows = layout_step(batch, 16)
        first = len(ForkingPickler.dumps(sender.message(batch, layout, [r for _, r in rows])))
        for s in batch.seqs:  # the next step: one more token each
            s.num_computed_tokens += 1
            s.token_ids.append(5)
        layout, rows = layout_step(batch, 16)
        sizes[context] = len(
            ForkingPickler.dumps(sender.message(batch, layout, [r for _, r in rows]))
        )
        assert first > 10 * sizes[context], "the first step sends the tables whole"
    assert abs(sizes[8000] - sizes[2000]) <= 32 * 2, sizes  # the lengths' wider ints, no more
