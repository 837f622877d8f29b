"""Part ``overhead`` of ``conveyor bench gateway``: what a proxy adds to a request, and how
many streams it holds open at once (see ``command``). Every path fronts the same stub
replica (``stub.py``, no model), so what differs between paths is the proxy alone."""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from conveyor.bench.gateway import processes
from conveyor.bench.gateway.rounds import rotated
from conveyor.bench.gateway.routers import RustRouter
from conveyor.bench.gateway.table import table
from conveyor.bench.procs import ChildProcess, start_all
from conveyor.bench.stats import percentile

HEADERS = {"content-type": "application/json"}
HOLD_PACE_MS = 250
"""Chunk interval of the streams held open while latency is probed."""
HOLD_AFTER_RAMP_CHUNKS = 16
"""Chunks (one per ``RAMP_PACE_MS``) each ramped stream sends beyond the ramp: enough that the
first stream is still open when a client slowed by thousands of opens through a proxy on
the same cores opens the last (with 6, 4,000 streams peaked at 3,861 open through the
gateway, 3,991 through vllm-router, all completed without an error)."""
RAMP_PACE_MS = 1000
"""Chunk interval of the streams of the most-streams ramp: slow, so the ramp measures open
connections rather than chunk throughput on shared cores."""
PROBE_TOKENS = 16
"""Chunks of a streamed probe (sent back to back) and words of a non-streamed one."""
OPEN_TIMEOUT_S = 120
"""How long the held streams get to open, and a probe to be answered, before they count as
broken."""


def _body(prompt: str, max_tokens: int, stream: bool) -> bytes:
    doc = {"model": "stub", "prompt": prompt, "stream": stream, "max_tokens": max_tokens}
    return json.dumps(doc).encode()


@dataclass(frozen=True)
class Target:
    """One way to reach the stub: ``direct`` or through a proxy."""

    name: str
    url: str
    log: Path | None = None
    """The proxy's log, kept so that errors can be read (None: direct)."""


@dataclass
class Probes:
    """Latencies in seconds of the probes sent on one path."""

    whole: list[float] = field(default_factory=list)
    """Non-streamed: request sent to whole response read."""
    ttft: list[float] = field(default_factory=list)
    """Streamed: request sent to first chunk."""
    e2e: list[float] = field(default_factory=list)
    """Streamed: request sent to last chunk."""
    errors: Counter[str] = field(default_factory=Counter)
    """Held streams that broke or never opened, and probes that failed, by what happened."""

    @property
    def broken(self) -> int:
        return self.errors.total()

    def broke(self, what: str, exc: BaseException) -> None:
        status = f"HTTP {exc.status}" if isinstance(exc, aiohttp.ClientResponseError) else ""
        self.errors[f"{what}: {status or type(exc).__name__}"] += 1

    def extend(self, other: Probes) -> None:
        self.whole += other.whole
        self.ttft += other.ttft
        self.e2e += other.e2e
        self.errors += other.errors


async def probe_under_load(url: str, background: int, probes: int) -> Probes:
    """``probes`` non-streamed and ``probes`` streamed requests, alternating and one at a
    time, while ``background`` streams (a chunk every 250 ms each) stay open on the path.
    A held stream that breaks or never opens, and a probe that fails, count as broken:
    they are the path's result, not the bench's failure."""
    out = Probes()
    hold_body = _body(f"pace {HOLD_PACE_MS}", 100000, True)
    whole_body = _body("x", PROBE_TOKENS, False)
    stream_body = _body("x", PROBE_TOKENS, True)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(sock_connect=OPEN_TIMEOUT_S, sock_read=OPEN_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        all_settled = asyncio.Event()
        settled = 0  # held streams that opened or broke before they did
        gave_up = False  # those not open by then are counted once, as never open

        def settle() -> None:
            nonlocal settled
            settled += 1
            if settled == background:
                all_settled.set()

        async def hold() -> None:
            counted = False
            try:
                async with session.post(
                    url + "/v1/completions", data=hold_body, headers=HEADERS
                ) as r:
                    r.raise_for_status()
                    async for _chunk in r.content.iter_any():
                        if not counted:
                            counted = True
                            settle()
            except (aiohttp.ClientError, TimeoutError) as exc:
                if counted or not gave_up:
                    out.broke("held stream", exc)
                if not counted:
                    settle()

        async def timed(body: bytes, stream: bool) -> None:
            start = time.perf_counter()
            try:
                async with session.post(url + "/v1/completions", data=body, headers=HEADERS) as r:
                    r.raise_for_status()
                    if stream:
                        await r.content.readany()
                        first = time.perf_counter() - start
                    await r.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                out.broke("probe", exc)
                return
            if stream:
                out.ttft.append(first)
                out.e2e.append(time.perf_counter() - start)
            else:
                out.whole.append(time.perf_counter() - start)

        holders = [asyncio.create_task(hold()) for _ in range(background)]
        try:
            if background:
                try:
                    async with asyncio.timeout(OPEN_TIMEOUT_S):
                        await all_settled.wait()
                except TimeoutError:
                    gave_up = True
                    out.errors[f"held stream not open in {OPEN_TIMEOUT_S} s"] += (
                        background - settled
                    )
            for _ in range(probes):
                await timed(whole_body, stream=False)
                await timed(stream_body, stream=True)
        finally:
            for task in holders:
                task.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
    return out


async def hold_streams(url: str, n: int, ramp_s: float) -> tuple[int, Counter[str], int]:
    """Open ``n`` streams over ``ramp_s`` seconds, each long enough to outlast the ramp;
    (completed, errors by kind, most streams open at the same time)."""
    open_now = peak = completed = 0
    errors: Counter[str] = Counter()
    chunks = int(ramp_s * 1000 / RAMP_PACE_MS) + HOLD_AFTER_RAMP_CHUNKS
    body = _body(f"pace {RAMP_PACE_MS}", chunks, True)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=300)
    ) as session:

        async def one(i: int) -> None:
            nonlocal open_now, peak, completed
            counted = False
            await asyncio.sleep(ramp_s * i / n)  # pacing the load generator, not synchronisation
            try:
                async with session.post(url + "/v1/completions", data=body, headers=HEADERS) as r:
                    if r.status != 200:
                        errors[f"HTTP {r.status}"] += 1
                        return
                    tail = b""
                    async for chunk in r.content.iter_any():
                        if not counted:
                            counted = True
                            open_now += 1
                            peak = max(peak, open_now)
                        tail = (tail + chunk)[-64:]
                    if tail.rstrip().endswith(b"data: [DONE]"):
                        completed += 1
                    else:
                        errors["broken stream"] += 1
            except (aiohttp.ClientError, TimeoutError) as exc:
                errors[type(exc).__name__] += 1
            finally:
                if counted:
                    open_now -= 1

        await asyncio.gather(*(one(i) for i in range(n)))
    return completed, errors, peak


def _ms(value: float | None, sign: str = "") -> str:
    return "nan" if value is None else f"{value * 1000:{sign}.2f}"


def added_latency(
    targets: list[Target], concurrency: list[int], requests: int, rounds: int = 3
) -> dict[int, dict[str, dict[str, float | None]]]:
    """Per concurrency and path: p50/p99 of each probe kind over all rounds, and what the
    path adds to ``direct``'s: within each round (paths take turns, the order rotated each
    round, so drift on the shared machine falls on all of them alike), then the median over
    rounds, with its range as ``..._lo``/``..._hi``."""
    results: dict[int, dict[str, dict[str, float | None]]] = {}
    for c in concurrency:
        per_round: dict[str, list[Probes]] = {t.name: [] for t in targets}
        for r in range(rounds):
            for t in rotated(targets, r):
                per_round[t.name].append(asyncio.run(probe_under_load(t.url, c, requests)))
        figures: dict[str, dict[str, float | None]] = {}
        rows = []
        broke: dict[str, Counter[str]] = {}
        for t in targets:
            p = Probes()
            for probes in per_round[t.name]:
                p.extend(probes)
            if p.errors:
                broke[t.name] = p.errors
            row: dict[str, float | None] = {"broken": float(p.broken)}
            for kind in ("whole", "ttft", "e2e"):
                for q in (50, 99):
                    row[f"{kind}_p{q}"] = percentile(getattr(p, kind), q)
                    added = _added_per_round(per_round, t.name, kind, q)
                    key = f"{kind}_added_p{q}"
                    row[key] = statistics.median(added) if added else None
                    row[key + "_lo"] = min(added, default=None)
                    row[key + "_hi"] = max(added, default=None)
            figures[t.name] = row
            rows.append([
                t.name,
                *(_ms(row[f"{k}_p{q}"]) for k in ("whole", "ttft", "e2e") for q in (50, 99)),
                *(_ms(row[f"{k}_added_p{q}"], "+") for k in ("whole", "ttft") for q in (50, 99)),
                _range(row, "ttft_added_p99"),
                str(p.broken),
            ])  # fmt: skip
        results[c] = figures
        print(f"\n{c} streams held open (a chunk every {HOLD_PACE_MS} ms each), "
              f"{requests} probes of each kind per path and round, {rounds} rounds, one at a "
              f"time (non-streamed: {PROBE_TOKENS} words; streamed: {PROBE_TOKENS} chunks at "
              "once); ms, the added ones the median over rounds of each round's own:")  # fmt: skip
        print(table(
            ["path", "whole p50", "whole p99", "TTFT p50", "TTFT p99", "e2e p50", "e2e p99",
             "+whole p50", "+whole p99", "+TTFT p50", "+TTFT p99", "+TTFT p99 range", "broken"],
            rows,
        ), flush=True)  # fmt: skip
        for name, errors in broke.items():
            print(f"  {name} broke: " + ", ".join(f"{k} x{v}" for k, v in errors.items()))
    return results


def _added_per_round(
    per_round: dict[str, list[Probes]], name: str, kind: str, q: int
) -> list[float]:
    """Each round's percentile ``q`` of ``kind`` on path ``name`` minus ``direct``'s."""
    out = []
    for mine, direct in zip(per_round[name], per_round.get("direct", []), strict=False):
        v, base = percentile(getattr(mine, kind), q), percentile(getattr(direct, kind), q)
        if v is not None and base is not None:
            out.append(v - base)
    return out


def _range(row: dict[str, float | None], key: str) -> str:
    lo, hi = row.get(key + "_lo"), row.get(key + "_hi")
    return "-" if lo is None or hi is None else f"{_ms(lo, '+')}..{_ms(hi, '+')}"


def most_streams(targets: list[Target], steps: list[int], ramp_s: float = 4.0) -> dict[str, int]:
    """Per path: streams opened over ``ramp_s`` and held at once, more each time, until one
    fails; the most held with no error."""
    print(f"\nstreams opened over {ramp_s:g} s and held at once (a chunk every "
          f"{RAMP_PACE_MS} ms, ~{ramp_s + HOLD_AFTER_RAMP_CHUNKS * RAMP_PACE_MS / 1000:g} s "
          "each):")  # fmt: skip
    rows = []
    held: dict[str, int] = {}
    for t in targets:
        held[t.name] = 0
        for n in steps:
            start = time.perf_counter()
            completed, errors, peak = asyncio.run(hold_streams(t.url, n, ramp_s))
            kinds = ", ".join(f"{k} x{v}" for k, v in errors.items()) or "-"
            rows.append([t.name, str(n), str(peak), str(completed), str(errors.total()), kinds,
                         f"{time.perf_counter() - start:.1f}"])  # fmt: skip
            print(f"  {t.name}: {n} streams, {errors.total()} errors", flush=True)
            if errors:
                if t.log is not None:
                    said = [line for line in t.log.read_text(errors="replace").splitlines()
                            if "WARN" in line or "ERROR" in line]  # fmt: skip
                    print(f"  {t.name}'s log ({t.log}), last warnings:")
                    print("\n".join("    " + line[:300] for line in said[-5:]) or "    none")
                break
            held[t.name] = peak
    print(table(["path", "streams", "peak open", "completed", "errors", "kinds", "wall s"], rows))
    return held


def gateway_name(workers: int) -> str:
    """``conveyor`` for one process, ``conveyor-xN`` for ``--workers N``."""
    return "conveyor" if workers == 1 else f"conveyor-x{workers}"


@contextlib.contextmanager
def stub_paths(peers: list[tuple[RustRouter, Path]], workers: list[int]) -> Iterator[list[Target]]:
    """One stub, and each proxy in front of it with its default policy (the gateway's
    prefix-aware, the routers' cache_aware): ``direct`` first, then the gateway with each
    number of ``workers``, then the routers."""
    # A generous connect timeout: on a shared 2-core machine the stub, not the gateway, is
    # slow to accept thousands of connections at once.
    logs = Path(tempfile.mkdtemp(prefix="conveyor-bench-gateway-"))
    with processes.stub() as stub:
        children: list[tuple[str, ChildProcess]] = [
            (gateway_name(n),
             processes.gateway([stub.url], "--connect-timeout", "10", "--workers", str(n)))
            for n in workers
        ]  # fmt: skip
        children += [(r.name, processes.rust_router(r, venv, [stub.url], "cache_aware"))
                     for r, venv in peers]  # fmt: skip
        for name, child in children:
            child.log_path, child.keep_log = logs / f"{name}.log", True
        start_all([child for _, child in children])
        try:
            for name, child in children:
                if name.startswith("conveyor"):
                    processes.wait_admitted(child, 1)
            yield [
                Target("direct", stub.url),
                *(Target(n, c.url, c.log_path) for n, c in children),
            ]
        finally:
            for _, child in children:
                child.stop()


def bench_overhead(
    peers: list[tuple[RustRouter, Path]],
    concurrency: list[int],
    requests: int,
    steps: list[int],
    workers: list[int],
    rounds: int = 3,
) -> tuple[dict[int, dict[str, dict[str, float | None]]], dict[str, int]]:
    names = ", ".join([*(gateway_name(n) for n in workers), *(r.name for r, _ in peers)])
    print(f"\n== overhead (stub replica, no model): direct vs {names} ==", flush=True)
    with stub_paths(peers, workers) as targets:
        for t in targets:  # warm every path up: connections, caches
            asyncio.run(probe_under_load(t.url, 0, 50))
        latency = added_latency(targets, concurrency, requests, rounds)
        held = most_streams(targets, steps)
    return latency, held
