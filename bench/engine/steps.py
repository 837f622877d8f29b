"""Timing one engine's decode steps, for the engine benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable

from conveyor.runtime.engine.llm_engine import LLMEngine

TIMED_STEPS = 16
"""Decode steps timed per batch; the fastest is reported (on a shared machine the others
measure the neighbours)."""


def fastest_decode_step(engine: LLMEngine, add_requests: Callable[[], None], batch: int) -> float:
    """Fastest decode step (ms) of the ``batch`` requests ``add_requests`` adds (each with
    room for more than ``TIMED_STEPS`` tokens), timed while the whole batch still runs; the
    requests are then aborted."""
    add_requests()
    while (
        any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running)
        or engine.scheduler.waiting
    ):
        engine.step()  # prefill until everyone decodes
    times: list[float] = []
    while len(times) < TIMED_STEPS and len(engine.scheduler.running) == batch:
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    for seq in list(engine.scheduler.running):
        engine.abort_request(seq.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return min(times) * 1e3
