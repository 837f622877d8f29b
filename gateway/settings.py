"""The gateway's settings: one dataclass, parsed once from the command line in ``cli.main``."""

from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import dataclass, field
from typing import Any

ROUTING_POLICIES = ("prefix-aware", "least-load", "round-robin")


@dataclass(frozen=True)
class GatewaySettings:
    host: str = "0.0.0.0"
    """Address to listen on; all interfaces, as a pod behind a Service needs."""

    port: int = 8080
    """Port to listen on; 8080 is the gateway's port everywhere (ARCHITECTURE.md)."""

    routing: str = "prefix-aware"
    """Default routing policy of every pool: prefix-aware, least-load or round-robin."""

    backends: tuple[str, ...] = ()
    """Static replicas, ``URL`` or ``MODEL=URL``; without MODEL the names come from the replica's /v1/models."""

    backends_file: str | None = None
    """File with one backend per line (same syntax as --backend, ``#`` comments), re-read when it changes."""

    discovery_interval_s: float = 1.0
    """Seconds between checks of the backends file and of replicas whose model names are not known yet."""

    k8s_namespace: str | None = None
    """Namespace whose EndpointSlices are watched; turns Kubernetes discovery on."""

    k8s_service: str | None = None
    """Service whose EndpointSlices are the replicas (label kubernetes.io/service-name)."""

    k8s_selector: str | None = None
    """Label selector for EndpointSlices, instead of --k8s-service."""

    k8s_llmservices: bool = False
    """One pool per LLMService in --k8s-namespace (model and routing from each, replicas from its
    EndpointSlices): how the operator runs the namespace's shared gateway."""

    k8s_model: str | None = None
    """Model name the Kubernetes pool serves; without it, read from the replicas' /v1/models."""

    k8s_port_name: str | None = None
    """EndpointSlice port name to use; without it, the slice's first port."""

    load_poll_interval_s: float = 0.2
    """Seconds between /load polls of one replica; 200 ms keeps the picture fresh at negligible cost."""

    load_poll_timeout_s: float = 1.0
    """Per-replica /load timeout in seconds; a replica slower than this is treated as failed."""

    load_stale_after_s: float = 1.0
    """Age in seconds after which a replica's load is unknown (ranked behind known ones), not idle.
    A load a response's header carried (Conveyor replicas send it) stands in for /load polls
    for half of it, so the replica is polled before that load goes stale."""

    connect_timeout_s: float = 2.0
    """Seconds to connect to a replica before trying another; short, as a pod is local to the cluster."""

    upstream_timeout_s: float = 600.0
    """Longest silence in seconds from a replica before its request is tried elsewhere (before
    the first byte) or ended: until the response head, no new engine step in its load reports
    (or no report, from engines that do not count steps; a whole answer's head comes once it is
    generated); after it, no chunk of a stream while the gateway waits on the replica (a slow
    client is not its silence)."""

    client_stall_timeout_s: float = 600.0
    """Longest a stream's next chunk may wait on a client that reads nothing before its request
    is dropped (aborted on the replica, its slot freed); a client that never reads cannot hold
    a replica's batch slot for good."""

    max_attempts: int = 3
    """Replicas tried for one request before the error goes to the client (retries happen before the first byte)."""

    retry_backoff_s: float = 0.02
    """Base backoff in seconds between attempts, doubled each time; short because the next try is another replica."""

    ejection_s: float = 5.0
    """Seconds a replica that failed a request is skipped, unless a /load poll started after the failure succeeds."""

    bounded_load_factor: float = 1.25
    """prefix-aware: a replica takes at most this factor above the mean load (1.25 as in the bounded-loads paper)."""

    prefix_block_chars: int = 128
    """prefix-aware: characters per hashed block of the prompt, roughly 32 tokens."""

    prefix_max_blocks: int = 32
    """prefix-aware: leading blocks that make the routing key (4 KiB of text by default)."""

    ring_vnodes: int = 100
    """prefix-aware: points per replica on the hash ring; 100 keeps shares within a few percent."""

    api_keys: tuple[str, ...] = field(default=(), repr=False)
    """Accepted bearer tokens; empty means no authentication. Never logged."""

    backend_api_key: str | None = field(default=None, repr=False)
    """Bearer token sent to replicas started with --api-key. Never logged."""

    max_body_bytes: int = 8 * 1024 * 1024
    """Largest request body accepted (413 above); 8 MiB fits a long context in JSON with room to spare."""

    retry_after_s: int = 1
    """Retry-After in seconds on 503 (no ready replica) and 429 (every replica's queue full)."""

    hold_timeout_s: float = 120.0
    """Seconds a request waits while its model has no ready replica (scale from zero: a pod
    starts and loads its model) before a 503 with Retry-After; 0 refuses at once."""

    max_held_requests: int = 1000
    """Requests held at once per model while it has no ready replica; more get a 503 with
    Retry-After at once, so a burst against a sleeping model cannot exhaust the gateway."""

    queue_at_gateway: bool = False
    """Hold requests at the gateway while every ready replica of their model has its batch
    full and --replica-queue requests waiting, and send each to the first replica with room
    (as Knative's activator or llm-d's flow control): by vLLM's ``priority`` field (lower
    first, as a replica started with --scheduling-policy priority runs them; not for a pool
    with SGLang replicas, which read it otherwise), then in arrival order. A replica added by
    a scale-up then takes the first held requests at once, where otherwise they wait on the
    replica they were sent to. Held requests count toward the model's --max-held-requests and
    --hold-timeout, and no more are held than the replicas' own queue bounds add up to: past
    it a request that comes before the last held (a lower priority value) takes its place and
    the last gets the 429, as vLLM's priority scheduling preempts the last in its order;
    otherwise the new request gets it. With --workers, each process keeps its own queue."""

    replica_queue: int = 1
    """With --queue-at-gateway: requests let wait on a replica beyond its batch (at least 1,
    so that a finished request's slot is refilled at the replica's next step, not a round trip
    later)."""

    log_level: str = "info"
    """Log level of the gateway and uvicorn."""

    workers: int = 1
    """Processes serving the one port, for when one core is the limit (uvicorn's supervisor
    restarts one that dies). Each routes alike (same ring, same replicas' /load) but counts
    only its own in-flight requests and holds its own --max-held-requests; /metrics sums
    them all (prometheus_client's multiprocess mode)."""


SETTINGS_ENV = "CONVEYOR_GATEWAY_SETTINGS"
"""How the settings reach worker processes (``--workers``): JSON in the environment."""


def settings_to_json(settings: GatewaySettings) -> str:
    return json.dumps(dataclasses.asdict(settings))


def settings_from_json(text: str) -> GatewaySettings:
    values: dict[str, Any] = {
        k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(text).items()
    }
    return GatewaySettings(**values)


def setting_docs() -> dict[str, str]:
    """Each setting's docstring, for ``--help``: one place says what a setting means."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(GatewaySettings))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
        ):
            docs[node.target.id] = str(after.value.value)
    return docs
