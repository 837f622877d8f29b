"""Part ``routing`` of ``conveyor bench gateway``: routing policies side by side on a
multi-turn shared-prefix chat workload over runtime replicas (see ``command``)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
from prometheus_client.parser import text_string_to_metric_families

from conveyor.bench.gateway import processes
from conveyor.bench.gateway.routers import RustRouter
from conveyor.bench.gateway.settings import MODEL, BenchSettings
from conveyor.bench.gateway.table import table
from conveyor.bench.procs import ChildProcess, start_all
from conveyor.bench.stats import percentile
from conveyor.gateway.sse import has_token
from conveyor.runtime.metrics_names import PREFIX_CACHE_HITS, PREFIX_CACHE_QUERIES, REQUEST_SUCCESS

CONVEYOR_POLICIES = ("round-robin", "least-load", "prefix-aware")


def replica_counters(url: str) -> tuple[float, float, float]:
    """(prefix-cache queries, hits, requests finished) from a replica's /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    totals = dict.fromkeys((PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS, REQUEST_SUCCESS), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals[PREFIX_CACHE_QUERIES], totals[PREFIX_CACHE_HITS], totals[REQUEST_SUCCESS]


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
) -> list[tuple[float, float]]:
    """One user's conversation, turn after turn: (TTFT, end-to-end) per turn.

    TTFT is the time to the first event that carries a token: a chat stream opens with a
    role-only event, sent before prefill, which the Rust routers pass on at once and the
    gateway holds back (so it can still retry); counting it would time the opening event.
    Each request carries ``x-session-id``: vllm-router's consistent_hash keys on it (it
    hashes the whole, ever-changing, text otherwise); the others ignore it.
    """
    rng = random.Random(f"{salt}-{user}")
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": f"[{salt} user {user}] " + words(rng, s.document_chars)},
    ]
    results = []
    headers = {"x-session-id": f"{salt}-user-{user}"}
    for turn in range(s.turns):
        body = {"model": MODEL, "messages": messages, "stream": True, "max_tokens": s.max_tokens,
                "temperature": 0.0}  # fmt: skip
        start = time.perf_counter()
        ttft = None
        received = b""
        async with session.post(
            url + "/v1/chat/completions", json=body, headers=headers
        ) as response:
            if response.status != 200:
                raise RuntimeError(
                    f"routing request failed: {response.status} {await response.text()}"
                )
            async for chunk in response.content.iter_any():
                if ttft is None:
                    received += chunk
                    if has_token(received):
                        ttft = time.perf_counter() - start
        results.append((ttft or 0.0, time.perf_counter() - start))
        messages += [
            {"role": "assistant", "content": f"answer {turn}: " + words(rng, s.turn_chars)},
            {"role": "user", "content": f"question {turn + 1}: " + words(rng, s.turn_chars)},
        ]
    return results


async def run_workload(
    url: str, s: BenchSettings, salt: str
) -> tuple[list[tuple[float, float]], float]:
    system = f"[{salt}] You are a helpful assistant. " + words(random.Random(salt), s.system_chars)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        start = time.perf_counter()
        per_user = await asyncio.gather(
            *(run_user(session, url, s, system, user, salt) for user in range(s.users))
        )
        return [r for user in per_user for r in user], time.perf_counter() - start


@dataclass(frozen=True)
class RoutingRun:
    """One proxy with one policy in front of the replicas."""

    proxy: str
    """``conveyor`` or a Rust router's name."""
    policy: str
    start: Callable[[list[str]], ChildProcess]
    """Starts the proxy in front of the replica URLs (ready when it returns)."""

    @property
    def label(self) -> str:
        return f"{self.proxy} {self.policy}"


def routing_runs(peers: list[tuple[RustRouter, Path]]) -> list[RoutingRun]:
    """The gateway's three policies, then each router's cache-aware policy (and vllm-router's
    consistent hashing)."""

    def conveyor(policy: str) -> Callable[[list[str]], ChildProcess]:
        def start(urls: list[str]) -> ChildProcess:
            gateway = processes.gateway(urls, "--routing", policy).start()
            processes.wait_admitted(gateway, len(urls))
            return gateway

        return start

    def router(r: RustRouter, venv: Path, policy: str) -> Callable[[list[str]], ChildProcess]:
        return lambda urls: processes.rust_router(r, venv, urls, policy).start()

    runs = [RoutingRun("conveyor", p, conveyor(p)) for p in CONVEYOR_POLICIES]
    for r, venv in peers:
        for policy in ("cache_aware", "consistent_hash"):
            if policy in r.policies:
                runs.append(RoutingRun(r.name, policy, router(r, venv, policy)))
    return runs


def _ms(value: float | None) -> str:
    return "nan" if value is None else f"{value * 1000:.0f}"


def bench_routing(
    s: BenchSettings, peers: list[tuple[RustRouter, Path]]
) -> dict[str, dict[str, float]]:
    """Each run's figures by label: TTFT p50/p95 (s), req/s, prefix hit rate, max/min."""
    working_set = s.users * (s.system_chars + s.document_chars + 2 * s.turns * s.turn_chars)
    print(f"\n== routing (runtime replicas, {MODEL}): {s.replicas} replicas x "
          f"{s.max_total_tokens} KV tokens, {s.users} users x {s.turns} turns; working set "
          f"~{working_set} tokens ==", flush=True)  # fmt: skip
    replicas = [processes.replica(s.num_threads, s.max_total_tokens) for _ in range(s.replicas)]
    print("  (each proxy with its defaults but the policy; the routers' cache_aware sends a request"
          "\n   to the worker whose tree matches over --cache-threshold 0.3 of its text, and balances"
          "\n   only once loads differ by over 64 requests)", flush=True)  # fmt: skip
    figures: dict[str, dict[str, float]] = {}
    rows = []
    try:
        start_all(replicas)
        urls = [r.url for r in replicas]
        for run in routing_runs(peers):
            proxy = run.start(urls)
            try:
                before = [replica_counters(u) for u in urls]
                results, wall = asyncio.run(run_workload(proxy.url, s, salt=run.label))
                after = [replica_counters(u) for u in urls]
            finally:
                proxy.stop()
            queries = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
            hits = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
            counts = [a[2] - b[2] for a, b in zip(after, before, strict=True)]
            ttfts = [r[0] for r in results]
            f = figures[run.label] = {
                "ttft_p50": percentile(ttfts, 50) or 0.0,
                "ttft_p95": percentile(ttfts, 95) or 0.0,
                "req_s": len(results) / wall,
                "tok_s": len(results) * s.max_tokens / wall,
                "hit": hits / queries if queries else 0.0,
                "max_req": max(counts),
                "min_req": min(counts),
                "spread": max(counts) / max(1.0, min(counts)),
            }
            rows.append([
                run.label, _ms(f["ttft_p50"]), _ms(f["ttft_p95"]), f"{f['req_s']:.2f}",
                f"{f['tok_s']:.1f}", f"{f['hit']:.1%}", f"{max(counts):.0f}/{min(counts):.0f}",
                f"{f['spread']:.2f}",
            ])  # fmt: skip
            print(f"  {run.label}: done in {wall:.1f}s", flush=True)
    finally:
        for replica in replicas:
            replica.stop()
    print()
    print(table(
        ["proxy policy", "TTFT p50 ms", "TTFT p95 ms", "req/s", "out tok/s", "prefix hit",
         "max/min req", "ratio"],
        rows,
    ))  # fmt: skip
    return figures
