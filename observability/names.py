"""Metric and label names the dashboards, rules and Prometheus configuration use.

The runtime's and gateway's names come from their own modules (ARCHITECTURE.md is the
contract); the operator's are spelled here until the operator exports them from a module
of its own, and the autoscaler's ``signal`` label values are the ones it must emit.
"""

from __future__ import annotations

from conveyor.gateway import metrics as gateway_metrics
from conveyor.runtime import metrics_names as runtime

# Labels that Prometheus adds while scraping (relabelled from the pod; ARCHITECTURE.md).
NAMESPACE = "namespace"
LLMSERVICE = "llmservice"
POD = "pod"
COMPONENT = "component"
MODEL = runtime.MODEL_LABEL

# Runtime (histograms without their _bucket/_sum/_count suffix).
TTFT = runtime.TIME_TO_FIRST_TOKEN
TPOT = runtime.TIME_PER_OUTPUT_TOKEN
ITL = runtime.INTER_TOKEN_LATENCY
E2E = runtime.E2E_REQUEST_LATENCY
QUEUE_TIME = runtime.REQUEST_QUEUE_TIME
RUNNING = runtime.NUM_REQUESTS_RUNNING
WAITING = runtime.NUM_REQUESTS_WAITING
KV_CACHE_USAGE = runtime.KV_CACHE_USAGE
PREFIX_QUERIES = runtime.PREFIX_CACHE_QUERIES
PREFIX_HITS = runtime.PREFIX_CACHE_HITS
PROMPT_TOKENS = runtime.PROMPT_TOKENS
GENERATION_TOKENS = runtime.GENERATION_TOKENS
PREEMPTIONS = runtime.NUM_PREEMPTIONS
REQUEST_SUCCESS = runtime.REQUEST_SUCCESS
STEP_DURATION = runtime.ENGINE_STEP_DURATION
"""Exported by Conveyor's replicas only: what tells one apart from a vLLM replica."""

# Gateway.
GW_REQUESTS = gateway_metrics.REQUESTS_TOTAL
GW_DURATION = gateway_metrics.REQUEST_DURATION
GW_TTFT = gateway_metrics.TIME_TO_FIRST_TOKEN
GW_RETRIES = gateway_metrics.RETRIES_TOTAL
GW_EJECTIONS = gateway_metrics.EJECTIONS_TOTAL
GW_IN_FLIGHT = gateway_metrics.BACKEND_IN_FLIGHT
GW_BACKEND_LOAD = gateway_metrics.BACKEND_LOAD
GW_DECISIONS = gateway_metrics.ROUTING_DECISIONS_TOTAL
GW_PENDING = gateway_metrics.PENDING_REQUESTS

# Operator and autoscaler (labels namespace, llmservice; ARCHITECTURE.md).
AS_DESIRED = "conveyor_autoscaler_desired_replicas"
AS_READY = "conveyor_autoscaler_ready_replicas"
AS_MIN = "conveyor_autoscaler_min_replicas"
AS_MAX = "conveyor_autoscaler_max_replicas"
AS_SIGNAL = "conveyor_autoscaler_signal"
AS_TARGET = "conveyor_autoscaler_target"
AS_DECISIONS = "conveyor_autoscaler_decisions_total"
RECONCILE = "conveyor_reconcile_total"

# Values of the autoscaler's ``signal`` label.
SIGNAL_QUEUE_DEPTH = "queue_depth_per_replica"
SIGNAL_TTFT_P95 = "ttft_p95_seconds"
SIGNAL_KV_CACHE = "kv_cache_usage"
SIGNALS = (SIGNAL_QUEUE_DEPTH, SIGNAL_TTFT_P95, SIGNAL_KV_CACHE)
# The capacity-sized decision's estimates (same label; NaN while none sizes the decision).
SIGNAL_DEMAND_RPS = "demand_requests_per_second"
SIGNAL_DEMAND_TPS = "demand_tokens_per_second"
SIGNAL_CAPACITY_RPS = "capacity_requests_per_second"
SIGNAL_CAPACITY_TPS = "capacity_tokens_per_second"
SIGNAL_UTILIZATION = "utilization"
SIGNAL_REPLICAS_NEEDED = "replicas_needed"
