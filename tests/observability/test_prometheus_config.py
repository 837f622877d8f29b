"""The Prometheus configuration: Kubernetes discovery and relabelling as ARCHITECTURE.md says."""

from __future__ import annotations

from pathlib import Path

from conveyor.observability.prometheus import (
    PrometheusSettings,
    StaticTarget,
    prometheus_config,
)


def _by_action(relabel: list[dict]) -> dict[str, str]:
    return {
        r.get("target_label", ""): r["source_labels"][0] for r in relabel if "target_label" in r
    }


def test_kubernetes_discovery_relabels_to_namespace_llmservice_and_pod() -> None:
    config = prometheus_config(
        PrometheusSettings(
            binary=Path("prometheus"), kubeconfig=Path("/k/config"), namespaces=("a",)
        )
    )
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"conveyor", "conveyor-operator"}
    sd = jobs["conveyor"]["kubernetes_sd_configs"][0]
    assert sd == {"role": "pod", "kubeconfig_file": "/k/config", "namespaces": {"names": ["a"]}}
    labels = _by_action(jobs["conveyor"]["relabel_configs"])
    assert labels["namespace"] == "__meta_kubernetes_namespace"
    assert labels["pod"] == "__meta_kubernetes_pod_name"
    assert labels["llmservice"] == "__meta_kubernetes_pod_label_conveyor_dev_llmservice"
    assert labels["__metrics_path__"] == "__meta_kubernetes_pod_annotation_prometheus_io_path"
    keeps = [r for r in jobs["conveyor"]["relabel_configs"] if r.get("action") == "keep"]
    assert {
        "__meta_kubernetes_pod_annotation_prometheus_io_scrape",
        "__meta_kubernetes_pod_phase",
    } <= {r["source_labels"][0] for r in keeps}
    # the operator's own series name LLMServices' namespaces: its labels win
    assert jobs["conveyor-operator"]["honor_labels"] is True
    assert "honor_labels" not in jobs["conveyor"]


def test_static_targets_carry_the_labels_discovery_would_give() -> None:
    config = prometheus_config(
        PrometheusSettings(
            binary=Path("prometheus"),
            scrape_interval_s=1,
            static_targets=(StaticTarget("127.0.0.1:9", "ns", "tiny-0", "runtime", "tiny"),),
        )
    )
    (job,) = config["scrape_configs"]
    assert job["static_configs"] == [
        {
            "targets": ["127.0.0.1:9"],
            "labels": {
                "namespace": "ns",
                "pod": "tiny-0",
                "component": "runtime",
                "llmservice": "tiny",
            },
        }
    ]
    assert config["global"]["scrape_interval"] == "1000ms"
