"""Iteration-level scheduling over a paged KV cache. Plain Python, no torch.

Every engine step gets a token budget (``chunked_prefill_size``). Running
requests get their decode token first; then running requests that are part-way
through a long prompt get their next chunk; then waiting requests are admitted
and fill what is left, so one step mixes decode and chunked prefill. When the
KV cache runs out, the most recently admitted running request is preempted: its
blocks are freed and it goes back to the front of the queue, to be recomputed
(its prefix-cached blocks usually make that cheap).

The three modes differ only in admission:
- ``continuous``: a waiting request joins as soon as a slot and blocks allow;
- ``static``: a batch of up to ``max_running`` requests is formed from the
  queue and runs until every member has finished; nobody joins mid-batch;
- ``none``: a batch of one.

The policy orders the waiting queue (nobody overtakes its head in that order):
- ``fcfs``: arrival order (vLLM's default);
- ``priority``: each request's ``priority``, lower first, then arrival (vLLM's
  ``--scheduling-policy priority``); the KV cache's preemption victim is the
  running request last in that order, not the newest;
- ``lpm``: longest prefix match first, the requests with the most of their prompt
  in the prefix cache (SGLang's ``--schedule-policy lpm``): they cost least
  to admit, and they run while their cached blocks are still there to share.
  Ties keep arrival order; past ``LPM_MAX_QUEUE`` waiting requests it stops reordering
  (new ones join at the back), as SGLang's, since matching every request each step costs
  more than it saves. A prompt that matches nothing waits while matching ones keep coming.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from conveyor.runtime.engine.block_manager import BlockManager
from conveyor.runtime.engine.sequence import FinishReason, Sequence, SequenceStatus
from conveyor.runtime.engine.settings import SCHEDULING_POLICIES


@dataclass
class ScheduledBatch:
    """What one engine step computes: decodes first, then prefill chunks."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_decodes: int = 0
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


LPM_MAX_QUEUE = 128
"""Waiting requests beyond which ``lpm`` stops reordering the queue (SGLang's cut-off)."""


def _priority_key(seq: Sequence) -> tuple[int, float]:
    return (seq.priority, seq.arrival_time)


@dataclass
class SchedulerCounters:
    """Monotonic counters for the metrics (prefix cache, preemptions)."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_running: int,
        token_budget: int,
        mode: str = "continuous",
        policy: str = "fcfs",
        watermark_blocks: int = 0,
    ):
        if mode not in ("continuous", "static", "none"):
            raise ValueError(f"scheduler must be continuous, static or none; got {mode!r}")
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}; got {policy!r}"
            )
        self.policy = policy
        self.bm = block_manager
        self.max_running = 1 if mode == "none" else max_running
        self.token_budget = token_budget
        self.mode = mode
        self.watermark_blocks = watermark_blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.counters = SchedulerCounters()
        self._batch: set[str] = set()  # static/none: the current batch's request ids

    def set_mode(self, mode: str, max_running: int) -> None:
        """Switch admission between runs (the offline benchmark compares modes on one engine)."""
        if self.has_unfinished():
            raise RuntimeError("change the scheduling mode only while the engine is idle")
        if mode not in ("continuous", "static", "none"):
            raise ValueError(f"scheduler must be continuous, static or none; got {mode!r}")
        self.mode = mode
        self.max_running = 1 if mode == "none" else max_running
        self._batch.clear()

    # -- requests in and out -----------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq, front=False)

    def _enqueue(self, seq: Sequence, front: bool) -> None:
        """Into the waiting queue: by priority, or at the back (``front``: a preempted
        request, which goes before every newer one)."""
        if self.policy == "priority":
            at = bisect.bisect_right(self.waiting, _priority_key(seq), key=_priority_key)
            self.waiting.insert(at, seq)
        elif front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Take ``seq`` out of the batch and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._batch.discard(seq.request_id)

    # -- the step ----------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.token_budget

        # 1. Decodes, oldest first; 2. the next chunk of part-way prefills.
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefills = [s for s in self.running if s.num_uncomputed_tokens > 1]
        for group in (decodes, prefills):
            for seq in group:
                if budget == 0:
                    break
                if seq.status is not SequenceStatus.RUNNING:
                    continue  # preempted earlier in this step
                n = min(seq.num_uncomputed_tokens, budget)
                if self._allocate_or_preempt(seq, n, batch):
                    batch.seqs.append(seq)
                    batch.num_new_tokens.append(n)
                    budget -= n
            if group is decodes:
                batch.num_decodes = len(batch.seqs)

        # 3. Admit waiting requests into the budget that is left (not in a step that
        # had to preempt: the cache is full, admitting would only thrash).
        if batch.preempted:
            return batch
        if self.policy == "lpm" and 1 < len(self.waiting) <= LPM_MAX_QUEUE and budget > 0:
            self._order_by_prefix_match()
        if self.mode != "continuous" and not self._batch and not self.running:
            self._batch = {s.request_id for s in list(self.waiting)[: self.max_running]}
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            head = self._next_waiting()
            if head is None:
                break
            seq = head
            cached = self._cached_prefix(seq)
            num_cached = len(cached) * self.bm.block_size
            n = min(len(seq.token_ids) - num_cached, budget)
            if not self.bm.allocate(seq, n, cached, reserve=self.watermark_blocks):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.remove(seq)
            seq.num_computed_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached
            self.counters.prefix_cache_queries += len(seq.token_ids)
            self.counters.prefix_cache_hits += num_cached
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks ``seq`` would start from; none for a prompt that wants its
        logprobs, which need the logits of every prompt token."""
        if seq.params.prompt_logprobs is not None:
            return []
        return self.bm.find_cached_prefix(seq)

    def _next_waiting(self) -> Sequence | None:
        """The waiting request to admit next: the queue's head, or in ``static`` and ``none``
        the first member of the current batch (a request of higher priority that came after
        the batch was formed waits for the next batch)."""
        if self.mode == "continuous":
            return self.waiting[0]
        return next((s for s in self.waiting if s.request_id in self._batch), None)

    def _order_by_prefix_match(self) -> None:
        """``lpm``: the waiting queue, most cached prompt blocks first (a stable sort, so ties
        keep their order: arrival, preempted requests first)."""
        cached = {seq.request_id: len(self._cached_prefix(seq)) for seq in self.waiting}
        self.waiting = deque(sorted(self.waiting, key=lambda s: -cached[s.request_id]))

    def _allocate_or_preempt(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Find blocks for ``n`` more tokens of ``seq``, preempting running requests: the
        newest, or under ``priority`` the last in priority order."""
        while not self.bm.allocate(seq, n):
            if self.policy == "priority":
                victim = max(reversed(self.running), key=_priority_key)  # ties: the newest
            else:
                victim = self.running[-1]
            self._preempt(victim, batch)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        if seq in batch.seqs:  # scheduled earlier in this step: take it back out
            i = batch.seqs.index(seq)
            del batch.seqs[i], batch.num_new_tokens[i]
            if i < batch.num_decodes:
                batch.num_decodes -= 1
        self.running.remove(seq)
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self._enqueue(seq, front=True)
        self.counters.preemptions += 1
        batch.preempted.append(seq)

    # -- after the model ran -----------------------------------------------------------

    def update_after_step(self, batch: ScheduledBatch) -> None:
        """Mark the scheduled tokens computed and publish newly full blocks."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
            self.bm.cache_full_blocks(seq)
