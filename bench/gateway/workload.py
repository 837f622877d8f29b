"""The multi-turn shared-prefix chat workload of ``conveyor bench gateway``'s routing phases,
and the replica counters that say where it went.

Every user has the shared system prompt, a private document in the first message and a
growing conversation; all users start at once and send each turn when the last one ended.
The text comes from ``--seed`` and a salt per run (the proxy and policy), so a run is the
same from one bench to the next and never inherits another run's cache.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import httpx
from prometheus_client.parser import text_string_to_metric_families

from conveyor.bench.gateway.settings import MODEL, BenchSettings
from conveyor.gateway.sse import has_token
from conveyor.runtime.metrics_names import PREFIX_CACHE_HITS, PREFIX_CACHE_QUERIES, REQUEST_SUCCESS


@dataclass(frozen=True)
class Counters:
    """One replica's counters at one instant, from its /metrics."""

    queries: float
    """Prompt tokens looked up in the prefix cache."""
    hits: float
    """Prompt tokens found there."""
    requests: float
    """Requests finished."""


def replica_counters(url: str) -> Counters:
    text = httpx.get(url + "/metrics", timeout=10).text
    totals = dict.fromkeys((PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS, REQUEST_SUCCESS), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return Counters(
        totals[PREFIX_CACHE_QUERIES], totals[PREFIX_CACHE_HITS], totals[REQUEST_SUCCESS]
    )


def all_counters(urls: list[str]) -> list[Counters]:
    return [replica_counters(u) for u in urls]


def hit_rate(before: list[Counters], after: list[Counters]) -> float:
    """Prefix-cache hit rate over the replicas between two snapshots (same order)."""
    queries = sum(a.queries - b.queries for a, b in zip(after, before, strict=True))
    hits = sum(a.hits - b.hits for a, b in zip(after, before, strict=True))
    return hits / queries if queries else 0.0


def requests_each(before: list[Counters], after: list[Counters]) -> list[float]:
    return [a.requests - b.requests for a, b in zip(after, before, strict=True)]


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
    session: aiohttp.ClientSession,
    url: str,
    s: BenchSettings,
    system: str,
    user: int,
    salt: str,
    finished: Callable[[], None],
) -> list[tuple[float, float]]:
    """One user's conversation, turn after turn: (TTFT, end-to-end) per turn; ``finished``
    is called after each turn.

    TTFT is the time to the first event that carries a token: a chat stream opens with a
    role-only event, sent before prefill, which the Rust routers pass on at once and the
    gateway holds back (so it can still retry); counting it would time the opening event.
    Each request carries ``x-session-id``: vllm-router's consistent_hash keys on it (it
    hashes the whole, ever-changing, text otherwise); the others ignore it.
    """
    rng = random.Random(f"{s.seed}-{salt}-{user}")
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
        finished()
        messages += [
            {"role": "assistant", "content": f"answer {turn}: " + words(rng, s.turn_chars)},
            {"role": "user", "content": f"question {turn + 1}: " + words(rng, s.turn_chars)},
        ]
    return results


async def run_workload(
    url: str, s: BenchSettings, salt: str, finished: Callable[[int], None] = lambda done: None
) -> tuple[list[tuple[float, float]], float]:
    """Every user's conversation through ``url`` at once: (TTFT, end-to-end) of each request
    and the wall time. ``finished`` is called with the number of requests done so far after
    each one."""
    rng = random.Random(f"{s.seed}-{salt}")
    system = f"[{salt}] You are a helpful assistant. " + words(rng, s.system_chars)
    done = 0

    def one_finished() -> None:
        nonlocal done
        done += 1
        finished(done)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        start = time.perf_counter()
        per_user = await asyncio.gather(
            *(
                run_user(session, url, s, system, user, salt, one_finished)
                for user in range(s.users)
            )
        )
        return [r for user in per_user for r in user], time.perf_counter() - start


def working_set(s: BenchSettings) -> int:
    """Tokens of every conversation at its last turn (the tokenizer is byte-level)."""
    return s.system_chars + s.users * (s.document_chars + 2 * s.turns * s.turn_chars)
