"""The operator on a real apiserver: the LLMService CRD, reconciliation, HA.

The operator runs as a local process under its own ServiceAccount's token and RBAC (from
``conveyor.operator.rbac``), watching only the test's namespace. Tests that need pods to
really run (a node agent) skip with that reason on a cluster without one.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_helpers import (
    LLMSERVICES,
    REPO,
    OperatorIdentity,
    OperatorProcess,
    apply_yaml,
    children,
    install_crd,
    llmservice,
    llmservice_status,
    operators,
    pods_run,
    release_llmservices,
    tiny_example,
    wait_for,
)

from conveyor.cluster.api import ApiError
from conveyor.cluster.testing import KubeUnderTest
from conveyor.operator.crd import apply_defaults
from conveyor.operator.runtime_manifests import runtime_podmonitor

EXAMPLE = REPO / "examples" / "llmservice.yaml"
MODEL = "smollm2"  # the example's name: the model clients send
RECONCILE_S = 60
"""Deadline for the operator to act on a change (it acts within a second or two here)."""


@pytest.fixture(scope="session")
def crd(kube: KubeUnderTest) -> None:
    install_crd(kube)


@pytest.fixture
def identity(
    kube: KubeUnderTest, namespace: str, crd: None, tmp_path: Path
) -> Iterator[OperatorIdentity]:
    ident = OperatorIdentity(kube, namespace, tmp_path)
    yield ident
    ident.close()


@pytest.fixture
def start_operator(
    identity: OperatorIdentity, tmp_path: Path
) -> Iterator[Callable[..., OperatorProcess]]:
    with operators(identity, tmp_path) as start:
        yield start


@pytest.fixture
def operator(start_operator: Callable[..., OperatorProcess]) -> OperatorProcess:
    op = start_operator("op-a")
    wait_for("the operator to take the Lease", op.is_leader, timeout_s=60)
    return op


_PODS_RUN = pytest.StashKey[str]()


@pytest.fixture
def running_pods(kube: KubeUnderTest, namespace: str, request: pytest.FixtureRequest) -> None:
    """Skips unless pods really run here (probed once per session)."""
    stash = request.config.stash
    if _PODS_RUN not in stash:
        stash[_PODS_RUN] = pods_run(kube, namespace) or ""
    if stash[_PODS_RUN]:
        pytest.skip(stash[_PODS_RUN])


def path_of(namespace: str, name: str) -> str:
    return f"{LLMSERVICES.format(ns=namespace)}/{name}"


def deployment(kube: KubeUnderTest, namespace: str, name: str) -> dict[str, Any]:
    return kube.api.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}")


def reconciled(kube: KubeUnderTest, namespace: str, name: str) -> dict[str, Any] | None:
    """The status once it reflects the current generation (with an endpoint), else None."""
    obj = kube.api.get(path_of(namespace, name))
    status = obj.get("status") or {}
    if status.get("observedGeneration") == obj["metadata"]["generation"] and status.get("endpoint"):
        return status
    return None


# ---- the main path (needs pods that really run) ------------------------------------------


def test_example_is_served_through_the_gateway(
    kube: KubeUnderTest, namespace: str, operator: OperatorProcess, running_pods: None
) -> None:
    """kubectl apply the example (the real model) -> runtime and gateway pods Ready -> the
    openai client gets right answers through the gateway, streamed and not."""
    import openai

    started = time.monotonic()
    kube.kubectl("-n", namespace, "apply", "-f", str(EXAMPLE))
    status = wait_for(
        "the example LLMService Ready",
        lambda: (s := llmservice_status(kube.api, namespace, MODEL)).get("phase") == "Ready" and s,
        timeout_s=600,
    )
    ready_s = time.monotonic() - started
    endpoint = status["endpoint"]
    assert endpoint["model"] == MODEL and endpoint["clusterIP"]
    client = openai.OpenAI(
        base_url=f"http://{endpoint['clusterIP']}:8080/v1", api_key="none", max_retries=0,
        timeout=120,
    )  # fmt: skip
    answered = wait_for(
        "the gateway to route to the replica",
        lambda: client.completions.create(model=MODEL, prompt="Hello", max_tokens=8),
        timeout_s=120,
    )
    first_answer_s = time.monotonic() - started
    assert answered.choices[0].text
    question = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=question, max_tokens=32, temperature=0
    )
    assert "Paris" in chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model=MODEL, messages=question, max_tokens=32, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == chat.choices[0].message.content
    print(
        f"\n[figures] apply -> Ready {ready_s:.1f} s, apply -> first answer {first_answer_s:.1f} s"
        f"; {startup_split(kube, namespace, MODEL)}; answer: {streamed!r}",
        file=sys.stderr,
    )


def startup_split(kube: KubeUnderTest, namespace: str, name: str) -> str:
    """Where the time to Ready went, from the apiserver's (whole-second) timestamps."""
    from datetime import datetime

    def at(stamp: str) -> float:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()

    created = at(kube.api.get(path_of(namespace, name))["metadata"]["creationTimestamp"])
    pod = kube.api.get(
        f"/api/v1/namespaces/{namespace}/pods", labelSelector=f"conveyor.dev/llmservice={name}"
    )["items"][0]
    conditions = {c["type"]: at(c["lastTransitionTime"]) for c in pod["status"]["conditions"]}
    running = pod["status"]["containerStatuses"][0]["state"]["running"]["startedAt"]
    marks = [
        ("LLMService -> pod created", created, at(pod["metadata"]["creationTimestamp"])),
        ("pod scheduled", at(pod["metadata"]["creationTimestamp"]), conditions["PodScheduled"]),
        ("container started", conditions["PodScheduled"], at(running)),
        ("model loaded and Ready", at(running), conditions["Ready"]),
    ]
    return ", ".join(f"{what} {end - start:.0f} s" for what, start, end in marks)


def test_two_models_behind_one_gateway_each_answer_for_their_name(
    kube: KubeUnderTest, namespace: str, operator: OperatorProcess, running_pods: None
) -> None:
    import openai

    apply_yaml(
        kube,
        namespace,
        llmservice("alpha"),
        llmservice("beta", model={"builtin": "conveyor-tiny", "servedName": "beta-model"}),
    )
    for name in ("alpha", "beta"):
        wait_for(
            f"{name} Ready",
            lambda n=name: llmservice_status(kube.api, namespace, n).get("phase") == "Ready",
            timeout_s=600,
        )
    ip = llmservice_status(kube.api, namespace, "alpha")["endpoint"]["clusterIP"]
    assert (
        llmservice_status(kube.api, namespace, "beta")["endpoint"]["clusterIP"] == ip
    )  # one base URL
    client = openai.OpenAI(base_url=f"http://{ip}:8080/v1", api_key="none", max_retries=0)
    for model in ("alpha", "beta-model"):
        wait_for(
            f"an answer for {model}",
            lambda m=model: client.completions.create(model=m, prompt="Hi", max_tokens=4),
            timeout_s=120,
        )
    kube.kubectl("-n", namespace, "delete", "llmservice", "alpha", "--wait=true")
    assert client.completions.create(model="beta-model", prompt="Hi", max_tokens=4).choices

    def alpha_unknown() -> bool:
        try:
            client.completions.create(model="alpha", prompt="Hi", max_tokens=4)
        except openai.NotFoundError:
            return True
        return False

    wait_for("the gateway to answer 404 for alpha", alpha_unknown, timeout_s=60)
    kube.kubectl("-n", namespace, "delete", "llmservice", "beta", "--wait=true")
    wait_for(
        "the shared gateway garbage-collected with the last LLMService",
        lambda: not children(kube.api, namespace, component="gateway"),
        timeout_s=RECONCILE_S,
    )


# ---- the resource and its reconciliation (no running pods needed) -------------------------


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


def test_operator_killed_mid_reconcile_leaves_no_duplicates_or_orphans(
    kube: KubeUnderTest, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    first = start_operator("op-a")
    wait_for("leader", first.is_leader, timeout_s=60)
    names = [f"svc-{i}" for i in range(6)]
    apply_yaml(kube, namespace, *(llmservice(n) for n in names))
    wait_for(
        "a first child",
        lambda: children(kube.api, namespace),
        timeout_s=RECONCILE_S,
        interval_s=0.05,
    )
    first.kill()  # mid-reconcile: some LLMServices have children, some not
    second = start_operator("op-b")
    for name in names:
        wait_for(
            f"{name} reconciled",
            lambda n=name: reconciled(kube, namespace, n),
            timeout_s=RECONCILE_S,
        )
    made = children(kube.api, namespace)
    runtime_deployments = [
        c
        for c in made
        if c["kind"] == "deployments" and c["metadata"]["name"] != "conveyor-gateway"
    ]
    assert (
        sorted(c["metadata"]["name"] for c in runtime_deployments) == names
    )  # one each, none twice
    live = {kube.api.get(path_of(namespace, n))["metadata"]["uid"] for n in names}
    for child in made:
        owners = {r["uid"] for r in child["metadata"]["ownerReferences"]}
        assert owners and owners <= live, f"{child['kind']}/{child['metadata']['name']} is orphaned"
    assert second.is_leader()


def test_two_operators_one_acts_and_the_other_takes_over(
    kube: KubeUnderTest, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    a = start_operator("op-a")
    wait_for("op-a leads", a.is_leader, timeout_s=60)
    b = start_operator("op-b")
    lease_path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/conveyor-operator"
    apply_yaml(kube, namespace, llmservice("first"))
    wait_for(
        "first reconciled", lambda: reconciled(kube, namespace, "first"), timeout_s=RECONCILE_S
    )
    assert kube.api.get(lease_path)["spec"]["holderIdentity"] == "op-a"
    assert not b.is_leader() and b.metric("conveyor_reconcile_total") is None  # b never acted
    assert a.metric('conveyor_reconcile_total{result="success"}')
    a.kill()  # a crash: the Lease is not released, b waits for it to expire
    killed = time.monotonic()
    wait_for("op-b takes over", b.is_leader, timeout_s=60)
    takeover_s = time.monotonic() - killed
    assert kube.api.get(lease_path)["spec"]["holderIdentity"] == "op-b"
    apply_yaml(kube, namespace, llmservice("second"))
    wait_for(
        "second reconciled by op-b",
        lambda: reconciled(kube, namespace, "second"),
        timeout_s=RECONCILE_S,
    )
    # lease 6 s in these tests: takeover within the lease duration plus a retry and a start
    print(
        f"\n[figures] standby took over {takeover_s:.1f} s after the leader was killed (lease 6 s)",
        file=sys.stderr,
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


# ---- with pods that really run: a rollout under traffic, the operator as a pod ----------


def test_a_spec_change_rolls_out_under_traffic_without_failed_requests(
    kube: KubeUnderTest, namespace: str, operator: OperatorProcess, running_pods: None
) -> None:
    import threading

    import openai

    # A quarter core each, so that the surge replica fits beside the two old ones (the GPU
    # nodes have 666m each): with no room for it, a maxUnavailable=0 rollout waits forever.
    small = {"gpus": 1, "cpu": "250m", "memory": "1Gi"}
    apply_yaml(kube, namespace, llmservice("roll", replicas=2, resources=small))
    status = wait_for(
        "roll Ready",
        lambda: (s := llmservice_status(kube.api, namespace, "roll")).get("phase") == "Ready" and s,
        timeout_s=600,
    )
    client = openai.OpenAI(
        base_url=f"http://{status['endpoint']['clusterIP']}:8080/v1",
        api_key="none",
        max_retries=0,
        timeout=60,
    )
    wait_for(
        "routed",
        lambda: client.completions.create(model="roll", prompt="Hi", max_tokens=4),
        timeout_s=120,
    )
    stop, failures, answered = threading.Event(), [], [0]

    def traffic() -> None:
        while not stop.is_set():
            try:
                stream = client.completions.create(
                    model="roll", prompt="Tell a story", max_tokens=48, stream=True
                )
                for _ in stream:
                    pass
                answered[0] += 1
            except openai.OpenAIError as exc:
                failures.append(repr(exc))

    threads = [threading.Thread(target=traffic) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        kube.kubectl(
            "-n",
            namespace,
            "patch",
            "llmservice",
            "roll",
            "--type=merge",
            "-p",
            '{"spec":{"runtime":{"maxRunningRequests":16}}}',
        )
        min_ready = [2]

        def rolled_out() -> bool:
            d = deployment(kube, namespace, "roll")["status"]
            min_ready[0] = min(min_ready[0], d.get("readyReplicas", 0))
            s = reconciled(kube, namespace, "roll")
            return bool(
                s
                and s["phase"] == "Ready"
                and d.get("updatedReplicas") == 2
                and d.get("replicas") == 2
            )

        wait_for("the new spec rolled out", rolled_out, timeout_s=600, interval_s=0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert failures == [] and answered[0] > 0
    assert min_ready[0] >= 2  # new replicas were Ready before old ones went


def test_operator_as_a_pod_under_its_own_rbac_with_a_standby(
    kube: KubeUnderTest, namespace: str, crd: None, running_pods: None
) -> None:
    from conveyor.operator.install import operator_deployment, operator_rbac

    name = f"conveyor-operator-{namespace}"[:63]
    rbac = operator_rbac(namespace, name=name)
    args = ("--namespace", namespace, "--lease-namespace", namespace, "--lease-duration", "6",
            "--lease-renew-interval", "2", "--lease-retry-interval", "1")  # fmt: skip
    try:
        apply_yaml(
            kube, namespace, *rbac, operator_deployment(namespace, replicas=2, args=args, name=name)
        )
        lease = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}"
        holder = wait_for(
            "a leader pod", lambda: kube.api.get(lease)["spec"].get("holderIdentity"), timeout_s=300
        )
        kube.kubectl("-n", namespace, "apply", "-f", "-", input_=tiny_example())
        wait_for(
            "the example reconciled by the pod",
            lambda: reconciled(kube, namespace, "tiny"),
            timeout_s=RECONCILE_S,
        )
        kube.kubectl("-n", namespace, "delete", "pod", holder, "--grace-period=0", "--force")
        wait_for(
            "the standby pod takes over",
            lambda: kube.api.get(lease)["spec"].get("holderIdentity") not in ("", holder),
            timeout_s=120,
        )
        kube.kubectl("-n", namespace, "scale", "llmservice/tiny", "--replicas=2")
        wait_for(
            "the new leader acts",
            lambda: deployment(kube, namespace, "tiny")["spec"]["replicas"] == 2,
            timeout_s=RECONCILE_S,
        )
    finally:
        release_llmservices(kube, namespace)
        for obj in rbac:
            if obj["kind"].startswith("Cluster"):
                kube.kubectl(
                    "delete",
                    obj["kind"].lower(),
                    obj["metadata"]["name"],
                    "--ignore-not-found",
                    check=False,
                )


def test_two_gpus_make_one_tensor_parallel_replica_that_answers_through_the_gateway(
    kube: KubeUnderTest, namespace: str, operator: OperatorProcess, running_pods: None
) -> None:
    """``resources.gpus: 2``: one replica whose model is split over two ranks (tensor
    parallelism) answers through the gateway with the tokens one rank gives, greedy."""
    import openai

    from conveyor.runtime import LLM, SamplingParams

    name = "tp"
    apply_yaml(
        kube,
        namespace,
        llmservice(name, resources={"gpus": 2, "cpu": "500m", "memory": "2Gi"}),
    )
    status = wait_for(
        "the tensor-parallel LLMService Ready",
        lambda: (s := llmservice_status(kube.api, namespace, name)).get("phase") == "Ready" and s,
        timeout_s=300,
    )
    container = deployment(kube, namespace, name)["spec"]["template"]["spec"]["containers"][0]
    args = container.get("args") or []
    assert args[args.index("--tensor-parallel-size") + 1] == "2", args
    client = openai.OpenAI(
        base_url=f"http://{status['endpoint']['clusterIP']}:8080/v1", api_key="none",
        max_retries=0, timeout=120,
    )  # fmt: skip
    prompt = "The conveyor belt carries"
    answered = wait_for(
        "the gateway to route to the tensor-parallel replica",
        lambda: client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0),
        timeout_s=120,
    )
    with LLM("conveyor-tiny") as one_rank:
        expected = one_rank.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0]
    assert answered.choices[0].text == expected.text
    print(
        f"\n[figures] tensor-parallel replica: {startup_split(kube, namespace, name)}; "
        f"answer: {answered.choices[0].text!r}",
        file=sys.stderr,
    )
