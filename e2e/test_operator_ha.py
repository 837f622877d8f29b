"""The operator's availability on a real apiserver: killed mid-reconcile it leaves no
duplicates or orphans, a standby takes over the Lease of a crashed leader, and the operator
runs as a pod under its own RBAC with a standby. The operator runs as a local process under
its own ServiceAccount's token and RBAC (``operator_helpers``), watching only the test's
namespace, except where it runs as a pod.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from operator_helpers import (
    RECONCILE_S,
    OperatorProcess,
    apply_yaml,
    children,
    deployment,
    llmservice,
    path_of,
    reconciled,
    release_llmservices,
    tiny_example,
    wait_for,
)

# the fixtures these tests and their fixtures ask for by name
from conveyor.cluster.testing import KubeUnderTest


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
