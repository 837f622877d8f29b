"""The Helm chart against the real apiserver: every value set's templates accepted by a
server-side dry run (PodMonitor and PrometheusRule against the Prometheus Operator's CRDs,
which the test installs), and NOTES.txt rendered by a real `helm install --dry-run`.

`helm install` / `upgrade` / `uninstall` run with the operator as a pod serving the example
LLMService through its gateway, on the one-machine cluster's nodes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from operator_helpers import REPO, llmservice_status, release_llmservices, wait_for

from conveyor.cluster import Cluster
from conveyor.cluster.testing import KubeUnderTest
from conveyor.cluster.tools import build_tools
from conveyor.observability.chart import CHART

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "observability"))
from chart_helpers import VALUE_SETS, helm_template

MONITORING_CRDS = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: podmonitors.monitoring.coreos.com}
spec:
  group: monitoring.coreos.com
  scope: Namespaced
  names: {kind: PodMonitor, listKind: PodMonitorList, plural: podmonitors, singular: podmonitor}
  versions:
    - name: v1
      served: true
      storage: true
      schema: {openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}}
---
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: prometheusrules.monitoring.coreos.com}
spec:
  group: monitoring.coreos.com
  scope: Namespaced
  names: {kind: PrometheusRule, listKind: PrometheusRuleList, plural: prometheusrules, singular: prometheusrule}
  versions:
    - name: v1
      served: true
      storage: true
      schema: {openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}}
"""
"""Stand-ins with the Prometheus Operator's names and an open schema: enough for the
apiserver to serve monitoring.coreos.com/v1, which is what the chart checks for."""


@pytest.fixture(scope="module")
def helm() -> Path:
    return build_tools(quiet=True).path("helm")


@pytest.fixture(scope="module")
def crds_installed(kube: KubeUnderTest) -> None:
    kube.kubectl("apply", "--server-side", "-f", str(CHART / "crds"))
    kube.kubectl("apply", "--server-side", "-f", "-", input_=MONITORING_CRDS)
    for name in ("llmservices.conveyor.dev", "podmonitors.monitoring.coreos.com",
                 "prometheusrules.monitoring.coreos.com"):  # fmt: skip
        kube.kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_templates_pass_a_server_side_dry_run(
    kube: KubeUnderTest, helm: Path, crds_installed: None, namespace: str, name: str
) -> None:
    values = VALUE_SETS[name]
    rendered = helm_template(
        helm, values, namespace=namespace, api_versions=("monitoring.coreos.com/v1",)
    ).stdout
    # the namespaces the value set names must exist for a dry run of objects in them
    for other in [*values.get("operator", {}).get("watchNamespaces", []), "monitoring"]:
        kube.kubectl("create", "namespace", other, check=False)
    proc = kube.kubectl("apply", "--dry-run=server", "-f", "-", input_=rendered, check=False)
    assert proc.returncode == 0, proc.stderr
    assert (
        "PodMonitor" in rendered and "PrometheusRule" in rendered
    ) or name == "minimal-no-monitoring"


def test_helm_install_dry_run_prints_the_notes(
    kube: KubeUnderTest, helm: Path, crds_installed: None, namespace: str
) -> None:
    proc = subprocess.run(
        [str(helm), "install", "conveyor", str(CHART), "--namespace", namespace,
         "--kubeconfig", str(kube.kubeconfig), "--dry-run=server"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "kubectl apply -f examples/llmservice.yaml" in notes
    assert "conveyor dashboard render" in notes


def test_helm_install_upgrade_uninstall(
    kube: KubeUnderTest, helm: Path, crds_installed: None, own_cluster: Cluster, namespace: str
) -> None:
    """The chart as users install it: the operator runs as a pod and serves an LLMService;
    an upgrade rolls the operator; uninstall leaves nothing of the release but the CRD."""
    import openai

    release = f"cv-{namespace[-6:]}"
    apps = f"{namespace[:50]}-apps"
    kube.kubectl("create", "namespace", apps)
    selector = f"app.kubernetes.io/instance={release}"

    def helm_run(verb: str, *extra: str) -> None:
        proc = subprocess.run(
            [str(helm), verb, release, *([str(CHART)] if verb != "uninstall" else []),
             "--namespace", namespace, "--kubeconfig", str(kube.kubeconfig), *extra],
            capture_output=True, text=True,
        )  # fmt: skip
        assert proc.returncode == 0, f"helm {verb}: {proc.stderr}"

    def operator_pods() -> list[dict[str, Any]]:
        return kube.api.get(f"/api/v1/namespaces/{namespace}/pods", labelSelector=selector)["items"]

    # Watch only the test's namespace; a gateway small enough for a node's share of the CPU.
    values = ("--set", f"operator.watchNamespaces={{{apps}}}",
              "--set", "operator.extraArgs={--gateway-cpu,200m}",
              "--wait", "--timeout", "5m")  # fmt: skip
    try:
        helm_run("install", *values)
        first = [p["metadata"]["name"] for p in operator_pods()]
        assert first, "helm install --wait returned without an operator pod"

        kube.kubectl("-n", apps, "apply", "-f", str(REPO / "examples" / "llmservice.yaml"))
        status = wait_for(
            "the example LLMService Ready, reconciled by the chart's operator",
            lambda: (
                (s := llmservice_status(kube.api, apps, "smollm2")).get("phase") == "Ready" and s
            ),
            timeout_s=600,
        )
        client = openai.OpenAI(
            base_url=f"http://{status['endpoint']['clusterIP']}:8080/v1",
            api_key="none", max_retries=0, timeout=60,
        )  # fmt: skip
        answer = wait_for(
            "an answer through the gateway",
            lambda: client.completions.create(model="smollm2", prompt="Hello", max_tokens=4),
            timeout_s=120,
        )
        assert answer.choices[0].text is not None

        # helm upgrade with a changed value rolls the operator's pod.
        helm_run("upgrade", *values, "--set", "operator.logLevel=debug")
        wait_for(
            "the upgraded operator pod Ready, the old one gone",
            lambda: (
                (pods := operator_pods())
                and all(p["metadata"]["name"] not in first for p in pods)
                and all(
                    c.get("ready") for p in pods for c in p["status"].get("containerStatuses", [])
                )
            ),
            timeout_s=300,
        )
        args = kube.api.get(
            f"/apis/apps/v1/namespaces/{namespace}/deployments", labelSelector=selector
        )["items"][0]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--log-level=debug" in args
        # The new operator still serves: a scale is acted on.
        kube.kubectl("-n", apps, "scale", "llmservice/smollm2", "--replicas=2")
        wait_for(
            "the upgraded operator to act on a scale",
            lambda: (
                kube.api.get(f"/apis/apps/v1/namespaces/{apps}/deployments/smollm2")["spec"][
                    "replicas"
                ]
                == 2
            ),
            timeout_s=120,
        )
        release_llmservices(kube, apps)
    finally:
        helm_run("uninstall", "--wait", "--timeout", "5m")
        kube.kubectl("delete", "namespace", apps, "--wait=false", check=False)

    left = [
        f"{kind}/{item['metadata']['name']}"
        for kind, path in [
            ("deployment", f"/apis/apps/v1/namespaces/{namespace}/deployments"),
            ("service", f"/api/v1/namespaces/{namespace}/services"),
            ("serviceaccount", f"/api/v1/namespaces/{namespace}/serviceaccounts"),
            ("configmap", f"/api/v1/namespaces/{namespace}/configmaps"),
            ("pod", f"/api/v1/namespaces/{namespace}/pods"),
            ("clusterrole", "/apis/rbac.authorization.k8s.io/v1/clusterroles"),
            ("clusterrolebinding", "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings"),
            ("role", f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles"),
            ("rolebinding", f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings"),
        ]
        for item in kube.api.get(path, labelSelector=selector)["items"]
        if not item["metadata"].get("deletionTimestamp")
    ]  # fmt: skip
    assert left == [], f"helm uninstall left {left}"
    # Helm keeps what it installed from crds/.
    kube.kubectl("get", "crd", "llmservices.conveyor.dev")
