"""``conveyor serve --vllm-metrics``: the series vLLM has, also under vLLM's names and labels,
as a real vLLM 0.32 exports them (its scrape is kept in tests/unit/exposition), so that tools
written against vLLM's metrics read a Conveyor replica as they read vLLM."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from conveyor.bench.procs import ChildProcess
from conveyor.contracts.engine_load import VLLM, load_from_metrics
from conveyor.runtime import metrics_names as names

VLLM_TEXT = Path(__file__).resolve().parents[1] / "unit/exposition/vllm-0.32.0-cpu.txt"
MODEL = "conveyor-tiny"


def families(text: str) -> dict[str, tuple[str, set[str]]]:
    """Family name -> (type, the label names its samples carry, ``le`` aside)."""
    out = {}
    for family in text_string_to_metric_families(text):
        labels = {k for s in family.samples for k in s.labels} - {"le"}
        out[family.name] = (family.type, labels)
    return out


def test_the_vllm_names_are_vllms_own_types_and_labels(
    start_server: Callable[..., ChildProcess],
) -> None:
    server = start_server("--vllm-metrics")
    for _ in range(3):
        answer = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": MODEL, "prompt": "hello", "max_tokens": 4},
            timeout=60,
        )
        assert answer.status_code == 200
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    ours, theirs = families(text), families(VLLM_TEXT.read_text())
    for conveyor_name, vllm_name in names.VLLM_NAMES.items():
        if conveyor_name == names.LORA_REQUESTS_INFO:
            continue  # vLLM has it with LoRA on only: tests/server/test_lora_adapters.py
        family = vllm_name.removesuffix("_total")
        assert family in ours, f"{vllm_name} is missing"
        assert ours[family] == theirs[family], (family, ours[family], theirs[family])
        # Conveyor's own series stay as they were
        assert conveyor_name.removesuffix("_total") in ours

    def value(name: str, **labels: str) -> float:
        return sum(
            s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == name and labels.items() <= s.labels.items()
        )

    assert value(VLLM.requests, finished_reason="length", model_name=MODEL) == 3
    assert value(f"{VLLM.ttft}_count") == value(f"{names.TIME_TO_FIRST_TOKEN}_count") == 3
    assert value(VLLM.generation_tokens) == value(names.GENERATION_TOKENS) == 12
    # the gateway reads it as it reads a vLLM replica
    load = load_from_metrics(text, VLLM)
    assert (load.running, load.waiting) == (0, 0) and 0.0 <= load.kv_cache_usage <= 1.0


def test_without_the_flag_there_are_no_vllm_names(server: ChildProcess) -> None:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert "vllm:" not in text
