"""Part ``routing`` of ``conveyor bench gateway``: the routing policies side by side on a
multi-turn shared-prefix chat workload (see ``command``)."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import aiohttp
import httpx
from prometheus_client.parser import text_string_to_metric_families

from conveyor.bench.gateway import processes
from conveyor.bench.gateway.settings import MODEL, BenchSettings
from conveyor.bench.gateway.table import table
from conveyor.bench.procs import start_all
from conveyor.bench.stats import percentile
from conveyor.runtime.metrics_names import PREFIX_CACHE_HITS, PREFIX_CACHE_QUERIES


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


def _ms(value: float | None) -> str:
    return "nan" if value is None else f"{value * 1000:.0f}"


def bench_routing(s: BenchSettings) -> None:
    print(
        f"\n== routing: {s.replicas} replicas x {s.max_total_tokens} KV tokens, {s.users} users x "
        f"{s.turns} turns; working set ~{s.users * (s.system_chars + s.document_chars + 2 * s.turns * s.turn_chars)} "
        f"tokens ==",
        flush=True,
    )
    replicas = [processes.replica(s.num_threads, s.max_total_tokens) for _ in range(s.replicas)]
    rows = []
    try:
        start_all(replicas)
        for policy in ("round-robin", "least-load", "prefix-aware"):
            gateway = processes.gateway([r.url for r in replicas], "--routing", policy).start()
            try:
                processes.wait_admitted(gateway, len(replicas))
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
                _ms(percentile(ttfts, 50)),
                _ms(percentile(ttfts, 95)),
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
