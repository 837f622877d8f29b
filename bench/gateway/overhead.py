"""Part ``overhead`` of ``conveyor bench gateway``: the stub reached directly and through
the gateway, and how many streams the gateway holds open at once (see ``command``)."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import aiohttp

from conveyor.bench.gateway import processes
from conveyor.bench.gateway.settings import BenchSettings
from conveyor.bench.gateway.table import table
from conveyor.bench.stats import percentile


async def closed_loop(
    url: str, concurrency: int, requests: int, tokens: int
) -> tuple[list[float], list[float], int]:
    ttfts: list[float] = []
    e2es: list[float] = []
    errors = 0
    remaining = requests
    body = json.dumps(
        {"model": "stub", "prompt": "x", "stream": True, "max_tokens": tokens}
    ).encode()
    headers = {"content-type": "application/json"}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=120)
    ) as session:

        async def worker() -> None:
            nonlocal remaining, errors
            while remaining > 0:
                remaining -= 1
                start = time.perf_counter()
                first = None
                try:
                    async with session.post(
                        url + "/v1/completions", data=body, headers=headers
                    ) as r:
                        if r.status != 200:
                            errors += 1
                            continue
                        async for _chunk in r.content.iter_any():
                            if first is None:
                                first = time.perf_counter() - start
                except (aiohttp.ClientError, TimeoutError):
                    errors += 1
                    continue
                ttfts.append(first or 0.0)
                e2es.append(time.perf_counter() - start)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ttfts, e2es, errors


async def hold_streams(
    url: str, n: int, tokens: int, ramp_s: float
) -> tuple[int, Counter[str], int]:
    """Open ``n`` streams over ``ramp_s`` seconds, each long enough to outlast the ramp;
    (completed, errors by kind, most streams open at the same time)."""
    open_now = peak = completed = 0
    errors: Counter[str] = Counter()
    body = json.dumps(
        {"model": "stub", "prompt": "x", "stream": True, "max_tokens": tokens}
    ).encode()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=300)
    ) as session:

        async def one(i: int) -> None:
            nonlocal open_now, peak, completed, errors
            counted = False
            await asyncio.sleep(ramp_s * i / n)  # pacing the load generator, not synchronisation
            try:
                async with session.post(
                    url + "/v1/completions", data=body, headers={"content-type": "application/json"}
                ) as r:
                    if r.status != 200:
                        errors[f"HTTP {r.status}"] += 1
                        return
                    data = b""
                    async for chunk in r.content.iter_any():
                        if not counted:
                            counted = True
                            open_now += 1
                            peak = max(peak, open_now)
                        data += chunk
                    if data.endswith(b"data: [DONE]\n\n") and b'"error"' not in data:
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


async def probe_under_load(url: str, background: int, probes: int) -> tuple[list[float], int]:
    """TTFT of ``probes`` one-chunk requests, one after another, while ``background`` long
    streams are held open on the same path; returns (TTFTs, background streams that broke)."""
    headers = {"content-type": "application/json"}
    long_body = json.dumps(
        {"model": "stub", "prompt": "x", "stream": True, "max_tokens": 100000}
    ).encode()
    probe_body = json.dumps(
        {"model": "stub", "prompt": "x", "stream": True, "max_tokens": 1}
    ).encode()
    connector = aiohttp.TCPConnector(limit=0)
    broken = 0
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=600)
    ) as session:
        opened = asyncio.Event()
        open_count = 0

        async def hold() -> None:
            nonlocal open_count, broken
            try:
                async with session.post(
                    url + "/v1/completions", data=long_body, headers=headers
                ) as r:
                    async for _chunk in r.content.iter_any():
                        if not opened.is_set():
                            open_count += 1
                            if open_count == background:
                                opened.set()
            except (aiohttp.ClientError, TimeoutError):
                broken += 1

        holders = [asyncio.create_task(hold()) for _ in range(background)]
        async with asyncio.timeout(120):
            await opened.wait()
        ttfts = []
        for _ in range(probes):
            start = time.perf_counter()
            async with session.post(url + "/v1/completions", data=probe_body, headers=headers) as r:
                await r.content.readany()
                ttfts.append(time.perf_counter() - start)
                await r.read()
        for task in holders:
            task.cancel()
        await asyncio.gather(*holders, return_exceptions=True)
    return ttfts, broken


def bench_overhead(s: BenchSettings) -> None:
    print(
        f"\n== overhead: minimal streaming server, {s.overhead_concurrency} streams held open ==",
        flush=True,
    )
    with processes.stub("--token-interval-ms", "250") as stub:
        # A generous connect timeout: on a shared 2-core machine the stub, not the gateway, is
        # slow to accept thousands of connections at once.
        args = ("--routing", "least-load", "--connect-timeout", "10")
        with processes.gateway([stub.url], *args) as gateway:
            processes.wait_admitted(gateway, 1)
            asyncio.run(closed_loop(stub.url, 20, 200, 1))  # warm both paths up
            asyncio.run(closed_loop(gateway.url, 20, 200, 1))
            added_latency(s, stub.url, gateway.url)
            most_streams(s, gateway.url)


def _ms(value: float | None, digits: int = 2, sign: str = "") -> str:
    return "nan" if value is None else f"{value * 1000:{sign}.{digits}f}"


def added_latency(s: BenchSettings, direct_url: str, gateway_url: str) -> None:
    """TTFT of sequential probes with streams held open: direct, through the gateway, direct."""
    rows = []
    results = {}
    for name, url in (
        ("direct", direct_url),
        ("gateway", gateway_url),
        ("direct (again)", direct_url),
    ):
        ttfts, broken = asyncio.run(
            probe_under_load(url, s.overhead_concurrency, s.overhead_requests)
        )
        results[name] = ttfts
        rows.append([name, *(_ms(percentile(ttfts, q)) for q in (50, 90, 99)), str(broken)])
    print(f"TTFT of {s.overhead_requests} sequential probes while {s.overhead_concurrency} streams "
          "(a chunk every 250 ms each) stay open on the same path:")  # fmt: skip
    print(table(["path", "p50 ms", "p90 ms", "p99 ms", "broken streams"], rows))
    direct = results["direct"] + results["direct (again)"]
    via = results["gateway"]

    def added(q: float) -> str:
        a, b = percentile(via, q), percentile(direct, q)
        return _ms(None if a is None or b is None else a - b, sign="+")

    print(f"\nadded by the gateway: p50 {added(50)} ms, p99 {added(99)} ms")


def most_streams(s: BenchSettings, gateway_url: str) -> None:
    """Streams opened over 2 s and held at once, more each time, until one fails."""
    print(
        "\nstreams opened over 2 s and held at once through the gateway (40 chunks, 250 ms apart):"
    )
    rows = []
    for n in [int(x) for x in s.max_streams.split(",") if x]:
        start = time.perf_counter()
        completed, errors, peak = asyncio.run(hold_streams(gateway_url, n, 40, 2.0))
        kinds = ", ".join(f"{k} x{v}" for k, v in errors.items()) or "-"
        rows.append([str(n), str(peak), str(completed), str(errors.total()), kinds,
                     f"{time.perf_counter() - start:.1f}"])  # fmt: skip
        if errors:
            break
    print(table(["streams", "peak open", "completed", "errors", "kinds", "wall s"], rows))
    held = [int(r[1]) for r in rows if r[3] == "0"]
    print(f"\nmost concurrent streams held without errors: {max(held) if held else 0}")
