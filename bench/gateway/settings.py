"""The settings of ``conveyor bench gateway``: one field per command-line option."""

from __future__ import annotations

from dataclasses import dataclass

MODEL = "conveyor-tiny"
"""The model every runtime replica of the routing part serves."""


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
