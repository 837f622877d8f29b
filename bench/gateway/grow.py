"""Phase ``grow`` of ``conveyor bench gateway``: a replica joins mid-run. Do the caches on
the ring survive, and does the new replica get work?

Each proxy starts in front of all replicas but the last, runs the routing workload, and
once half its requests have finished the last replica is added the way a user would add
it to that proxy (the gateway: a line in its backends file; a Rust router: its HTTP API).
The replicas' counters are read at the start, at the addition and at the end, so the
prefix-cache hit rate is known before and after the addition, and the new replica's
requests after it. A conversation moved to the new replica misses its prefix there once;
one that never moves keeps its cache but leaves the new replica idle.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from conveyor.bench.gateway.settings import BenchSettings
from conveyor.bench.gateway.table import table
from conveyor.bench.gateway.workload import (
    Counters,
    all_counters,
    hit_rate,
    requests_each,
    run_workload,
)
from conveyor.bench.procs import ChildProcess

if TYPE_CHECKING:
    from conveyor.bench.gateway.routing import RoutingRun


def bench_grow(
    s: BenchSettings, runs: list[RoutingRun], urls: list[str]
) -> dict[str, dict[str, float]]:
    """Each run's figures by label: prefix hit before and after the addition, the new
    replica's requests after it (count and share), seconds until the proxy had it."""
    old, new = urls[:-1], urls[-1]
    total = s.users * s.turns
    print(f"\n== grow: {len(old)} replicas, the {len(urls)}th added once {total // 2} of "
          f"{total} requests finished ==", flush=True)  # fmt: skip
    figures: dict[str, dict[str, float]] = {}
    rows = []
    for run in runs:
        proxy = run.start(old)
        try:
            start = all_counters(urls)
            (split, joined_s), wall = asyncio.run(_grow_run(run, proxy, s, urls, new))
            end = all_counters(urls)
        finally:
            proxy.stop()
        after = requests_each(split, end)
        f = figures[run.label] = {
            "hit_before": hit_rate(start, split),
            "hit_after": hit_rate(split, end),
            "new_req": after[-1],
            "new_share": after[-1] / sum(after) if sum(after) else 0.0,
            "join_s": joined_s,
        }
        rows.append([
            run.label, f"{f['hit_before']:.1%}", f"{f['hit_after']:.1%}",
            f"{after[-1]:.0f} of {sum(after):.0f}", f"{f['new_share']:.1%}", f"{joined_s:.1f}",
        ])  # fmt: skip
        print(f"  {run.label}: done in {wall:.1f}s", flush=True)
    print()
    print(table(
        ["proxy policy", "prefix hit before", "prefix hit after", "new replica req after",
         "new share", "joined in s"],
        rows,
    ))  # fmt: skip
    print(f"  (a fair share for the new replica is {1 / len(urls):.0%})")
    return figures


async def _grow_run(
    run: RoutingRun, proxy: ChildProcess, s: BenchSettings, urls: list[str], new: str
) -> tuple[tuple[list[Counters], float], float]:
    """The workload with the addition at half its requests: ((counters at the addition,
    seconds until the proxy had the new replica), wall time)."""
    half = max(1, s.users * s.turns // 2)
    added: list[asyncio.Task[tuple[list[Counters], float]]] = []

    def add() -> tuple[list[Counters], float]:
        split = all_counters(urls)
        started = time.monotonic()
        run.add(proxy, new)
        return split, time.monotonic() - started

    def finished(done: int) -> None:
        if done == half:
            added.append(asyncio.create_task(asyncio.to_thread(add)))

    _, wall = await run_workload(proxy.url, s, salt=f"grow {run.label}", finished=finished)
    return await added[0], wall
