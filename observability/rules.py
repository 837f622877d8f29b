"""Prometheus recording and alerting rules, as one rules file.

The same ``groups:`` document serves Prometheus without the Prometheus Operator (a
``rule_files`` entry) and the chart's PrometheusRule (its ``spec``): the chart carries the
generated file (``charts/conveyor/files/prometheus-rules.yaml``) and both read it.

Alerts join runtime series (labelled ``namespace``/``llmservice`` by the scrape's
relabelling) with the operator's autoscaler series (labelled ``namespace``/``llmservice`` by
the operator itself, kept with ``honor_labels``).
"""

from __future__ import annotations

from typing import Any

import yaml

from conveyor.observability import names as n
from conveyor.observability.engine_series import engine_rules

WINDOWS = ("1m", "5m")
QUANTILES = {"p50": 0.5, "p95": 0.95, "p99": 0.99}
SERVICE = "namespace, llmservice"

KV_CACHE_FULL = 0.95
"""Above this KV-cache usage new requests wait for blocks and running ones get preempted."""
ERROR_RATIO = 0.01
"""Share of 5xx answers over which users notice (1%)."""
FOR = "5m"
"""How long a condition must hold before its alert fires: long enough to ride out a burst."""


def bucket_rate(histogram: str, window: str) -> str:
    """Name of the recorded per-LLMService bucket rate of ``histogram`` over ``window``."""
    return f"namespace_llmservice:{histogram}_bucket:rate{window}"


def quantile_record(histogram: str, q: str, window: str) -> str:
    """Name of the recorded ``q`` (p50, p95, p99) of ``histogram`` per LLMService over ``window``."""
    return f"namespace_llmservice:{histogram}:{q}_{window}"


ERROR_RATIO_RECORD = "namespace_model:conveyor_gateway_requests:error_ratio_5m"


def recording_rules() -> list[dict[str, Any]]:
    # vLLM's and SGLang's series under Conveyor's names first: the rules below (evaluated in
    # order, in the same group) and every panel and alert then cover an LLMService of any engine.
    rules: list[dict[str, Any]] = engine_rules()
    for histogram in (n.TTFT, n.TPOT):
        for window in WINDOWS:
            rules.append(
                {
                    "record": bucket_rate(histogram, window),
                    "expr": f"sum by ({SERVICE}, le) (rate({histogram}_bucket[{window}]))",
                }
            )
            for q, value in QUANTILES.items():
                rules.append(
                    {
                        "record": quantile_record(histogram, q, window),
                        "expr": f"histogram_quantile({value}, {bucket_rate(histogram, window)})",
                    }
                )
    rules.append(
        {
            "record": ERROR_RATIO_RECORD,
            "expr": (
                f'sum by (namespace, model) (rate({n.GW_REQUESTS}{{code=~"5.."}}[5m]))\n'
                f"/\nsum by (namespace, model) (rate({n.GW_REQUESTS}[5m]))"
            ),
        }
    )
    return rules


def _alert(name: str, expr: str, severity: str, summary: str, description: str) -> dict[str, Any]:
    return {
        "alert": name,
        "expr": expr,
        "for": FOR,
        "labels": {"severity": severity},
        "annotations": {"summary": summary, "description": description},
    }


WHERE = "LLMService {{ $labels.namespace }}/{{ $labels.llmservice }}"


def alerting_rules() -> list[dict[str, Any]]:
    ttft_p95 = quantile_record(n.TTFT, "p95", "5m")
    target = f'max by ({SERVICE}) ({n.AS_TARGET}{{signal="{n.SIGNAL_TTFT_P95}"}})'
    at_max = (
        f"max by ({SERVICE}) ({n.AS_DESIRED}) >= on ({SERVICE}) max by ({SERVICE}) ({n.AS_MAX})"
    )
    return [
        _alert(
            "ConveyorTTFTAboveTarget",
            f"{ttft_p95} > on ({SERVICE}) {target}",
            "warning",
            "Time to first token p95 is above the LLMService's target",
            f"{WHERE}: TTFT p95 over 5m is {{{{ $value | humanizeDuration }}}}, above its "
            "autoscaling target for 5 minutes. More replicas (raise maxReplicas) or a shorter "
            "queue bring it down.",
        ),
        _alert(
            "ConveyorKVCacheFull",
            f"max by ({SERVICE}, pod) ({n.KV_CACHE_USAGE}) > {KV_CACHE_FULL}",
            "warning",
            "A replica's KV cache is nearly full",
            f"{WHERE}: replica {{{{ $labels.pod }}}} has used {{{{ $value | humanizePercentage }}}} "
            "of its KV cache for 5 minutes; requests queue and get preempted. Give replicas "
            "more KV cache (maxTotalTokens, memFractionStatic) or lower maxRunningRequests.",
        ),
        _alert(
            "ConveyorQueueGrowingAtMaxReplicas",
            f"(sum by ({SERVICE}) (deriv({n.WAITING}[5m])) > 0)\n"
            f"and on ({SERVICE}) (sum by ({SERVICE}) ({n.WAITING}) > 0)\n"
            f"and on ({SERVICE}) ({at_max})",
            "critical",
            "Requests queue up and the autoscaler is at its maximum",
            f"{WHERE}: waiting requests keep growing while the autoscaler already asks for "
            "maxReplicas. Raise maxReplicas or add GPU nodes.",
        ),
        _alert(
            "ConveyorHighErrorRate",
            f"{ERROR_RATIO_RECORD} > {ERROR_RATIO}",
            "critical",
            "More than 1% of requests to a model fail",
            "Model {{ $labels.model }} in namespace {{ $labels.namespace }}: "
            "{{ $value | humanizePercentage }} of the gateway's answers were 5xx over the last "
            "5 minutes. Check the replicas' logs and the Gateway dashboard's ejections.",
        ),
        _alert(
            "ConveyorNoReadyReplica",
            f"(max by ({SERVICE}) ({n.AS_READY}) == 0)\n"
            f"and on ({SERVICE}) (max by ({SERVICE}) ({n.AS_DESIRED}) > 0)",
            "critical",
            "An LLMService has no ready replica",
            f"{WHERE} wants replicas but none has been ready for 5 minutes: requests to it "
            "fail. `kubectl describe llmservice` and the runtime pods' events say why "
            "(Pending for GPUs, a model that does not load).",
        ),
    ]


def rules_document() -> dict[str, Any]:
    """The rules file: a recording group and an alerting group."""
    return {
        "groups": [
            {"name": "conveyor.recording", "rules": recording_rules()},
            {"name": "conveyor.alerts", "rules": alerting_rules()},
        ]
    }


class _Literal(str):
    pass


def _literal(dumper: yaml.SafeDumper, value: _Literal) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|")


def _block_multiline(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _block_multiline(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_block_multiline(v) for v in value]
    if isinstance(value, str) and "\n" in value:
        return _Literal(value)
    return value


def rules_yaml() -> str:
    """The rules file's text (multi-line expressions as YAML block scalars)."""

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    Dumper.add_representer(_Literal, _literal)
    header = (
        "# Generated by conveyor.observability.rules (python -m conveyor.observability.chart);\n"
        "# do not edit by hand. A Prometheus rules file, and the spec of the chart's PrometheusRule.\n"
    )
    return header + yaml.dump(
        _block_multiline(rules_document()), Dumper=Dumper, sort_keys=False, width=1000
    )
