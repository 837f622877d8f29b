"""vLLM's and SGLang's series recorded under Conveyor's names, checked by Prometheus' own rule
evaluation (``promtool test rules`` on the chart's rules file): a vLLM or SGLang replica's
series become the series every panel and alert reads, with Conveyor's labels, and the
LLMService's TTFT quantiles are recorded from them as from Conveyor's."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from conveyor.contracts.engine_load import SGLANG, VLLM
from conveyor.observability import names as n
from conveyor.observability.engine_series import (
    ENGINE_COUNTERS,
    ENGINE_GAUGES,
    ENGINE_HISTOGRAMS,
    engine_rules,
)
from conveyor.observability.rules import quantile_record

RULES_FILE = Path(__file__).resolve().parents[2] / "charts/conveyor/files/prometheus-rules.yaml"
VLLM_TEXT = Path(__file__).resolve().parents[1] / "unit/exposition/vllm-0.32.0-cpu.txt"
SCRAPE = 'namespace="team",llmservice="svc",pod="svc-0",job="pods"'
OURS = '{job="pods", llmservice="svc", model="tiny", namespace="team", pod="svc-0"}'


def test_every_mapped_vllm_series_is_in_a_real_vllm_scrape() -> None:
    text = VLLM_TEXT.read_text()
    declared = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    theirs = [*ENGINE_GAUGES["vllm"].values(), *ENGINE_HISTOGRAMS["vllm"].values()]
    theirs += list(ENGINE_COUNTERS["vllm"].values())
    assert set(theirs) <= declared, set(theirs) - declared
    # what the dashboards read of the runtime is mapped for vLLM, all of it
    assert set(ENGINE_GAUGES["vllm"]) == {n.RUNNING, n.WAITING, n.KV_CACHE_USAGE}
    assert n.TTFT in ENGINE_HISTOGRAMS["vllm"] and n.TTFT in ENGINE_HISTOGRAMS["sglang"]


def test_prometheus_records_engine_series_under_conveyors_names(
    promtool: Path, tmp_path: Path
) -> None:
    vllm = f'{SCRAPE},engine="0",model_name="tiny"'
    sglang = 'namespace="team",llmservice="sg",pod="sg-0",job="pods",model_name="tiny",tp_rank="0",pp_rank="0",engine_type="unified"'
    conveyor = 'namespace="team",llmservice="cv",pod="cv-0",job="pods"'
    series = [
        {"series": f"{VLLM.waiting}{{{vllm}}}", "values": "3x10"},
        {"series": f"{VLLM.running}{{{vllm}}}", "values": "2x10"},
        {"series": f"{VLLM.kv_cache_usage}{{{vllm}}}", "values": "0.25x10"},
        {"series": f'{VLLM.requests}{{{vllm},finished_reason="stop"}}', "values": "0+6x10"},
        {"series": f'{VLLM.ttft}_bucket{{{vllm},le="0.1"}}', "values": "0+60x10"},
        {"series": f'{VLLM.ttft}_bucket{{{vllm},le="1"}}', "values": "0+120x10"},
        {"series": f'{VLLM.ttft}_bucket{{{vllm},le="+Inf"}}', "values": "0+120x10"},
        {"series": f"{SGLANG.waiting}{{{sglang}}}", "values": "5x10"},
        # a Conveyor replica with --vllm-metrics: its own series, and vLLM's names of them
        {"series": f'{n.WAITING}{{{conveyor},model="tiny"}}', "values": "7x10"},
        {"series": f'{VLLM.waiting}{{{conveyor},engine="0",model_name="tiny"}}', "values": "7x10"},
        {"series": f'{n.STEP_DURATION}_count{{{conveyor},model="tiny"}}', "values": "0+9x10"},
    ]
    at = "5m"
    tests = {
        "rule_files": [str(RULES_FILE)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "promql_expr_test": [
                    {
                        "expr": n.WAITING,
                        "eval_time": at,
                        "exp_samples": [
                            {"labels": f"{n.WAITING}{OURS}", "value": 3},
                            {
                                "labels": f'{n.WAITING}{{job="pods", llmservice="sg", model="tiny", namespace="team", pod="sg-0"}}',
                                "value": 5,
                            },
                            {  # its own, once: not recorded again from its vLLM names
                                "labels": f'{n.WAITING}{{job="pods", llmservice="cv", model="tiny", namespace="team", pod="cv-0"}}',
                                "value": 7,
                            },
                        ],
                    },
                    {
                        "expr": n.KV_CACHE_USAGE,
                        "eval_time": at,
                        "exp_samples": [{"labels": f"{n.KV_CACHE_USAGE}{OURS}", "value": 0.25}],
                    },
                    {
                        "expr": f"rate({n.REQUEST_SUCCESS}[5m])",
                        "eval_time": at,
                        "exp_samples": [
                            {
                                "labels": '{finish_reason="stop", job="pods", llmservice="svc", model="tiny", namespace="team", pod="svc-0"}',
                                "value": 0.1,
                            }
                        ],
                    },
                    {
                        # half the first tokens under 0.1 s, all under 1 s: p50 at 0.1 s
                        "expr": quantile_record(n.TTFT, "p50", "5m"),
                        "eval_time": at,
                        "exp_samples": [
                            {
                                "labels": f'{quantile_record(n.TTFT, "p50", "5m")}{{llmservice="svc", namespace="team"}}',
                                "value": 0.1,
                            }
                        ],
                    },
                ],
            }
        ],
    }
    test_file = tmp_path / "engines_test.yaml"
    test_file.write_text(yaml.safe_dump(tests, sort_keys=False))
    proc = subprocess.run(
        [str(promtool), "test", "rules", str(test_file)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_chart_carries_the_engine_rules() -> None:
    recording = yaml.safe_load(RULES_FILE.read_text())["groups"][0]["rules"]
    assert recording[: len(engine_rules())] == engine_rules()
