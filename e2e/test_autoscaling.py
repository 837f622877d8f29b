"""The whole loop: OpenAI traffic through the namespace gateway to runtime pods that the
cluster really runs, replicas added and removed by the operator's autoscaler.

The operator runs as a local process under its own ServiceAccount (as in ``test_operator``),
deciding every second. Replicas are limited to a fraction of a core each (the kubelet
enforces ``limits.cpu``), so another replica is more capacity. Assertions are on decisions,
replica counts, queue depth and answers, never on times; every wait has a deadline.
Skips, with the reason, on a cluster where pods do not really run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import traffic
from operator_helpers import (
    LLMSERVICES,
    OperatorIdentity,
    OperatorProcess,
    apply_yaml,
    decisions,
    llmservice,
    llmservice_status,
    operators,
    scale_events,
    wait_for,
)
from traffic import Load

from conveyor.cluster.testing import KubeUnderTest

OPERATOR_FLAGS = ("--autoscale-interval", "1", "--gateway-cpu", "200m", "--gateway-memory", "512Mi")
"""Decide every second; a gateway small enough to share a node with replicas."""
REPLICA = {"gpus": 1, "cpu": "250m", "memory": "1Gi"}
"""A quarter of a core per replica: one replica saturates under the test's load."""
TARGET_QUEUE = 2
CONCURRENCY = 10
"""Clients sending back to back: five times what one replica runs at once (2), so one replica
queues 8 (4x the target), while four replicas queue 2 between them (0.5 each): the relief is
clearly under target. With 16, four replicas queue exactly the target, and the test waited on
a boundary."""
DEADLINE_S = 600


@pytest.fixture
def operator(
    kube: KubeUnderTest, namespace: str, crd: None, tmp_path: Path
) -> Iterator[OperatorProcess]:
    identity = OperatorIdentity(kube, namespace, tmp_path)
    try:
        with operators(identity, tmp_path) as start:
            op = start("op-a", OPERATOR_FLAGS)
            wait_for("the operator to take the Lease", op.is_leader, timeout_s=60)
            yield op
    finally:
        identity.close()


def autoscaled(name: str, **autoscaling: Any) -> dict[str, Any]:
    return llmservice(
        name,
        resources=REPLICA,
        runtime={"maxRunningRequests": 2},
        autoscaling={
            "enabled": True,
            "targetQueueDepthPerReplica": TARGET_QUEUE,
            "scaleDownStabilizationSeconds": 10,
            **autoscaling,
        },
    )


def get(kube: KubeUnderTest, namespace: str, name: str) -> dict[str, Any]:
    return kube.api.get(f"{LLMSERVICES.format(ns=namespace)}/{name}")


def crash_looping(kube: KubeUnderTest, namespace: str) -> None:
    """Fail at once, saying why, when a pod of the test keeps crashing (not at the deadline)."""
    for pod in kube.api.get(f"/api/v1/namespaces/{namespace}/pods")["items"]:
        for c in (pod.get("status") or {}).get("containerStatuses") or []:
            waiting = (c.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") == "CrashLoopBackOff" and c.get("restartCount", 0) >= 3:
                last = (c.get("lastState") or {}).get("terminated") or {}
                raise AssertionError(
                    f"pod {pod['metadata']['name']} keeps crashing (last exit code "
                    f"{last.get('exitCode')}, {last.get('reason', '')}): {waiting.get('message')}"
                )


def client_for(kube: KubeUnderTest, namespace: str, name: str, timeout_s: float = 300) -> Any:
    import openai

    def ready() -> dict[str, Any] | None:
        crash_looping(kube, namespace)
        status = llmservice_status(kube.api, namespace, name)
        if status.get("phase") == "Ready" and status.get("endpoint", {}).get("clusterIP"):
            return status
        return None

    status = wait_for(f"LLMService {name} Ready with an endpoint", ready, timeout_s=DEADLINE_S)
    ip = status["endpoint"]["clusterIP"]
    return openai.OpenAI(
        base_url=f"http://{ip}:8080/v1", api_key="none", max_retries=0, timeout=timeout_s
    )


def run_load(load: Load, until: Callable[[], Any], what: str) -> Any:
    return traffic.run_load(load, until, what, clients=CONCURRENCY, deadline_s=DEADLINE_S)


def test_load_scales_up_then_down_without_a_failed_request(
    kube: KubeUnderTest, namespace: str, operator: OperatorProcess, running_pods: None
) -> None:
    apply_yaml(kube, namespace, autoscaled("tiny", minReplicas=1, maxReplicas=4))
    client = client_for(kube, namespace, "tiny")
    assert get(kube, namespace, "tiny")["spec"]["replicas"] == 1

    seen: dict[str, Any] = {"max_replicas": 1, "max_queue": 0.0, "reasons": set()}

    def relieved() -> bool:
        """More replicas serving, and the queue per replica back under target."""
        obj = get(kube, namespace, "tiny")
        auto = (obj.get("status") or {}).get("autoscaler") or {}
        signals = auto.get("signals") or {}
        seen["max_replicas"] = max(seen["max_replicas"], obj["spec"]["replicas"])
        seen["max_queue"] = max(seen["max_queue"], signals.get("queueDepthPerReplica", 0.0))
        if auto.get("direction") == "up":
            seen["reasons"].add(auto.get("reason"))
        return (
            signals.get("readyReplicas", 0) >= 2
            and seen["max_queue"] > TARGET_QUEUE
            and signals.get("queueDepthPerReplica", 99) <= TARGET_QUEUE
        )

    load = Load(client, "tiny")
    run_load(load, relieved, "replicas to rise and the queue per replica to fall under target")
    assert load.failures == [], load.failures[:5]
    assert load.answered > 0
    assert seen["max_queue"] > TARGET_QUEUE  # the load did queue up on one replica
    assert 2 <= seen["max_replicas"] <= 4
    assert "ScaledUp" in [reason for reason, _ in scale_events(kube, namespace, "tiny")]
    assert decisions(operator, "tiny", "up") >= 1

    # Load stops: back to minReplicas after the stabilization window.
    wait_for(
        "replicas back to 1 after the load",
        lambda: get(kube, namespace, "tiny")["spec"]["replicas"] == 1,
        timeout_s=DEADLINE_S,
        interval_s=0.5,
    )
    status = llmservice_status(kube.api, namespace, "tiny")
    assert status["autoscaler"]["direction"] in ("down", "none")
    assert "ScaledDown" in [reason for reason, _ in scale_events(kube, namespace, "tiny")]
    assert decisions(operator, "tiny", "down") >= 1
    wait_for(
        "the Deployment back to 1 ready replica",
        lambda: llmservice_status(kube.api, namespace, "tiny").get("readyReplicas") == 1,
        timeout_s=DEADLINE_S,
    )
    # The remaining replica still answers (requests in flight during the scale-down finished).
    assert client.completions.create(model="tiny", prompt="after", max_tokens=4).choices


def test_idle_service_scales_to_zero_and_a_held_request_wakes_it(
    kube: KubeUnderTest, namespace: str, operator: OperatorProcess, running_pods: None
) -> None:
    apply_yaml(
        kube,
        namespace,
        autoscaled(
            "sleepy", minReplicas=0, maxReplicas=2, scaleToZeroIdleSeconds=5,
            scaleDownStabilizationSeconds=5,
        ),
    )  # fmt: skip
    client = client_for(kube, namespace, "sleepy")
    assert client.completions.create(model="sleepy", prompt="warm", max_tokens=4).choices

    wait_for(
        "the idle LLMService to scale to zero",
        lambda: (
            (o := get(kube, namespace, "sleepy"))["spec"]["replicas"] == 0
            and (o.get("status") or {}).get("readyReplicas") == 0
            and (o.get("status") or {}).get("phase") == "ScaledToZero"
        ),
        timeout_s=DEADLINE_S,
        interval_s=0.5,
    )
    assert ("ScaledDown", True) in [
        (reason, "to 0 replicas: idle" in message)
        for reason, message in scale_events(kube, namespace, "sleepy")
    ]

    # A request now is held by the gateway; the operator sees it pending and scales to 1.
    answer: dict[str, Any] = {}

    def ask() -> None:
        try:
            answer["out"] = client.completions.create(model="sleepy", prompt="wake", max_tokens=4)
        except Exception as exc:  # reported by the assertion below
            answer["error"] = exc

    asker = threading.Thread(target=ask)
    asker.start()
    asker.join(timeout=DEADLINE_S)
    assert not asker.is_alive(), "the held request was never answered"
    assert "error" not in answer, answer.get("error")
    assert answer["out"].choices and answer["out"].choices[0].text is not None
    assert get(kube, namespace, "sleepy")["spec"]["replicas"] >= 1
    # ...because the gateway held it: the operator scaled up for a pending request.
    assert any(
        reason == "ScaledUp" and "from 0 to 1 replicas: pending-requests" in message
        for reason, message in scale_events(kube, namespace, "sleepy")
    ), scale_events(kube, namespace, "sleepy")
