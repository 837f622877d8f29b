"""The load of ``conveyor bench autoscale``: requests through the gateway, what they saw, and
the LLMService sampled as they run."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from conveyor.bench.autoscale.cluster_env import Env
from conveyor.bench.autoscale.settings import MODEL, BenchSettings
from conveyor.bench.stats import percentile


@dataclass
class Progress:
    """Lines on stderr with the seconds since the benchmark started, as it goes."""

    started: float = field(default_factory=time.monotonic)

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:6.0f}s] {message}", file=sys.stderr, flush=True)


def describe_status(obj: dict[str, Any]) -> str:
    """The LLMService's replicas and the autoscaler's last estimates, in one line."""
    status = obj.get("status") or {}
    auto = status.get("autoscaler") or {}
    sig = auto.get("signals") or {}
    parts = [
        f"replicas {obj['spec'].get('replicas', 0)} desired / {status.get('readyReplicas', 0)} "
        f"ready",
        f"queue/replica {sig.get('queueDepthPerReplica', 0.0):.1f}",
    ]
    if "demandRequestsPerSecond" in sig:
        cap = auto.get("capacity") or {}
        parts.append(
            f"demand {sig['demandRequestsPerSecond']:.2f} req/s, capacity "
            f"{cap.get('requestsPerSecond', 0.0):.2f} req/s/replica ({cap.get('source', '?')}), "
            f"utilization {sig.get('utilization', 0.0):.2f}"
            + (", panic" if sig.get("panic") else "")
        )
    if "burstReplicasNeeded" in sig:
        parts.append(
            f"replicas needed {sig.get('replicasNeeded', 0.0):.2f} (panic window "
            f"{sig['burstReplicasNeeded']:.2f})"
        )
    if auto.get("reason"):
        parts.append(f"last decision {auto.get('direction')} ({auto['reason']})")
    if auto.get("scaleDownHeldBy"):
        parts.append(f"scale-down held by {auto['scaleDownHeldBy']}")
    return ", ".join(parts)


@dataclass
class Sample:
    t: float
    replicas: int
    ready: int
    queue: float
    ttft_p95: float | None
    need: float | None = None
    """``status.autoscaler.signals.replicasNeeded``: what the demand window calls for."""
    burst_need: float | None = None
    """``burstReplicasNeeded``: what the panic window (or its last half) calls for."""


@dataclass
class Recorder:
    """Requests' client-side TTFT and backends, and the LLMService over time."""

    started: float = field(default_factory=time.monotonic)
    done: list[tuple[float, float, str]] = field(default_factory=list)
    """(finish time, TTFT seconds, backend)."""
    sent: list[tuple[float, float]] = field(default_factory=list)
    """(send time, TTFT seconds) of the same requests, in the order they finished."""
    failures: int = 0
    samples: list[Sample] = field(default_factory=list)

    def p95(self, since: float, until: float) -> float | None:
        """Client-side TTFT p95 of the requests finished in [since, until)."""
        ends = [at for at, _, _ in self.done]  # appended as they finish: sorted
        return window_p95(ends, [t for _, t, _ in self.done], since, until)

    def p95_sent(self, since: float, until: float) -> float | None:
        """Client-side TTFT p95 of the requests sent in [since, until) (and finished)."""
        ttfts = [t for at, t in self.sent if since <= at < until]
        return percentile(ttfts, 95) if len(ttfts) >= 5 else None


def window_p95(times: list[float], ttfts: list[float], since: float, until: float) -> float | None:
    """TTFT p95 of the events at sorted ``times`` in [since, until); None under 5 of them."""
    lo, hi = bisect.bisect_left(times, since), bisect.bisect_left(times, until)
    window = ttfts[lo:hi]
    return percentile(window, 95) if len(window) >= 5 else None


async def one_request(client: Any, rec: Recorder, max_tokens: int) -> None:
    sent = time.monotonic()
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": f"hi {random.random()}"}],
            max_tokens=max_tokens, stream=True,
        )  # fmt: skip
        backend = raw.headers.get("x-conveyor-backend", "")
        first = None
        async for chunk in raw.parse():
            if first is None and chunk.choices:
                first = time.monotonic() - sent
        ttft = first if first is not None else 0.0
        rec.done.append((time.monotonic(), ttft, backend))
        rec.sent.append((sent, ttft))
    except Exception as exc:  # counted and shown: a benchmark reports failures, it does not stop
        rec.failures += 1
        print(f"  request failed: {type(exc).__name__}: {exc}", file=sys.stderr)


async def closed_loop(client: Any, rec: Recorder, clients: int, seconds: float, s: BenchSettings):
    end = time.monotonic() + seconds

    async def worker() -> None:
        while time.monotonic() < end:
            await one_request(client, rec, s.max_tokens)

    await asyncio.gather(*(worker() for _ in range(clients)))


async def open_loop(client: Any, rec: Recorder, rate: float, stop: asyncio.Event, s) -> None:
    """Poisson arrivals at ``rate`` per second until ``stop``; waits for those in flight."""
    tasks: set[asyncio.Task[None]] = set()
    while not stop.is_set():
        task = asyncio.create_task(one_request(client, rec, s.max_tokens))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), random.expovariate(rate))
    await asyncio.gather(*tasks)


async def watch(
    env: Env, rec: Recorder, stop: asyncio.Event, progress: Progress, every_s: float
) -> None:
    """Sample the LLMService twice a second; a progress line every ``every_s`` seconds."""
    next_line = time.monotonic()
    while not stop.is_set():
        obj = await asyncio.to_thread(env.llmservice)
        now = time.monotonic()
        if now >= next_line:
            next_line = now + every_s
            p95 = rec.p95(now - 10, now)
            ttft = "-" if p95 is None else f"{p95:.2f}s"
            progress.say(
                f"{describe_status(obj)}; client TTFT p95 (10 s) {ttft}; "
                f"{len(rec.done)} done, {rec.failures} failed"
            )
        auto = (obj.get("status") or {}).get("autoscaler") or {}
        sig = auto.get("signals") or {}
        rec.samples.append(Sample(
            time.monotonic(), int(obj["spec"].get("replicas", 0)),
            int((obj.get("status") or {}).get("readyReplicas", 0)),
            float(sig.get("queueDepthPerReplica", 0.0)), sig.get("ttftP95Seconds"),
            sig.get("replicasNeeded"), sig.get("burstReplicasNeeded"),
        ))  # fmt: skip
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)
