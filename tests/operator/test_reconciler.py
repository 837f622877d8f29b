"""The reconcile against an in-memory API (FakeKube): children, idempotence, drift, Degraded, the gateway."""

from __future__ import annotations

from typing import Any

import pytest
from fake_kube import FakeKube

from conveyor.operator.crd import apply_defaults
from conveyor.operator.kube import collection_path
from conveyor.operator.metrics import OperatorMetrics
from conveyor.operator.reconciler import Reconciler, llmservice_path
from conveyor.operator.settings import OperatorSettings

DEPLOYMENTS = collection_path("apps/v1", "Deployment", "team")
SERVICES = collection_path("v1", "Service", "team")


def node(name: str, gpus: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {}},
        "status": {"allocatable": {"nvidia.com/gpu": str(gpus)} if gpus else {}},
    }


def make_llmservice(kube: FakeKube, name: str, **spec: Any) -> dict[str, Any]:
    body = {
        "apiVersion": "conveyor.dev/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": name, "namespace": "team"},
        "spec": {"model": {"builtin": "conveyor-tiny"}, **spec},
    }
    return kube.put(apply_defaults(body))


@pytest.fixture
def kube() -> FakeKube:
    fake = FakeKube()
    fake.put(node("gpu-node-0", 8))
    fake.put(node("cpu-node-0", 0))
    return fake


@pytest.fixture
def events() -> list[tuple[str, str, str, str]]:
    return []


@pytest.fixture
def reconciler(kube: FakeKube, events: list) -> Reconciler:
    def post(obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
        events.append((obj["metadata"]["name"], type_, reason, message))

    return Reconciler(
        kube=kube, settings=OperatorSettings(), metrics=OperatorMetrics(), post_event=post
    )  # type: ignore[arg-type]


async def test_first_reconcile_creates_children_and_gateway_then_is_a_no_op(
    kube, reconciler, events
) -> None:
    make_llmservice(kube, "chat")
    assert await reconciler.reconcile("team", "chat") is None
    assert set(kube.objects) >= {
        f"{DEPLOYMENTS}/chat",
        f"{SERVICES}/chat",
        f"{DEPLOYMENTS}/conveyor-gateway",
    }
    created = sorted(message for _, _, reason, message in events if reason == "Created")
    assert created == sorted([
        "created Service chat", "created PodDisruptionBudget chat", "created Deployment chat",
        "created ServiceAccount conveyor-gateway", "created Role conveyor-gateway",
        "created RoleBinding conveyor-gateway", "created Service conveyor-gateway",
        "created Deployment conveyor-gateway",
    ])  # fmt: skip
    status = kube.objects[llmservice_path("team", "chat")]["status"]
    assert status["phase"] == "Pending" and status["observedGeneration"] == 1
    assert status["endpoint"] == {
        "url": "http://conveyor-gateway.team.svc:8080/v1",
        "clusterIP": kube.objects[f"{SERVICES}/conveyor-gateway"]["spec"]["clusterIP"],
        "service": "team/conveyor-gateway",
        "model": "chat",
    }
    assert (
        status["selector"]
        == "app.kubernetes.io/name=conveyor,app.kubernetes.io/component=runtime,conveyor.dev/llmservice=chat"
    )

    # idempotent: nothing written, no event
    events.clear()
    kube.writes.clear()
    await reconciler.reconcile("team", "chat")
    assert events == []
    assert [w for w in kube.writes if w[0] == "patch"] == []
    versions = {p: o["metadata"]["resourceVersion"] for p, o in kube.objects.items()}
    await reconciler.reconcile("team", "chat")
    assert versions == {p: o["metadata"]["resourceVersion"] for p, o in kube.objects.items()}


async def test_a_hand_edit_is_drift_and_is_taken_back(kube, reconciler, events) -> None:
    make_llmservice(kube, "chat")
    await reconciler.reconcile("team", "chat")
    path = f"{DEPLOYMENTS}/chat"
    edited = kube.objects[path]
    edited["spec"]["replicas"] = 5
    edited["metadata"]["generation"] += 1
    assert reconciler.drifted("MODIFIED", edited)
    status_only = dict(kube.objects[f"{DEPLOYMENTS}/conveyor-gateway"], status={"readyReplicas": 1})
    assert not reconciler.drifted("MODIFIED", status_only)
    events.clear()
    await reconciler.reconcile("team", "chat")
    assert kube.objects[path]["spec"]["replicas"] == 1
    assert ("chat", "Normal", "Updated", "updated Deployment chat (hand edit taken back)") in events

    # deleted by hand: drift, and created again
    deleted = kube.objects.pop(f"{SERVICES}/chat")
    assert reconciler.drifted("DELETED", deleted)
    await reconciler.reconcile("team", "chat")
    assert f"{SERVICES}/chat" in kube.objects


async def test_a_spec_change_rolls_out_and_observed_generation_follows(kube, reconciler) -> None:
    obj = make_llmservice(kube, "chat")
    await reconciler.reconcile("team", "chat")
    stored = kube.objects[llmservice_path("team", "chat")]
    stored["spec"]["runtime"]["maxRunningRequests"] = 8
    stored["spec"]["replicas"] = 3
    stored["metadata"]["generation"] = obj["metadata"]["generation"] + 1
    await reconciler.reconcile("team", "chat")
    deployment = kube.objects[f"{DEPLOYMENTS}/chat"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-running-requests") + 1] == "8"
    assert deployment["spec"]["replicas"] == 3
    status = kube.objects[llmservice_path("team", "chat")]["status"]
    assert status["observedGeneration"] == 2 and status["desiredReplicas"] == 3


async def test_too_many_gpus_is_degraded_and_other_llmservices_are_unaffected(
    kube, reconciler, events
) -> None:
    make_llmservice(kube, "huge", resources={"gpus": 16})
    make_llmservice(kube, "chat")
    problem = await reconciler.reconcile("team", "huge")
    assert problem is not None and problem.reason == "InsufficientGPUs"
    assert "16 nvidia.com/gpu" in problem.message and "has 8" in problem.message
    assert f"{DEPLOYMENTS}/huge" not in kube.objects  # nothing that cannot run is rolled out
    status = kube.objects[llmservice_path("team", "huge")]["status"]
    assert status["phase"] == "Degraded"
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "InsufficientGPUs"
    assert ("huge", "Warning", "InsufficientGPUs", problem.message) in events
    assert await reconciler.reconcile("team", "chat") is None
    assert f"{DEPLOYMENTS}/chat" in kube.objects
    # the gateway still serves the namespace, owned by both
    owners = [
        r["name"]
        for r in kube.objects[f"{DEPLOYMENTS}/conveyor-gateway"]["metadata"]["ownerReferences"]
    ]
    assert owners == ["chat", "huge"]


async def test_gateway_owners_follow_the_llmservices_of_the_namespace(kube, reconciler) -> None:
    make_llmservice(kube, "a")
    make_llmservice(kube, "b")
    await reconciler.reconcile("team", "a")
    await reconciler.reconcile("team", "b")
    gateway = f"{DEPLOYMENTS}/conveyor-gateway"
    assert [r["name"] for r in kube.objects[gateway]["metadata"]["ownerReferences"]] == ["a", "b"]
    kube.objects[llmservice_path("team", "a")]["metadata"]["deletionTimestamp"] = (
        "2030-01-01T00:00:00Z"
    )
    await reconciler.reconcile("team", "a")  # being deleted: only the gateway is touched
    assert [r["name"] for r in kube.objects[gateway]["metadata"]["ownerReferences"]] == ["b"]
    assert ("team", "a") not in reconciler._locks


async def test_podmonitor_only_where_the_prometheus_operator_api_exists(reconciler, kube) -> None:
    make_llmservice(kube, "chat")
    await reconciler.reconcile("team", "chat")
    assert not any("podmonitors" in p for p in kube.objects)
    monitored = FakeKube(apis=("monitoring.coreos.com/v1",))
    make_llmservice(monitored, "chat", resources={"gpus": 0})
    other = Reconciler(
        kube=monitored,
        settings=OperatorSettings(),
        metrics=OperatorMetrics(),
        post_event=lambda *a: None,
    )  # type: ignore[arg-type]
    await other.reconcile("team", "chat")
    assert "/apis/monitoring.coreos.com/v1/namespaces/team/podmonitors/chat" in monitored.objects


async def test_status_follows_the_deployment(kube, reconciler) -> None:
    make_llmservice(kube, "chat", replicas=2)
    await reconciler.reconcile("team", "chat")
    deployment = kube.objects[f"{DEPLOYMENTS}/chat"]
    deployment["status"] = {
        "observedGeneration": 1,
        "replicas": 2,
        "readyReplicas": 2,
        "updatedReplicas": 2,
    }
    await reconciler.refresh_status("team", "chat", deployment)
    status = kube.objects[llmservice_path("team", "chat")]["status"]
    assert status["phase"] == "Ready" and status["readyReplicas"] == 2
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True"


async def test_a_setting_the_engine_lacks_is_degraded_never_dropped(
    kube, reconciler, events
) -> None:
    """Behind the CRD's rules (an older CRD, a spec written before them): the operator rolls
    out nothing and says which setting to change."""
    make_llmservice(kube, "queued", engine="vllm", runtime={"maxQueuedRequests": 4})
    problem = await reconciler.reconcile("team", "queued")
    assert problem is not None and problem.reason == "EngineSettingUnsupported"
    assert "runtime.maxQueuedRequests" in problem.message
    assert f"{DEPLOYMENTS}/queued" not in kube.objects
    status = kube.objects[llmservice_path("team", "queued")]["status"]
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "EngineSettingUnsupported"
    assert ("queued", "Warning", "EngineSettingUnsupported", problem.message) in events
