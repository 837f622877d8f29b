"""The stack the fault tests run on, and how a fault is run under traffic: ``Stack`` (one
namespace with the operator pod, one LLMService of two replicas on the built-in tiny model and
two gateway pods), ``under_traffic`` (clients and the phase watch around one fault, with the
assertions every fault shares) and ``Run`` (the fault's start, end, recovery and ``[figures]``
line). The faults themselves are in ``test_chaos``; the clients, the phase watch and the ways
to break a process are in ``chaos_helpers``.
"""

from __future__ import annotations

import contextlib
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from chaos_helpers import (
    GATEWAY_PODS,
    Figures,
    PhaseWatch,
    Traffic,
    elapsed,
    pod_metric,
    pod_ready,
    wait,
)
from operator_helpers import (
    LLMSERVICES,
    apply_yaml,
    install_crd,
    llmservice,
    release_llmservices,
)

from conveyor.cluster import Cluster
from conveyor.cluster.api import ApiClient
from conveyor.cluster.testing import KubeUnderTest
from conveyor.operator.install import operator_deployment, operator_rbac

MODEL = "chaos"
KV_TOKENS = 128
"""The replicas' KV cache: 8 blocks of 16 tokens, small enough to oversubscribe 4x cheaply."""
SERVICE = llmservice(
    MODEL,
    replicas=2,
    resources={"gpus": 1, "cpu": "250m", "memory": "1Gi"},
    runtime={"maxTotalTokens": KV_TOKENS, "blockSize": 16},
)
OPERATOR_ARGS = (
    "--lease-duration", "6", "--lease-renew-interval", "2", "--lease-retry-interval", "1",
    "--resync-interval", "5", "--gateway-replicas", "2", "--gateway-cpu", "200m",
)  # fmt: skip
RECOVER_S = 180
"""Deadline for the stack to be healthy again after a fault (it takes seconds)."""
GATEWAY_RETRIES = "conveyor_gateway_retries_total"


@dataclass
class Stack:
    kube: KubeUnderTest
    cluster: Cluster
    namespace: str
    operator: str
    base_url: str

    @property
    def api(self) -> ApiClient:
        return self.kube.api

    def pods(self, selector: str) -> list[dict[str, Any]]:
        path = f"/api/v1/namespaces/{self.namespace}/pods"
        return self.api.get(path, labelSelector=selector)["items"]

    def runtime_pods(self) -> list[dict[str, Any]]:
        return self.pods(f"conveyor.dev/llmservice={MODEL}")

    def gateway_pods(self) -> list[dict[str, Any]]:
        return self.pods(GATEWAY_PODS)

    def operator_pods(self) -> list[dict[str, Any]]:
        return self.pods("app.kubernetes.io/component=operator")

    def llmservice(self, name: str = MODEL) -> dict[str, Any]:
        return self.api.get(f"{LLMSERVICES.format(ns=self.namespace)}/{name}")

    def healthy(self) -> bool:
        """The LLMService Ready with both replicas, every pod of the stack Ready and not deleting."""
        status = self.llmservice().get("status") or {}
        pods = self.runtime_pods() + self.gateway_pods() + self.operator_pods()
        return (
            status.get("phase") == "Ready"
            and status.get("readyReplicas") == 2
            and len(pods) == 5
            and all(pod_ready(p) and not p["metadata"].get("deletionTimestamp") for p in pods)
        )

    def wait_healthy(self, what: str = "the stack healthy") -> None:
        wait(what, self.healthy, timeout_s=RECOVER_S, interval_s=0.5)

    def gateway_retries(self) -> dict[str, float]:
        return pod_metric(self.gateway_pods(), 8080, GATEWAY_RETRIES)


@contextlib.contextmanager
def namespace_for(kube: KubeUnderTest) -> Iterator[str]:
    """A namespace for the module (the session's ``namespace`` fixture is per test)."""
    name = f"chaos-{uuid.uuid4().hex[:6]}"
    api = kube.api
    api.create(
        "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
    )
    wait(
        f"the default ServiceAccount of {name}",
        lambda: api.get(f"/api/v1/namespaces/{name}/serviceaccounts/default"),
        timeout_s=60,
    )
    try:
        yield name
    finally:
        api.delete(f"/api/v1/namespaces/{name}")
        pods = f"/api/v1/namespaces/{name}/pods"

        def gone() -> bool:
            api.request("DELETE", pods, query={"gracePeriodSeconds": "0"})
            return not api.get(pods)["items"]

        wait(f"the pods of {name} deleted", gone, timeout_s=60)


@contextlib.contextmanager
def stack_up(kube: KubeUnderTest, cluster: Cluster) -> Iterator[Stack]:
    """The operator pod (its own RBAC), the LLMService and its gateways in a namespace of their
    own, healthy; removed afterwards."""
    install_crd(kube)
    with namespace_for(kube) as namespace:
        name = f"conveyor-operator-{namespace}"[:63]
        rbac = operator_rbac(namespace, name=name)
        args = ("--namespace", namespace, "--lease-namespace", namespace, *OPERATOR_ARGS)
        try:
            apply_yaml(
                kube,
                namespace,
                *rbac,
                operator_deployment(namespace, replicas=1, args=args, name=name),
                SERVICE,
            )
            started = time.monotonic()
            status = wait(
                f"{MODEL} Ready",
                lambda: (s := kube.api.get(f"{LLMSERVICES.format(ns=namespace)}/{MODEL}").get("status") or {}).get("phase") == "Ready" and s,
                timeout_s=600,
                interval_s=0.5,
            )  # fmt: skip
            base_url = f"http://{status['endpoint']['clusterIP']}:8080"
            s = Stack(kube, cluster, namespace, name, base_url)
            s.wait_healthy()
            print(f"\n[figures] chaos stack Ready in {elapsed(started):.1f} s", file=sys.stderr)
            yield s
        finally:
            release_llmservices(kube, namespace)
            for obj in rbac:
                if obj["kind"].startswith("Cluster"):
                    kube.kubectl(
                        "delete", obj["kind"].lower(), obj["metadata"]["name"],
                        "--ignore-not-found", check=False,
                    )  # fmt: skip


@dataclass
class Run:
    """One fault under traffic: the clients, the phase timeline, the fault's start and end."""

    stack: Stack
    traffic: Traffic
    watch: PhaseWatch
    retries_before: dict[str, float]
    fault_start: float = 0.0
    fault_end: float = 0.0

    def begin(self) -> None:
        self.fault_start = time.monotonic()

    def end(self) -> None:
        self.fault_end = time.monotonic()

    def recover(self) -> None:
        """Wait until the stack is healthy and serves again (fresh answers after that), and
        the phase watch has a sample from then on (one poll that began while the apiserver was
        down can end seconds later)."""
        self.stack.wait_healthy("the stack healthy again")
        healthy = time.monotonic()
        self.traffic.wait_answers(10, since=healthy)
        self.watch.wait_sample(since=healthy)

    def report(self, fault: str, extra: str = "") -> tuple[Figures, Figures]:
        during = self.traffic.since(self.fault_start, self.fault_end)
        after = self.traffic.since(self.fault_end)
        retries_after = self.stack.gateway_retries()
        gateway_retries = sum(v - self.retries_before.get(k, 0.0) for k, v in retries_after.items())
        recovery = self.watch.recovery(self.fault_start, self.fault_end)
        print(
            f"\n[figures] {fault}: during ({self.fault_end - self.fault_start:.1f} s) "
            f"{during.line()}; after {after.line()}; gateway retries {gateway_retries:.0f}; "
            f"LLMService {recovery} (phases {' > '.join(self.watch.phases(self.fault_start))}); "
            f"gateway endpoints {self.watch.gateway_timeline(self.fault_start)}{extra}",
            file=sys.stderr,
        )
        return during, after


@contextlib.contextmanager
def under_traffic(stack: Stack) -> Iterator[Run]:
    """A healthy stack, then clients and the phase watch running for the ``with`` block; the
    assertions every fault shares at its end."""
    stack.wait_healthy()
    with (
        Traffic(stack.base_url, MODEL) as traffic,
        PhaseWatch(stack.api, stack.namespace, MODEL) as watch,
    ):
        traffic.wait_answers(10, since=time.monotonic())
        run = Run(stack, traffic, watch, stack.gateway_retries())
        yield run
    failed = traffic.since(run.fault_start)
    assert failed.failed_before_first_byte == 0, (
        f"{failed.failed_before_first_byte} requests failed before their first byte: "
        f"{failed.errors}; times from the fault's start, the fault ended at "
        f"+{run.fault_end - run.fault_start:.1f}s; the gateway Service's ready endpoints: "
        f"{watch.gateway_timeline(run.fault_start)}; gateway containers: "
        f"{[last_states(p) for p in stack.gateway_pods()]}"
    )
    assert stack.llmservice()["status"]["phase"] == "Ready"


def lease_renewed_after(api: ApiClient, node: str, since: float) -> bool:
    """Whether the node's kubelet renewed its Lease in ``kube-node-lease`` after ``since``."""
    lease = api.get(f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{node}")
    renewed = datetime.fromisoformat(lease["spec"]["renewTime"].replace("Z", "+00:00"))
    return renewed.timestamp() > since


def restarts(pods: list[dict[str, Any]]) -> int:
    return sum(
        c.get("restartCount", 0)
        for p in pods
        for c in (p.get("status") or {}).get("containerStatuses") or []
    )


def last_states(pod: dict[str, Any]) -> dict[str, Any]:
    """Each container's restarts and how its last run ended, and when the pod's Ready condition
    last changed (a failure's evidence)."""
    status = pod.get("status") or {}
    ready = [c for c in status.get("conditions") or [] if c.get("type") == "Ready"]
    return {
        "ready since": ready[0].get("lastTransitionTime") if ready else None,
        **{
            c["name"]: (c.get("restartCount", 0), (c.get("lastState") or {}).get("terminated"))
            for c in status.get("containerStatuses") or []
        },
    }


def container_ids(pod: dict[str, Any]) -> list[str]:
    return [
        c.get("containerID", "") for c in (pod.get("status") or {}).get("containerStatuses") or []
    ]
