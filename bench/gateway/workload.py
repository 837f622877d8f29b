"""The multi-turn shared-prefix chat workload of ``conveyor bench gateway``'s routing phases,
and the replica counters that say where it went.

Every user has the shared system prompt, a private document in the first message and a
growing conversation; all users start at once and send each turn when the last one ended.
The text comes from ``--seed`` and a salt per run (the proxy and policy), so a run is the
same from one bench to the next and never inherits another run's cache.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import httpx
from prometheus_client.parser import text_string_to_metric_families

from conveyor.bench.gateway.settings import MODEL, BenchSettings
from conveyor.gateway.sse import has_token
from conveyor.runtime.metrics_names import (
    PREFIX_CACHE_HITS,
    PREFIX_CACHE_QUERIES,
    REQUEST_QUEUE_TIME,
    REQUEST_SUCCESS,
    TIME_TO_FIRST_TOKEN,
)

BACKEND_HEADER = "x-conveyor-backend"
"""The replica the gateway sent a request to (the Rust routers do not say)."""


@dataclass(frozen=True)
class Counters:
    """One replica's counters at one instant, from its /metrics."""

    queries: float
    """Prompt tokens looked up in the prefix cache."""
    hits: float
    """Prompt tokens found there."""
    requests: float
    """Requests finished."""
    ttft_s: float = 0.0
    """Sum of the replica's own TTFTs (arrival at the replica to first token), seconds."""
    ttft_n: float = 0.0
    queue_s: float = 0.0
    """Sum of the replica's queue times (arrival to first scheduled), seconds."""
    queue_n: float = 0.0


_COUNTED = {
    PREFIX_CACHE_QUERIES: "queries",
    PREFIX_CACHE_HITS: "hits",
    REQUEST_SUCCESS: "requests",
    TIME_TO_FIRST_TOKEN + "_sum": "ttft_s",
    TIME_TO_FIRST_TOKEN + "_count": "ttft_n",
    REQUEST_QUEUE_TIME + "_sum": "queue_s",
    REQUEST_QUEUE_TIME + "_count": "queue_n",
}


def replica_counters(url: str) -> Counters:
    text = httpx.get(url + "/metrics", timeout=10).text
    totals = dict.fromkeys(_COUNTED.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _COUNTED:
                totals[_COUNTED[sample.name]] += sample.value
    return Counters(**totals)


def all_counters(urls: list[str]) -> list[Counters]:
    return [replica_counters(u) for u in urls]


def hit_rate(before: list[Counters], after: list[Counters]) -> float:
    """Prefix-cache hit rate over the replicas between two snapshots (same order)."""
    queries = sum(a.queries - b.queries for a, b in zip(after, before, strict=True))
    hits = sum(a.hits - b.hits for a, b in zip(after, before, strict=True))
    return hits / queries if queries else 0.0


def requests_each(before: list[Counters], after: list[Counters]) -> list[float]:
    return [a.requests - b.requests for a, b in zip(after, before, strict=True)]


def replica_means(before: list[Counters], after: list[Counters]) -> tuple[float, float]:
    """The replicas' own mean TTFT and mean queue time between two snapshots, seconds: what
    the replicas spent, whichever proxy sent the requests."""
    pairs = list(zip(after, before, strict=True))
    ttft_n = sum(a.ttft_n - b.ttft_n for a, b in pairs)
    queue_n = sum(a.queue_n - b.queue_n for a, b in pairs)
    ttft = sum(a.ttft_s - b.ttft_s for a, b in pairs) / ttft_n if ttft_n else 0.0
    queue = sum(a.queue_s - b.queue_s for a, b in pairs) / queue_n if queue_n else 0.0
    return ttft, queue


@dataclass(frozen=True)
class Turn:
    """One request of the workload as the client saw it."""

    user: int
    turn: int
    ttft: float
    """Request sent to the first event that carries a token, seconds."""
    e2e: float
    prompt_tokens: int | None
    """From the stream's usage event (None: the proxy passed none on)."""
    cached_tokens: int | None
    """Prompt tokens the replica found in its prefix cache."""
    backend: str | None
    """The replica, where the proxy says (the gateway's ``x-conveyor-backend``)."""


def missed_turns(turns: list[Turn]) -> tuple[int, int]:
    """(turns after a conversation's first that found less than half of the previous turn's
    prompt cached, turns after the first with usage known): each such turn went to a replica
    that did not hold its conversation, or whose cache had evicted it."""
    prompts = {(t.user, t.turn): t.prompt_tokens for t in turns}
    missed = known = 0
    for t in turns:
        previous = prompts.get((t.user, t.turn - 1))
        if t.turn == 0 or previous is None or t.cached_tokens is None:
            continue
        known += 1
        missed += t.cached_tokens < previous / 2
    return missed, known


def moved_turns(turns: list[Turn]) -> int | None:
    """Turns sent to another replica than the conversation's previous turn (None: the
    proxy does not say where it sent them)."""
    where = {(t.user, t.turn): t.backend for t in turns}
    if any(b is None for b in where.values()):
        return None
    return sum(t.turn > 0 and where.get((t.user, t.turn - 1)) != t.backend for t in turns)


def _usage(stream: bytes) -> tuple[int | None, int | None]:
    """(prompt tokens, cached prompt tokens) from the last usage event of an SSE stream."""
    for event in reversed(stream.split(b"\n\n")):
        data = event.strip().removeprefix(b"data:").strip()
        if b'"usage"' not in data or not data.startswith(b"{"):
            continue
        usage = json.loads(data).get("usage")
        if isinstance(usage, dict):
            details = usage.get("prompt_tokens_details") or {}
            return usage.get("prompt_tokens"), details.get("cached_tokens")
    return None, None


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
) -> list[Turn]:
    """One user's conversation, turn after turn; ``finished`` is called after each turn.

    TTFT is the time to the first event that carries a token: a chat stream opens with a
    role-only event, sent before prefill, which the Rust routers pass on at once and the
    gateway holds back (so it can still retry); counting it would time the opening event.
    Each request carries ``x-session-id``: vllm-router's consistent_hash keys on it (it
    hashes the whole, ever-changing, text otherwise); the others ignore it. Each asks for
    the usage event (``stream_options``), whose cached tokens say whether the turn met its
    conversation's prefix.
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
                "temperature": 0.0, "stream_options": {"include_usage": True}}  # fmt: skip
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
            backend = response.headers.get(BACKEND_HEADER)
            async for chunk in response.content.iter_any():
                received += chunk
                if ttft is None and has_token(received):
                    ttft = time.perf_counter() - start
        e2e = time.perf_counter() - start
        results.append(Turn(user, turn, ttft or 0.0, e2e, *_usage(received), backend))
        finished()
        messages += [
            {"role": "assistant", "content": f"answer {turn}: " + words(rng, s.turn_chars)},
            {"role": "user", "content": f"question {turn + 1}: " + words(rng, s.turn_chars)},
        ]
    return results


async def run_workload(
    url: str, s: BenchSettings, salt: str, finished: Callable[[int], None] = lambda done: None
) -> tuple[list[Turn], float]:
    """Every user's conversation through ``url`` at once: each request as the client saw it
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
