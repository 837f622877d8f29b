"""The Helm chart with the real helm: lint, templates under several value sets, the schema."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from chart_helpers import VALUE_SETS, documents, helm_template, kinds

from conveyor.observability import dashboards
from conveyor.observability.chart import CHART
from conveyor.operator import rbac

MONITORING = ("monitoring.coreos.com/v1",)


def test_helm_lint_strict_is_clean(helm: Path) -> None:
    for values in VALUE_SETS.values():
        proc = subprocess.run(
            [str(helm), "lint", "--strict", str(CHART), "--values", "-"],
            input=json.dumps(values),
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_templates_render_as_valid_objects(helm: Path, name: str) -> None:
    for api_versions in ((), MONITORING):
        docs = documents(helm_template(helm, VALUE_SETS[name], api_versions=api_versions).stdout)
        for doc in docs:
            assert doc["apiVersion"] and doc["kind"] and doc["metadata"]["name"]
            assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == "conveyor"


def test_cluster_role_is_the_operators_one_list(helm: Path) -> None:
    docs = documents(helm_template(helm, {}).stdout)
    (role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    assert sorted(map(json.dumps, role["rules"])) == sorted(map(json.dumps, rbac.OPERATOR_RULES))
    (lease,) = [d for d in docs if d["kind"] == "Role"]
    assert lease["rules"] == rbac.LEASE_RULES
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert "--leader-election" in container["args"]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert (
        annotations["prometheus.io/scrape"] == "true"
        and annotations["prometheus.io/port"] == "8081"
    )


def test_watched_namespaces_bind_the_rules_in_each(helm: Path) -> None:
    docs = documents(helm_template(helm, VALUE_SETS["ha-watched-namespaces"]).stdout)
    bindings = [
        d for d in docs if d["kind"] == "RoleBinding" and d["roleRef"]["kind"] == "ClusterRole"
    ]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ClusterRole"}
    rules = [r for role in roles.values() for r in role["rules"]]
    assert sorted(map(json.dumps, rules)) == sorted(map(json.dumps, rbac.OPERATOR_RULES))
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert {"--namespace=team-a", "--namespace=team-b", "--gateway-routing=least-load"} <= set(args)
    assert "--runtime-image=registry.example.com/conveyor-cuda:1.2.3" in args
    assert deployment["spec"]["replicas"] == 2


def test_monitoring_objects_only_where_the_api_exists(helm: Path) -> None:
    without = kinds(documents(helm_template(helm, {}).stdout))
    assert "PodMonitor" not in without and "PrometheusRule" not in without
    docs = documents(helm_template(helm, {}, api_versions=MONITORING).stdout)
    assert kinds(docs).count("PodMonitor") == 2
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    rules_file = yaml.safe_load((CHART / "files" / "prometheus-rules.yaml").read_text())
    assert rule["spec"] == rules_file
    off = VALUE_SETS["minimal-no-monitoring"]
    assert not {"PodMonitor", "PrometheusRule", "ConfigMap"} & set(
        kinds(documents(helm_template(helm, off, api_versions=MONITORING).stdout))
    )


def test_dashboards_are_configmaps_for_the_grafana_sidecar(helm: Path) -> None:
    docs = documents(helm_template(helm, VALUE_SETS["with-llmservices"]).stdout)
    maps = [d for d in docs if d["kind"] == "ConfigMap"]
    assert len(maps) == len(dashboards.BUILDERS)
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["namespace"] == "monitoring"
        ((name, text),) = cm["data"].items()
        assert text + "\n" == dashboards.all_json()[name]
    (svc,) = [d for d in docs if d["kind"] == "LLMService"]
    assert svc["metadata"]["namespace"] == "conveyor-system"
    assert svc["spec"] == {"model": {"builtin": "conveyor-tiny"}}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"operator": {"replicas": "two"}}, "/operator/replicas"),
        ({"operator": {"replicas": -1}}, "/operator/replicas"),
        ({"gateway": {"routing": "random"}}, "prefix-aware"),
        ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
        ({"operator": {"replicaCount": 2}}, "replicaCount"),
        ({"llmServices": [{"name": "Bad_Name", "spec": {}}]}, "/llmServices/0/name"),
        ({"llmServices": [{"name": "no-spec"}]}, "spec"),
        ({"operator": {"watchNamespaces": ["UPPER"]}}, "/operator/watchNamespaces/0"),
        ({"operator": {"replicas": 2, "leaderElection": {"enabled": False}}}, "leaderElection"),
    ],
)
def test_wrong_values_are_refused_with_a_message(helm: Path, values: dict, message: str) -> None:
    proc = helm_template(helm, values, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr
