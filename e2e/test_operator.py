"""The operator on a real apiserver: the LLMService CRD and its reconciliation, no running
pods needed. The operator runs as a local process under its own ServiceAccount's token and
RBAC (``operator_helpers``), watching only the test's namespace. Serving through the gateway
is in ``test_operator_serving``, the operator's availability in ``test_operator_ha``.
"""

from __future__ import annotations

import pytest
import yaml
from operator_helpers import (
    RECONCILE_S,
    REPO,
    OperatorProcess,
    apply_yaml,
    children,
    deployment,
    install_crd,
    llmservice,
    llmservice_status,
    path_of,
    reconciled,
    tiny_example,
    wait_for,
)

# the fixtures these tests and their fixtures ask for by name
from conveyor.cluster.api import ApiError
from conveyor.cluster.testing import KubeUnderTest
from conveyor.operator.crd import apply_defaults
from conveyor.operator.engines import UNSUPPORTED
from conveyor.operator.runtime_manifests import runtime_podmonitor


def test_invalid_resources_are_refused_with_what_to_fix(
    kube: KubeUnderTest, namespace: str, crd: None
) -> None:
    cases = {
        "set exactly one of model.builtin, model.hub, model.path or model.volume": {"model": {"builtin": "conveyor-tiny", "hub": "Qwen/Qwen2.5-0.5B"}},
        "autoscaling.minReplicas must not exceed autoscaling.maxReplicas": {
            "model": {"builtin": "conveyor-tiny"}, "autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2},
        },
        "runtime.maxModelLen must not exceed runtime.maxTotalTokens": {
            "model": {"builtin": "conveyor-tiny"}, "runtime": {"maxModelLen": 8192, "maxTotalTokens": 1024},
        },
        "runtime.memFractionStatic only applies on a GPU": {
            "model": {"builtin": "conveyor-tiny"}, "resources": {"gpus": 0}, "runtime": {"memFractionStatic": 0.9},
        },
        'Unsupported value: "fp8"': {"model": {"builtin": "conveyor-tiny"}, "runtime": {"dtype": "fp8"}},
        "spec.replicas: Invalid value: -1": {"model": {"builtin": "conveyor-tiny"}, "replicas": -1},
        'spec.routing.policy: Unsupported value: "random"': {"model": {"builtin": "conveyor-tiny"}, "routing": {"policy": "random"}},
        "spec.model: Required value": {"replicas": 1},
        "spec.model.loraAdapters[1]: Duplicate value": {"model": {"builtin": "conveyor-tiny", "loraAdapters": [
            {"name": "sql", "path": "/a/sql"}, {"name": "sql", "path": "/a/sql2"}]}},
        "spec.model.loraAdapters[0].path: Invalid value": {"model": {"builtin": "conveyor-tiny", "loraAdapters": [
            {"name": "sql", "path": "adapters/sql"}]}},
        "a model.loraAdapters name must differ from model.servedName": {"model": {
            "builtin": "conveyor-tiny", "servedName": "m", "loraAdapters": [{"name": "m", "path": "/a/m"}]}},
    }  # fmt: skip
    for message, spec in cases.items():
        body = {
            "apiVersion": "conveyor.dev/v1alpha1",
            "kind": "LLMService",
            "metadata": {"name": "bad"},
            "spec": spec,
        }
        proc = kube.kubectl(
            "-n", namespace, "apply", "-f", "-", input_=yaml.safe_dump(body), check=False
        )
        assert proc.returncode != 0, f"accepted: {spec}"
        assert message in proc.stderr, f"{spec}: {proc.stderr}"
    gateway_name = {"apiVersion": "conveyor.dev/v1alpha1", "kind": "LLMService", "metadata": {"name": "conveyor-gateway"},
                    "spec": {"model": {"builtin": "conveyor-tiny"}}}  # fmt: skip
    proc = kube.kubectl(
        "-n", namespace, "apply", "-f", "-", input_=yaml.safe_dump(gateway_name), check=False
    )
    assert "is the namespace's gateway; choose another name" in proc.stderr
    # every example is accepted, and the apiserver's defaults are the ones the operator's tests apply
    for example in sorted((REPO / "examples").glob("llmservice*.yaml")):
        kube.kubectl("-n", namespace, "apply", "--dry-run=server", "-f", str(example))
    minimal = {"apiVersion": "conveyor.dev/v1alpha1", "kind": "LLMService", "metadata": {"name": "ok", "namespace": namespace},
               "spec": {"model": {"builtin": "conveyor-tiny"}}}  # fmt: skip
    server = yaml.safe_load(
        kube.kubectl(
            "-n",
            namespace,
            "apply",
            "--dry-run=server",
            "-o",
            "yaml",
            "-f",
            "-",
            input_=yaml.safe_dump(minimal),
        ).stdout
    )
    assert server["spec"] == apply_defaults(minimal)["spec"]


def test_a_setting_vllm_lacks_is_refused_with_a_message(
    kube: KubeUnderTest, namespace: str
) -> None:
    install_crd(kube)
    spec = llmservice("refused", engine="vllm", runtime={"maxQueuedRequests": 4})
    result = apply_yaml(kube, namespace, spec, check=False)
    assert result.returncode != 0
    assert UNSUPPORTED[("vllm", "maxQueuedRequests")] in result.stderr
    assert not kube.api.get(f"/apis/conveyor.dev/v1alpha1/namespaces/{namespace}/llmservices")[
        "items"
    ]


def test_children_are_created_owned_and_reported(
    kube: KubeUnderTest, namespace: str, operator: OperatorProcess
) -> None:
    kube.kubectl("-n", namespace, "apply", "-f", "-", input_=tiny_example())
    status = wait_for(
        "the example reconciled", lambda: reconciled(kube, namespace, "tiny"), timeout_s=RECONCILE_S
    )
    obj = kube.api.get(path_of(namespace, "tiny"))
    made = children(kube.api, namespace)
    kinds = sorted((c["kind"], c["metadata"]["name"]) for c in made)
    assert kinds == sorted([
        ("deployments", "tiny"), ("services", "tiny"), ("poddisruptionbudgets", "tiny"),
        ("deployments", "conveyor-gateway"), ("services", "conveyor-gateway"),
        ("serviceaccounts", "conveyor-gateway"), ("roles", "conveyor-gateway"), ("rolebindings", "conveyor-gateway"),
    ])  # fmt: skip
    for child in made:
        assert [r["uid"] for r in child["metadata"]["ownerReferences"]] == [obj["metadata"]["uid"]]
    gateway_service = kube.api.get(f"/api/v1/namespaces/{namespace}/services/conveyor-gateway")
    assert status["endpoint"]["clusterIP"] == gateway_service["spec"]["clusterIP"]
    assert status["endpoint"]["model"] == "tiny"
    assert (
        status["selector"]
        == "app.kubernetes.io/name=conveyor,app.kubernetes.io/component=runtime,conveyor.dev/llmservice=tiny"
    )
    assert {c["type"] for c in status["conditions"]} == {"Ready", "Progressing", "Degraded"}
    events = kube.api.get(
        f"/api/v1/namespaces/{namespace}/events", fieldSelector="involvedObject.name=tiny"
    )["items"]
    assert any(
        e["reason"] == "Created" and e["message"] == "created Deployment tiny" for e in events
    )
    # the printer columns
    table = kube.kubectl("-n", namespace, "get", "llms", "tiny").stdout
    assert table.split("\n")[0].split() == [
        "NAME",
        "MODEL",
        "READY",
        "DESIRED",
        "PHASE",
        "QUEUE",
        "TTFT-P95",
        "AGE",
    ]


def test_drift_is_repaired_and_a_spec_change_rolls_out(
    kube: KubeUnderTest, namespace: str, operator: OperatorProcess
) -> None:
    kube.kubectl("-n", namespace, "apply", "-f", "-", input_=tiny_example())
    wait_for("reconciled", lambda: reconciled(kube, namespace, "tiny"), timeout_s=RECONCILE_S)
    # a child deleted by hand comes back
    old_uid = kube.api.get(f"/api/v1/namespaces/{namespace}/services/tiny")["metadata"]["uid"]
    kube.kubectl("-n", namespace, "delete", "service", "tiny")
    wait_for(
        "the runtime Service restored",
        lambda: (
            kube.api.get(f"/api/v1/namespaces/{namespace}/services/tiny")["metadata"]["uid"]
            != old_uid
        ),
        timeout_s=RECONCILE_S,
    )
    # a field the operator owns, edited by hand, is taken back
    kube.kubectl("-n", namespace, "patch", "deployment", "tiny", "--type=merge", "-p",
                 '{"spec":{"template":{"spec":{"terminationGracePeriodSeconds":1}}}}')  # fmt: skip
    wait_for(
        "the edit taken back",
        lambda: (
            deployment(kube, namespace, "tiny")["spec"]["template"]["spec"][
                "terminationGracePeriodSeconds"
            ]
            == 45
        ),
        timeout_s=RECONCILE_S,
    )
    # a spec change rolls out; observedGeneration follows
    before = kube.api.get(path_of(namespace, "tiny"))["metadata"]["generation"]
    kube.kubectl("-n", namespace, "patch", "llmservice", "tiny", "--type=merge", "-p",
                 '{"spec":{"runtime":{"maxRunningRequests":7}}}')  # fmt: skip
    status = wait_for(
        "the new generation reconciled",
        lambda: reconciled(kube, namespace, "tiny"),
        timeout_s=RECONCILE_S,
    )
    assert status["observedGeneration"] == before + 1
    args = deployment(kube, namespace, "tiny")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-running-requests") + 1] == "7"


def test_kubectl_scale_is_honoured_and_shown_in_status(
    kube: KubeUnderTest, namespace: str, operator: OperatorProcess
) -> None:
    kube.kubectl("-n", namespace, "apply", "-f", "-", input_=tiny_example())
    wait_for("reconciled", lambda: reconciled(kube, namespace, "tiny"), timeout_s=RECONCILE_S)
    kube.kubectl("-n", namespace, "scale", "llmservice/tiny", "--replicas=3")
    wait_for(
        "the Deployment scaled",
        lambda: deployment(kube, namespace, "tiny")["spec"]["replicas"] == 3,
        timeout_s=RECONCILE_S,
    )
    status = wait_for(
        "status showing 3 replicas",
        lambda: (
            (s := llmservice_status(kube.api, namespace, "tiny")).get("desiredReplicas") == 3
            and s.get("replicas") == 3
            and s
        ),
        timeout_s=RECONCILE_S,
    )
    scale = kube.api.get(f"{path_of(namespace, 'tiny')}/scale")
    assert scale["spec"]["replicas"] == 3 and scale["status"]["replicas"] == 3
    assert scale["status"]["selector"] == status["selector"]


def test_more_gpus_than_any_node_has_is_degraded_and_others_are_unaffected(
    kube: KubeUnderTest, namespace: str, operator: OperatorProcess
) -> None:
    apply_yaml(
        kube,
        namespace,
        llmservice("huge", resources={"gpus": 64, "cpu": "1", "memory": "1Gi"}),
        llmservice("fine"),
    )
    status = wait_for(
        "huge Degraded",
        lambda: (
            (s := llmservice_status(kube.api, namespace, "huge")).get("phase") == "Degraded" and s
        ),
        timeout_s=RECONCILE_S,
    )
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "InsufficientGPUs"
    assert (
        "64 nvidia.com/gpu" in degraded["message"]
        and "lower spec.resources.gpus" in degraded["message"]
    )
    with pytest.raises(ApiError):
        deployment(kube, namespace, "huge")  # nothing that cannot run was rolled out
    wait_for("fine reconciled", lambda: reconciled(kube, namespace, "fine"), timeout_s=RECONCILE_S)
    assert deployment(kube, namespace, "fine")
    events = kube.api.get(
        f"/api/v1/namespaces/{namespace}/events", fieldSelector="involvedObject.name=huge"
    )["items"]
    assert any(e["type"] == "Warning" and e["reason"] == "InsufficientGPUs" for e in events)
    assert operator.proc.poll() is None


def test_one_gateway_is_shared_and_goes_with_the_last_llmservice(
    kube: KubeUnderTest, namespace: str, operator: OperatorProcess
) -> None:
    apply_yaml(kube, namespace, llmservice("alpha"), llmservice("beta"))
    for name in ("alpha", "beta"):
        wait_for(
            f"{name} reconciled",
            lambda n=name: reconciled(kube, namespace, n),
            timeout_s=RECONCILE_S,
        )
    uids = {n: kube.api.get(path_of(namespace, n))["metadata"]["uid"] for n in ("alpha", "beta")}

    def gateway_owner_uids() -> set[str]:
        refs = deployment(kube, namespace, "conveyor-gateway")["metadata"]["ownerReferences"]
        return {r["uid"] for r in refs}

    wait_for(
        "the gateway owned by both",
        lambda: gateway_owner_uids() == set(uids.values()),
        timeout_s=RECONCILE_S,
    )
    assert (
        len(
            kube.api.get(
                f"/apis/apps/v1/namespaces/{namespace}/deployments",
                labelSelector="app.kubernetes.io/component=gateway",
            )["items"]
        )
        == 1
    )
    kube.kubectl("-n", namespace, "delete", "llmservice", "alpha", "--wait=true", "--timeout=60s")
    wait_for(
        "the gateway owned by beta alone",
        lambda: gateway_owner_uids() == {uids["beta"]},
        timeout_s=RECONCILE_S,
    )
    wait_for("alpha's children collected", lambda: not children(kube.api, namespace, component="runtime") or
             all(c["metadata"]["labels"].get("conveyor.dev/llmservice") == "beta" for c in children(kube.api, namespace, component="runtime")),
             timeout_s=RECONCILE_S)  # fmt: skip
    kube.kubectl("-n", namespace, "delete", "llmservice", "beta", "--wait=true", "--timeout=60s")
    wait_for(
        "every child collected, the gateway too",
        lambda: children(kube.api, namespace) == [],
        timeout_s=RECONCILE_S,
    )


def test_podmonitor_manifest_passes_a_server_side_dry_run(
    kube: KubeUnderTest, namespace: str, crd: None
) -> None:
    podmonitor_crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "podmonitors.monitoring.coreos.com"},
        "spec": {
            "group": "monitoring.coreos.com",
            "scope": "Namespaced",
            "names": {"kind": "PodMonitor", "plural": "podmonitors", "singular": "podmonitor", "listKind": "PodMonitorList"},
            "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                "type": "object", "properties": {"spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
            }}}],
        },
    }  # fmt: skip
    existing = (
        kube.kubectl("get", "crd", "podmonitors.monitoring.coreos.com", check=False).returncode == 0
    )
    if not existing:
        kube.kubectl("apply", "-f", "-", input_=yaml.safe_dump(podmonitor_crd))
    try:
        wait_for(
            "the PodMonitor API",
            lambda: kube.api.get("/apis/monitoring.coreos.com/v1"),
            timeout_s=60,
        )
        obj = apply_defaults({"apiVersion": "conveyor.dev/v1alpha1", "kind": "LLMService",
                              "metadata": {"name": "tiny", "namespace": namespace, "uid": "0f0f0f0f-0000-0000-0000-000000000000"},
                              "spec": {"model": {"builtin": "conveyor-tiny"}}})  # fmt: skip
        proc = kube.kubectl(
            "-n",
            namespace,
            "apply",
            "--dry-run=server",
            "-f",
            "-",
            input_=yaml.safe_dump(runtime_podmonitor(obj)),
        )
        assert "podmonitor.monitoring.coreos.com/tiny created (server dry run)" in proc.stdout
    finally:
        if not existing:
            kube.kubectl(
                "delete", "crd", "podmonitors.monitoring.coreos.com", "--wait=false", check=False
            )
