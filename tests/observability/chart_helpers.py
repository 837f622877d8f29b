"""Run the real helm on the chart (shared by tests/observability and e2e/test_chart.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import yaml

from conveyor.observability.chart import CHART

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "ha-watched-namespaces": {
        "operator": {
            "replicas": 2,
            "watchNamespaces": ["team-a", "team-b"],
            "nodeSelector": {"kubernetes.io/os": "linux"},
            "tolerations": [
                {"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}
            ],
            "resources": {
                "requests": {"cpu": "200m", "memory": "300Mi"},
                "limits": {"cpu": "1", "memory": "1Gi"},
            },
            "extraArgs": ["--resync-interval", "30"],
        },
        "image": {
            "repository": "registry.example.com/conveyor",
            "tag": "1.2.3",
            "pullPolicy": "Always",
        },
        "runtime": {"image": "registry.example.com/conveyor-cuda:1.2.3"},
        "gateway": {"replicas": 2, "routing": "least-load", "apiKeySecret": "gateway-key"},
    },
    "minimal-no-monitoring": {
        "operator": {"leaderElection": {"enabled": False}},
        "rbac": {"create": False},
        "serviceAccount": {"create": False, "name": "existing"},
        "monitoring": {
            "scrapeAnnotations": False,
            "podMonitor": {"enabled": False},
            "prometheusRule": {"enabled": False},
            "dashboards": {"enabled": False},
        },
    },
    "with-llmservices": {
        "llmServices": [{"name": "tiny", "spec": {"model": {"builtin": "conveyor-tiny"}}}],
        "monitoring": {"dashboards": {"namespace": "monitoring"}},
    },
}
VALUE_SETS["examples/values-gpu-cluster.yaml"] = yaml.safe_load(
    (CHART.parents[1] / "examples" / "values-gpu-cluster.yaml").read_text()
)
"""Value sets the chart is rendered with (and, in e2e, dry-run applied to the apiserver)."""


def helm_template(
    helm: Path,
    values: dict[str, Any],
    *,
    namespace: str = "conveyor-system",
    api_versions: tuple[str, ...] = (),
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    argv = [
        str(helm),
        "template",
        "conveyor",
        str(CHART),
        "--namespace",
        namespace,
        "--values",
        "-",
    ]
    for version in api_versions:
        argv += ["--api-versions", version]
    proc = subprocess.run(argv, input=json.dumps(values), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm template failed: {proc.stderr}")
    return proc


def documents(rendered: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(rendered) if d]


def kinds(docs: list[dict[str, Any]]) -> list[str]:
    return sorted(d["kind"] for d in docs)
