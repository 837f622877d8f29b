"""The settings of ``conveyor bench gateway``: one field per command-line option."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

MODEL = "conveyor-tiny"
"""The model every runtime replica of the routing part serves."""


@dataclass(frozen=True)
class BenchSettings:
    part: str = "all"
    """Parts to run, comma-separated: overhead, routing, grow (a replica joins mid-run), or all."""
    peers: str = ""
    """Rust routers measured side by side with the gateway, comma-separated: vllm-router,
    sglang-router (installed pinned into a cached environment on first use); empty: the
    gateway alone."""
    replicas: int = 4
    """Runtime replicas for the routing part; few, as they share the machine's cores."""
    max_total_tokens: int = 16384
    """KV cache of each replica in tokens; the users' working set must exceed one, fit in all
    (in all but one too, for the grow part)."""
    users: int = 32
    """Concurrent users of the routing part, each with its own conversation: enough that how
    evenly a policy spreads conversations shows (8 over 4 replicas is noise)."""
    seed: int = 0
    """Seed of the workload's text (each run salts it with its proxy and policy, so none
    inherits another's cache): the same figures' workload from one bench to the next."""
    turns: int = 5
    """Turns per user."""
    system_chars: int = 200
    """Shared system prompt length (the built-in model's tokenizer is byte-level: chars = tokens)."""
    document_chars: int = 800
    """Private document each user sends in the first message; the shared part of a first
    request stays under a quarter of it, as the routers' cache_aware sends every request
    whose text matches a worker's tree over 30 per cent (their default) to that worker."""
    turn_chars: int = 40
    """Each later question; the canned assistant answer is as long."""
    max_tokens: int = 8
    """Output tokens per routing request: short, so prefill (what the cache saves) dominates."""
    rounds: int = 3
    """Rounds of the routing part (each runs every proxy once on fresh text) and of the
    overhead part's added latency (each probes every path), in an order rotated each round,
    so load from other work on the machine falls on every proxy alike; the tables show the
    median over rounds and its range."""
    policies: str = "prefix-aware,least-load,round-robin"
    """The gateway's routing policies measured in the routing and grow parts, comma-separated
    (the report's row is prefix-aware's; least-load and round-robin show what routing by
    prefix is worth)."""
    num_threads: int = 1
    """Torch threads per runtime replica."""
    replica_cpus: float = 0.0
    """CPUs each runtime replica may use (a cgroup CPU quota, as a pod's limits.cpu), so that
    replicas are separate units of capacity as GPUs are, and a busy replica cannot borrow an
    idle one's cores (which would reward piling conversations on one); 0: 80 per cent of the
    machine's CPUs shared out, at most one each; negative: no limit."""
    overhead_concurrency: str = "16,200"
    """Streams held open (a chunk every 250 ms each) while the added latency is measured,
    comma-separated: one measurement per number."""
    overhead_requests: int = 200
    """Probes per kind (non-streamed, streamed) per path and round for the added latency."""
    gateway_workers: str = "1,2"
    """The gateway's worker processes (``--workers``) in the overhead part, comma-separated:
    one path per number (``conveyor``, ``conveyor-x2``, ...); the routing part runs one."""
    max_streams: str = "1000,2000,4000"
    """Numbers of streams held open at once through each path, tried in order until one fails."""
    plot: str = os.path.join(tempfile.gettempdir(), "gateway-bench.png")
    """PNG of the side-by-side figures (empty: none); by default in the temp directory
    ($TMPDIR, else /tmp), not the directory the bench runs in (a checkout's root)."""


def replica_cpu_limit(s: BenchSettings, cpus: int | None = None) -> float | None:
    """``--replica-cpus`` resolved: the CPU limit of each runtime replica, None for none."""
    if s.replica_cpus < 0:
        return None
    if s.replica_cpus > 0:
        return s.replica_cpus
    return round(min(1.0, 0.8 * (cpus or os.cpu_count() or 1) / max(1, s.replicas)), 2)
