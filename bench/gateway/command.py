"""``conveyor bench gateway``: routing policies side by side, and the gateway's own overhead.

Part ``routing``: several runtime replicas (built-in model, small KV caches) behind one
gateway per policy, a multi-turn shared-prefix chat workload (every user has a shared
system prompt, a long private document in the first message, and a growing conversation).
The working set of all conversations exceeds one replica's KV cache but fits in all of
them, which is when routing decides the cache hit rate. Each policy gets fresh text, so
no policy inherits another's cache. Prints TTFT p50/p95, throughput, the prefix-cache hit
rate from the replicas' /metrics and the spread of requests over replicas.

Part ``overhead``: a minimal streaming server (``conveyor.bench.gateway.stub``), reached directly and
through the gateway at the same concurrency: added TTFT and end-to-end latency; then
N streams held open at once through the gateway, for growing N, counting errors.

Figures only; nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
from prometheus_client.parser import text_string_to_metric_families

from conveyor.runtime.metrics_names import PREFIX_CACHE_HITS, PREFIX_CACHE_QUERIES

MODEL = "conveyor-tiny"


@dataclass(frozen=True)
class BenchSettings:
    part: str = "all"
    """routing, overhead or all."""
    replicas: int = 3
    """Runtime replicas for the routing part; few, as they share the machine's cores."""
    max_total_tokens: int = 4096
    """KV cache of each replica in tokens; the users' working set must exceed one, fit in all."""
    users: int = 6
    """Concurrent users of the routing part, each with its own conversation."""
    turns: int = 5
    """Turns per user."""
    system_chars: int = 400
    """Shared system prompt length (the built-in model's tokenizer is byte-level: chars = tokens)."""
    document_chars: int = 900
    """Private document each user sends in the first message."""
    turn_chars: int = 80
    """Each later question; the canned assistant answer is as long."""
    max_tokens: int = 8
    """Output tokens per routing request: short, so prefill (what the cache saves) dominates."""
    num_threads: int = 1
    """Torch threads per runtime replica."""
    overhead_concurrency: int = 200
    """Streams held open while the added latency is measured."""
    overhead_requests: int = 500
    """Probe requests per path (direct, through the gateway) for the added-latency figure."""
    max_streams: str = "250,500,1000,2000"
    """Numbers of streams held open at once through the gateway, tried in order."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Child:
    """One process the benchmark owns; its log is kept and shown when it fails."""

    def __init__(self, name: str, argv: list[str], port: int) -> None:
        self.name, self.argv, self.port = name, argv, port
        self.url = f"http://127.0.0.1:{port}"
        fd, path = tempfile.mkstemp(prefix=f"conveyor-bench-{name}-", suffix=".log")
        os.close(fd)
        self.log_path = Path(path)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Child:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    def wait_ready(self, path: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + path, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(0.1)
        raise RuntimeError(
            f"{self.name} not ready after {timeout}s:\n{self.log_path.read_text()[-3000:]}"
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log_path.unlink(missing_ok=True)


def conveyor(*args: str) -> list[str]:
    return [sys.executable, "-m", "conveyor.cli", *args]


def gateway_child(backends: list[str], *extra: str) -> Child:
    port = free_port()
    argv = conveyor("gateway", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                    *[a for b in backends for a in ("--backend", b)], *extra)  # fmt: skip
    return Child(f"gateway-{port}", argv, port)


def wait_admitted(gateway: Child, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pools = httpx.get(gateway.url + "/debug/pools", timeout=5).json()
        if sum(r["admitted"] for pool in pools.values() for r in pool["replicas"]) >= count:
            return
        time.sleep(0.1)
    raise RuntimeError(f"gateway did not admit {count} replicas in {timeout}s")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "-" * len(line)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


# Part (a): routing policies --------------------------------------------------------------


def prefix_cache_counters(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    queries = hits = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == PREFIX_CACHE_QUERIES:
                queries += sample.value
            elif sample.name == PREFIX_CACHE_HITS:
                hits += sample.value
    return queries, hits


def words(rng: random.Random, chars: int) -> str:
    vocabulary = ["conveyor", "belt", "token", "cache", "replica", "gateway", "model", "queue",
                  "prefix", "block", "route", "stream", "batch", "kernel", "pod", "node"]  # fmt: skip
    out: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(vocabulary)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:chars]


async def run_user(
    session: aiohttp.ClientSession, url: str, s: BenchSettings, system: str, user: int, salt: str
) -> list[tuple[float, float, str]]:
    """One user's conversation, turn after turn: (TTFT, end-to-end, backend) per turn."""
    rng = random.Random(f"{salt}-{user}")
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": f"[{salt} user {user}] " + words(rng, s.document_chars)},
    ]
    results = []
    for turn in range(s.turns):
        body = {"model": MODEL, "messages": messages, "stream": True, "max_tokens": s.max_tokens,
                "temperature": 0.0}  # fmt: skip
        start = time.perf_counter()
        ttft = None
        async with session.post(url + "/v1/chat/completions", json=body) as response:
            if response.status != 200:
                raise RuntimeError(
                    f"routing request failed: {response.status} {await response.text()}"
                )
            backend = response.headers.get("x-conveyor-backend", "")
            async for _chunk in response.content.iter_any():
                if ttft is None:
                    ttft = time.perf_counter() - start
        results.append((ttft or 0.0, time.perf_counter() - start, backend))
        messages += [
            {"role": "assistant", "content": f"answer {turn}: " + words(rng, s.turn_chars)},
            {"role": "user", "content": f"question {turn + 1}: " + words(rng, s.turn_chars)},
        ]
    return results


async def run_policy(
    url: str, s: BenchSettings, salt: str
) -> tuple[list[tuple[float, float, str]], float]:
    system = f"[{salt}] You are a helpful assistant. " + words(random.Random(salt), s.system_chars)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        start = time.perf_counter()
        per_user = await asyncio.gather(
            *(run_user(session, url, s, system, user, salt) for user in range(s.users))
        )
        return [r for user in per_user for r in user], time.perf_counter() - start


def bench_routing(s: BenchSettings) -> None:
    print(
        f"\n== routing: {s.replicas} replicas x {s.max_total_tokens} KV tokens, {s.users} users x "
        f"{s.turns} turns; working set ~{s.users * (s.system_chars + s.document_chars + 2 * s.turns * s.turn_chars)} "
        f"tokens ==",
        flush=True,
    )
    replicas = []
    for _ in range(s.replicas):
        port = free_port()
        argv = conveyor("serve", "--model", MODEL, "--host", "127.0.0.1", "--port", str(port),
                        "--num-threads", str(s.num_threads), "--max-total-tokens", str(s.max_total_tokens),
                        "--log-level", "warning")  # fmt: skip
        replicas.append(Child(f"runtime-{port}", argv, port))
    rows = []
    try:
        for replica in replicas:
            replica.start()
        for replica in replicas:
            replica.wait_ready("/ready", 300)
        for policy in ("round-robin", "least-load", "prefix-aware"):
            gateway = gateway_child([r.url for r in replicas], "--routing", policy).start()
            try:
                gateway.wait_ready("/health", 60)
                wait_admitted(gateway, len(replicas))
                before = [prefix_cache_counters(r.url) for r in replicas]
                results, wall = asyncio.run(run_policy(gateway.url, s, salt=policy))
                after = [prefix_cache_counters(r.url) for r in replicas]
            finally:
                gateway.stop()
            queries = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
            hits = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
            ttfts = [r[0] for r in results]
            per_replica = Counter(r[2] for r in results)
            counts = [per_replica.get(r.url, 0) for r in replicas]
            rows.append([
                policy,
                f"{percentile(ttfts, 50) * 1000:.0f}",
                f"{percentile(ttfts, 95) * 1000:.0f}",
                f"{len(results) / wall:.2f}",
                f"{len(results) * s.max_tokens / wall:.1f}",
                f"{hits / queries:.1%}" if queries else "n/a",
                f"{max(counts)}/{min(counts)}",
                f"{max(counts) / max(1, min(counts)):.2f}",
            ])  # fmt: skip
            print(f"  {policy}: done in {wall:.1f}s", flush=True)
    finally:
        for replica in replicas:
            replica.stop()
    print()
    print(table(
        ["policy", "TTFT p50 ms", "TTFT p95 ms", "req/s", "out tok/s", "prefix hit", "max/min req", "ratio"],
        rows,
    ))  # fmt: skip
    base = {r[0]: r for r in rows}
    rr, pa = base["round-robin"], base["prefix-aware"]
    print(
        f"\nprefix-aware vs round-robin: TTFT p50 {float(rr[1]) / max(1e-9, float(pa[1])):.2f}x lower, "
        f"throughput {float(pa[3]) / max(1e-9, float(rr[3])):.2f}x"
    )


# Part (b): gateway overhead ---------------------------------------------------------------


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
    stub_port = free_port()
    stub = Child(f"stub-{stub_port}", [sys.executable, "-m", "conveyor.bench.gateway.stub",
                 "--port", str(stub_port), "--token-interval-ms", "250"], stub_port)  # fmt: skip
    # A generous connect timeout: on a shared 2-core machine the stub, not the gateway, is
    # slow to accept thousands of connections at once.
    gateway = gateway_child([stub.url], "--routing", "least-load", "--connect-timeout", "10")
    try:
        stub.start()
        stub.wait_ready("/load", 60)
        gateway.start()
        gateway.wait_ready("/health", 60)
        wait_admitted(gateway, 1)
        asyncio.run(closed_loop(stub.url, 20, 200, 1))  # warm both paths up
        asyncio.run(closed_loop(gateway.url, 20, 200, 1))
        rows = []
        results = {}
        for name, url in (
            ("direct", stub.url),
            ("gateway", gateway.url),
            ("direct (again)", stub.url),
        ):
            ttfts, broken = asyncio.run(
                probe_under_load(url, s.overhead_concurrency, s.overhead_requests)
            )
            results[name] = ttfts
            rows.append(
                [name, *(f"{percentile(ttfts, q) * 1000:.2f}" for q in (50, 90, 99)), str(broken)]
            )
        print(f"TTFT of {s.overhead_requests} sequential probes while {s.overhead_concurrency} streams "
              "(a chunk every 250 ms each) stay open on the same path:")  # fmt: skip
        print(table(["path", "p50 ms", "p90 ms", "p99 ms", "broken streams"], rows))
        direct = results["direct"] + results["direct (again)"]
        via = results["gateway"]
        print(
            f"\nadded by the gateway: p50 {(percentile(via, 50) - percentile(direct, 50)) * 1000:+.2f} ms, "
            f"p99 {(percentile(via, 99) - percentile(direct, 99)) * 1000:+.2f} ms"
        )

        print(
            "\nstreams opened over 2 s and held at once through the gateway (40 chunks, 250 ms apart):"
        )
        rows = []
        for n in [int(x) for x in s.max_streams.split(",") if x]:
            start = time.perf_counter()
            completed, errors, peak = asyncio.run(hold_streams(gateway.url, n, 40, 2.0))
            kinds = ", ".join(f"{k} x{v}" for k, v in errors.items()) or "-"
            rows.append([str(n), str(peak), str(completed), str(errors.total()), kinds,
                         f"{time.perf_counter() - start:.1f}"])  # fmt: skip
            if errors:
                break
        print(table(["streams", "peak open", "completed", "errors", "kinds", "wall s"], rows))
        held = [int(r[1]) for r in rows if r[3] == "0"]
        print(f"\nmost concurrent streams held without errors: {max(held) if held else 0}")
    finally:
        for child in (gateway, stub):
            child.stop()


def _field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal under it in the class body), by name."""
    import ast
    import inspect
    import itertools
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for field, doc in itertools.pairwise(body):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(field.target, ast.Name)
            and isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant)
        ):
            docs[field.target.id] = " ".join(str(doc.value.value).split()).rstrip(".")
    return docs


def main(argv: list[str]) -> int:
    defaults = BenchSettings()
    parser = argparse.ArgumentParser(
        prog="conveyor bench gateway", description=__doc__.split("\n\n")[0]
    )
    docs = _field_docs(BenchSettings)
    for name, default in vars(defaults).items():
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=type(default),
            default=default,
            help=f"{docs[name]} (default {default})",
        )
    s = BenchSettings(**vars(parser.parse_args(argv)))
    if s.part not in ("routing", "overhead", "all"):
        print("conveyor bench gateway: --part must be routing, overhead or all", file=sys.stderr)
        return 2
    if s.part in ("routing", "all"):
        bench_routing(s)
    if s.part in ("overhead", "all"):
        bench_overhead(s)
    return 0
