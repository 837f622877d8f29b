"""The settings of ``conveyor bench autoscale``: one field per command-line option."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MODEL = "bench"
"""The served model name of the benchmark's LLMService."""
NAME = "bench"
"""The benchmark's LLMService."""


@dataclass(frozen=True)
class BenchSettings:
    kubeconfig: Path | None = None
    """Cluster to use; unset: the one-machine cluster running here."""
    minutes: float = 10.0
    """Constant load after the step, over which direction changes are counted (target: none)."""
    step_factor: float = 2.0
    """Step load as a multiple of one replica's measured capacity."""
    capacity: str = "slo"
    """What one replica's capacity is: "slo", the highest open-loop rate it serves with client
    TTFT p95 under ``target_ttft_s``; "saturated", its closed-loop throughput with a queue."""
    replica_cpu: str = "250m"
    """limits.cpu of each replica: a fraction of a core, so a replica is a unit of capacity."""
    max_replicas: int = 4
    """maxReplicas of the benchmark's LLMService: room above the 2-3 a step needs, to see an
    overshoot."""
    target_queue: float = 2.0
    """targetQueueDepthPerReplica of the benchmark's LLMService."""
    target_ttft_s: float = 2.0
    """targetTTFTP95Seconds of the benchmark's LLMService."""
    interval_s: float = 1.0
    """The operator's --autoscale-interval."""
    scale_down_window_s: int = 300
    """scaleDownStabilizationSeconds of the benchmark's LLMService (the CRD's default)."""
    backlog_drain_s: float = 30.0
    """backlogDrainSeconds of the benchmark's LLMService (the CRD's default): what piles up
    while replicas start should be gone within this. Shorter asks for more replicas during a
    step (in the simulated services of tests/operator, 10 s took a 1.8x step to 4 replicas
    and drained its backlog 2-7 s sooner than 30 s, at 3)."""
    autoscaler_from_step: bool = False
    """Turn the autoscaler on only at the step. By default it runs from the start, held at one
    replica (maxReplicas 1) while that replica's capacity is measured, as the autoscaler of a
    running service has seen its replicas busy before a step; from the step alone it can
    measure only an overloaded replica."""
    gateway_queue: bool = False
    """Run the operator with ``--gateway-queue``: its gateways hold requests while every
    replica is full, so a replica a scale-up adds takes the oldest (the operator's default is
    off; this measures the two side by side)."""
    max_tokens: int = 24
    """max_tokens of each request: short, so one replica's capacity is many requests/s."""
    png: Path = Path("autoscale.png")
    """Where the chart of replicas, queue and TTFT p95 over time is written."""
    keep: bool = False
    """Keep the namespace afterwards (for a look with kubectl)."""
    progress_every_s: float = 10.0
    """Seconds between progress lines while load runs."""
    wake_only: bool = False
    """Skip capacity, step and constant load: measure only the wake from zero."""
