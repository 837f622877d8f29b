"""Faults under steady traffic: the stack recovers by itself and loses no request.

One cluster, one namespace, one operator pod (as the chart runs it: its own RBAC, a Lease of
6 s), one LLMService on the built-in tiny model with two replicas and a KV cache of 128
tokens, behind two gateway pods. In each test two clients stream completions through the
gateway back to back (``chaos_helpers.Traffic``, which resends as the OpenAI SDK does) while
one fault happens; the test prints a ``[figures]`` line (requests answered and failed before
and after their first byte during and after the fault, client and gateway retries, seconds
until the LLMService was Ready again) and asserts that no request failed before its first
byte and that the LLMService is Ready again. The faults run back to back; each test starts
from a healthy stack and leaves one. The stack and the fault's harness are ``chaos_stack``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml
from chaos_helpers import frozen, http, kill_container, pod_metric, pod_ready, wait
from chaos_stack import (
    KV_TOKENS,
    MODEL,
    RECOVER_S,
    Stack,
    container_ids,
    lease_renewed_after,
    restarts,
    stack_up,
    under_traffic,
)
from operator_helpers import LLMSERVICES, apply_yaml, children, llmservice

from conveyor.cluster.testing import KubeUnderTest
from conveyor.runtime.metrics_names import NUM_PREEMPTIONS

FREEZE_S = 25
"""How long the control plane is frozen: shorter than the node lifecycle controller's grace
period (kube-controller-manager's ``--node-monitor-grace-period``, 50 s) less a kubelet's lease
renewal interval (10 s) and the controller's catch-up after the thaw (its watch connection is
found dead, then relisted: ~5 s). Longer, and upstream Kubernetes does what it is built to do
when it cannot tell a frozen control plane from dead nodes: it marks every node Unknown and
every pod on them NotReady, Services lose their endpoints until the kubelets' next status sync,
and kube-proxy refuses connections meanwhile (measured on real nodes after a 45 s freeze: the
gateway's pods NotReady in the API for ~7 s, 4-20 requests refused, in about half the runs,
as the last renewal fell before the freeze)."""
ETCD_DOWN_S = 10


@pytest.fixture(scope="module")
def stack(kube: KubeUnderTest) -> Iterator[Stack]:
    if kube.cluster is None:
        pytest.skip("the faults are done to the one-machine cluster's own processes")
    with stack_up(kube, kube.cluster) as s:
        yield s


def test_control_plane_frozen_then_thawed(stack: Stack) -> None:
    """etcd and the apiserver stopped (SIGSTOP) for ``FREEZE_S``: the data plane needs neither;
    after SIGCONT the operator, the gateway's watches and the nodes catch up by themselves. The
    traffic goes on until every node has renewed its Lease after the thaw, so that what the node
    lifecycle controller makes of the silence shows here, not in the next test."""
    operator_restarts = restarts(stack.operator_pods())
    nodes = [n["metadata"]["name"] for n in stack.api.get("/api/v1/nodes")["items"]]
    with under_traffic(stack) as run:
        with frozen(stack.cluster, "etcd", "kube-apiserver"):
            run.begin()
            time.sleep(FREEZE_S)  # the outage itself; the clients run meanwhile
        thawed = time.time()
        run.end()
        wait(
            "every node's Lease renewed after the thaw",
            lambda: all(lease_renewed_after(stack.api, n, thawed) for n in nodes),
            timeout_s=RECOVER_S,
        )
        run.recover()
        during, _ = run.report(
            f"apiserver+etcd frozen {FREEZE_S} s",
            f"; operator restarts {restarts(stack.operator_pods()) - operator_restarts}",
        )
    assert during.answered > 0, "the data plane served nothing while the control plane was frozen"


def test_etcd_killed_and_restarted(stack: Stack) -> None:
    with under_traffic(stack) as run:
        run.begin()
        stack.cluster.restart("etcd", down_s=ETCD_DOWN_S)
        wait("the apiserver ready again", lambda: stack.api.readyz()[0], timeout_s=RECOVER_S)
        run.end()
        run.recover()
        run.report(f"etcd SIGKILLed, restarted {ETCD_DOWN_S} s later")


def test_operator_killed_during_a_burst_of_changes(stack: Stack) -> None:
    """Creates, then the operator pod killed while it reconciles them; updates and deletes while
    it is away. Its replacement (after the Lease expires) converges every spec: one Deployment
    per LLMService, none left of the deleted ones, every child owned by a live LLMService.
    (test_operator_ha.py kills a local operator during creates alone; this is the pod, under
    traffic, with updates and deletes too.)"""
    names = [f"burst-{i}" for i in range(4)]
    with under_traffic(stack) as run:
        (old,) = stack.operator_pods()
        apply_yaml(stack.kube, stack.namespace, *(llmservice(n, replicas=0) for n in names))
        wait(
            "a first burst child",
            lambda: any(
                c["metadata"]["name"] in names for c in children(stack.api, stack.namespace)
            ),
            timeout_s=60,
            interval_s=0.05,
        )
        run.begin()
        stack.kube.kubectl(
            "-n", stack.namespace, "delete", "pod", old["metadata"]["name"], "--grace-period=0", "--force",
        )  # fmt: skip
        patch = {"spec": {"runtime": {"maxRunningRequests": 3}}}
        for name in names[:2]:
            stack.kube.kubectl(
                "-n", stack.namespace, "patch", "llmservice", name, "--type=merge", "-p", yaml.safe_dump(patch),
            )  # fmt: skip
        stack.kube.kubectl(
            "-n", stack.namespace, "delete", "llmservice", *names[2:], "--wait=false"
        )

        def converged() -> bool:
            for name in names[:2]:
                obj = stack.llmservice(name)
                status = obj.get("status") or {}
                if status.get("observedGeneration") != obj["metadata"]["generation"]:
                    return False
                deployment = stack.api.get(
                    f"/apis/apps/v1/namespaces/{stack.namespace}/deployments/{name}"
                )
                args = deployment["spec"]["template"]["spec"]["containers"][0].get("args") or []
                if "3" not in args[args.index("--max-running-requests") + 1 :][:1]:
                    return False
            live = {
                i["metadata"]["name"]
                for i in stack.api.get(LLMSERVICES.format(ns=stack.namespace))["items"]
            }
            return live == {MODEL, *names[:2]}

        wait("every burst spec converged", converged, timeout_s=RECOVER_S, interval_s=0.5)
        run.end()
        made = children(stack.api, stack.namespace)
        deployments = sorted(
            c["metadata"]["name"] for c in made
            if c["kind"] == "deployments" and c["metadata"]["name"] != "conveyor-gateway"
        )  # fmt: skip
        live_uids = {
            i["metadata"]["uid"]
            for i in stack.api.get(LLMSERVICES.format(ns=stack.namespace))["items"]
        }
        orphans = [
            f"{c['kind']}/{c['metadata']['name']}" for c in made
            if not {r["uid"] for r in c["metadata"].get("ownerReferences") or []} <= live_uids
        ]  # fmt: skip
        wait("the deleted LLMServices' children collected", lambda: not [
            c for c in children(stack.api, stack.namespace) if c["metadata"]["name"] in names[2:]
        ], timeout_s=60)  # fmt: skip
        (new,) = stack.operator_pods()
        run.recover()
        run.report(
            "operator pod killed during 4 creates, 2 updates, 2 deletes",
            f"; every spec converged {run.fault_end - run.fault_start:.1f} s after the kill",
        )
        stack.kube.kubectl(
            "-n", stack.namespace, "delete", "llmservice", *names[:2], "--wait=false"
        )
    assert deployments == sorted([MODEL, *names[:2]]), "a Deployment missing or made twice"
    assert orphans == []
    assert new["metadata"]["name"] != old["metadata"]["name"]


def test_node_restarted(stack: Stack) -> None:
    """The kubelet of a runtime replica's node SIGKILLed and started again: every pod keeps its
    process and stays Ready."""
    before = {
        p["metadata"]["name"]: container_ids(p) for p in stack.runtime_pods() + stack.gateway_pods()
    }
    with under_traffic(stack) as run:
        run.begin()
        node = stack.runtime_pods()[0]["spec"]["nodeName"]
        killed_at = time.time()
        restarted = stack.cluster.restart(f"kubelet-{node}")
        wait(
            f"the new kubelet of {node} to renew its Lease",
            lambda: lease_renewed_after(stack.api, node, killed_at),
            timeout_s=60,
        )
        run.end()
        run.recover()
        run.report(f"{restarted.name} SIGKILLed and restarted")
        after = {
            p["metadata"]["name"]: container_ids(p)
            for p in stack.runtime_pods() + stack.gateway_pods()
        }
    assert after == before, "a pod was restarted or replaced"
    assert run.watch.pods_unready_seen(run.fault_start) == 0, "a runtime pod was seen not Ready"


def test_runtime_replica_killed_under_load(stack: Stack) -> None:
    """One replica's processes SIGKILLed: requests not yet streaming are retried by the gateway
    on the other replica; the kubelet restarts the container and it serves again."""
    with under_traffic(stack) as run:
        victim = stack.runtime_pods()[0]
        before = restarts([victim])
        run.begin()
        kill_container(stack.cluster, victim)
        path = f"/api/v1/namespaces/{stack.namespace}/pods/{victim['metadata']['name']}"
        wait(
            "the replica restarted and Ready",
            lambda: restarts([p := stack.api.get(path)]) > before and pod_ready(p),
            timeout_s=RECOVER_S,
        )
        run.end()
        run.recover()
        during, after = run.report("one runtime replica SIGKILLed")
    assert during.client_retries + after.client_retries == 0, (
        "the gateway left a retry to the client"
    )


def test_gateway_pod_killed(stack: Stack) -> None:
    """One of the two gateway pods deleted at once (grace 0): the other takes the traffic, the
    replacement serves within seconds."""
    with under_traffic(stack) as run:
        old = {p["metadata"]["name"] for p in stack.gateway_pods()}
        victim = sorted(old)[0]
        run.begin()
        stack.kube.kubectl(
            "-n", stack.namespace, "delete", "pod", victim, "--grace-period=0", "--force"
        )
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}

        def replacement_serves() -> bool:
            for pod in stack.gateway_pods():
                if pod["metadata"]["name"] not in old and pod_ready(pod):
                    return bool(
                        http(
                            f"http://{pod['status']['podIP']}:8080/v1/completions",
                            body,
                            timeout_s=10,
                        )
                    )
            return False

        wait("the replacement gateway to answer", replacement_serves, timeout_s=RECOVER_S)
        run.end()
        run.recover()
        run.report(
            "one of two gateway pods killed",
            f"; the replacement answered {run.fault_end - run.fault_start:.1f} s after the kill",
        )


def test_kv_cache_oversubscribed_4x(stack: Stack) -> None:
    """Eight requests of 64 tokens each sent at once to one replica whose KV cache holds 128:
    four times what fits. Requests are preempted and resumed, never dropped: each completes with
    every token asked for."""
    prompt, max_tokens, count = "x" * 8, 56, 8  # 8 x (8 + 56) tokens = 4 x KV_TOKENS
    assert count * (len(prompt) + max_tokens) == 4 * KV_TOKENS
    with under_traffic(stack) as run:
        replica = stack.runtime_pods()[0]
        url = f"http://{replica['status']['podIP']}:8000"
        before = pod_metric([replica], 8000, NUM_PREEMPTIONS)[replica["metadata"]["name"]]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        run.begin()
        with ThreadPoolExecutor(count) as pool:
            answers = list(
                pool.map(
                    lambda _: http(f"{url}/v1/completions", body, timeout_s=RECOVER_S), range(count)
                )
            )
        run.end()
        preempted = (
            pod_metric([replica], 8000, NUM_PREEMPTIONS)[replica["metadata"]["name"]] - before
        )
        run.recover()
        run.report(
            "one replica's KV cache oversubscribed 4x",
            f"; {count} requests completed in {run.fault_end - run.fault_start:.1f} s, {preempted:.0f} preemptions",
        )
    assert [a["usage"]["completion_tokens"] for a in answers] == [max_tokens] * count
    assert preempted > 0, "nothing was preempted: the KV cache was not oversubscribed"
