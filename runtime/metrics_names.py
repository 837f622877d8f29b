"""Names of the runtime's Prometheus metrics and of its ``/load`` fields (torch-free).

ARCHITECTURE.md is the contract; the gateway, the operator, the dashboards and
the tests import the names from here instead of spelling them again.
"""

from __future__ import annotations

from conveyor.contracts.engine_load import VLLM

MODEL_LABEL = "model"
"""Every runtime metric carries the served model name under this label."""
FINISH_REASON_LABEL = "finish_reason"

# Histograms (seconds).
TIME_TO_FIRST_TOKEN = "conveyor_time_to_first_token_seconds"
TIME_PER_OUTPUT_TOKEN = "conveyor_time_per_output_token_seconds"
INTER_TOKEN_LATENCY = "conveyor_inter_token_latency_seconds"
E2E_REQUEST_LATENCY = "conveyor_e2e_request_latency_seconds"
REQUEST_QUEUE_TIME = "conveyor_request_queue_time_seconds"

# Gauges.
NUM_REQUESTS_RUNNING = "conveyor_num_requests_running"
NUM_REQUESTS_WAITING = "conveyor_num_requests_waiting"
KV_CACHE_USAGE = "conveyor_kv_cache_usage_ratio"
LORA_REQUESTS_INFO = "conveyor_lora_requests_info"
"""LoRA adapters in use (labels ``running_lora_adapters``, ``waiting_lora_adapters``, comma
separated, and ``max_lora``), valued at the scrape's Unix time, as vLLM's series the Gateway
API Inference Extension's endpoint picker reads for LoRA affinity."""
LORA_LABELS = ("max_lora", "running_lora_adapters", "waiting_lora_adapters")

# Counters (the names as exposed, with their ``_total`` suffix).
PREFIX_CACHE_QUERIES = "conveyor_prefix_cache_queries_total"
PREFIX_CACHE_HITS = "conveyor_prefix_cache_hits_total"
PROMPT_TOKENS = "conveyor_prompt_tokens_total"
GENERATION_TOKENS = "conveyor_generation_tokens_total"
NUM_PREEMPTIONS = "conveyor_num_preemptions_total"
REQUEST_SUCCESS = "conveyor_request_success_total"

# Where the server's own time goes (beyond ARCHITECTURE.md's list; used by the benchmarks to
# show that tokenising and detokenising stay small next to an engine step).
ENGINE_STEP_DURATION = "conveyor_engine_step_duration_seconds"
TOKENIZE_DURATION = "conveyor_tokenize_duration_seconds"
DETOKENIZE_DURATION = "conveyor_detokenize_duration_seconds"

# ``GET /load``: the JSON document the gateway polls.
LOAD_FIELDS: tuple[str, ...] = (
    "running",
    "waiting",
    "kv_cache_usage",
    "max_running_requests",
    "max_queued_requests",
    "ready",
)

# vLLM's names of the same series (``conveyor serve --vllm-metrics``; the dashboards' recording
# rules read a vLLM replica's series by them too): its families and labels, checked against a
# real vLLM 0.32 scrape (tests/unit/exposition/vllm-0.32.0-cpu.txt).
VLLM_NAMES: dict[str, str] = {
    TIME_TO_FIRST_TOKEN: VLLM.ttft,
    TIME_PER_OUTPUT_TOKEN: "vllm:request_time_per_output_token_seconds",
    INTER_TOKEN_LATENCY: "vllm:inter_token_latency_seconds",
    E2E_REQUEST_LATENCY: "vllm:e2e_request_latency_seconds",
    REQUEST_QUEUE_TIME: "vllm:request_queue_time_seconds",
    NUM_REQUESTS_RUNNING: VLLM.running,
    NUM_REQUESTS_WAITING: VLLM.waiting,
    KV_CACHE_USAGE: VLLM.kv_cache_usage,
    LORA_REQUESTS_INFO: "vllm:lora_requests_info",
    PREFIX_CACHE_QUERIES: "vllm:prefix_cache_queries_total",
    PREFIX_CACHE_HITS: "vllm:prefix_cache_hits_total",
    PROMPT_TOKENS: VLLM.prompt_tokens,
    GENERATION_TOKENS: VLLM.generation_tokens,
    NUM_PREEMPTIONS: "vllm:num_preemptions_total",
    REQUEST_SUCCESS: VLLM.requests,
}
VLLM_LABELS: dict[str, str] = {MODEL_LABEL: "model_name", FINISH_REASON_LABEL: "finished_reason"}
"""vLLM's names of the labels; it adds ``engine``, its engine core's index (``"0"``)."""
