"""The settings of ``conveyor bench gateway``: one field per command-line option."""

from __future__ import annotations

from dataclasses import dataclass

MODEL = "conveyor-tiny"
"""The model every runtime replica of the routing part serves."""


@dataclass(frozen=True)
class BenchSettings:
    part: str = "all"
    """routing, overhead or all."""
    peers: str = ""
    """Rust routers measured side by side with the gateway, comma-separated: vllm-router,
    sglang-router (installed pinned into a cached environment on first use); empty: the
    gateway alone."""
    replicas: int = 4
    """Runtime replicas for the routing part; few, as they share the machine's cores."""
    max_total_tokens: int = 4096
    """KV cache of each replica in tokens; the users' working set must exceed one, fit in all."""
    users: int = 8
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
    plot: str = "gateway-bench.png"
    """PNG of the side-by-side figures (empty: none)."""
