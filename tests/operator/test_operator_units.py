"""Status, placement, leader election, the CRD file, RBAC coverage and the command line."""

from __future__ import annotations

import pytest

from conveyor.operator.cli import parse_settings
from conveyor.operator.crd import apply_defaults, load_crd, schema
from conveyor.operator.gateway_manifests import gateway_children
from conveyor.operator.install import operator_deployment, operator_rbac
from conveyor.operator.kube import PLURALS
from conveyor.operator.leader import Observation, may_take
from conveyor.operator.placement import gpu_problem
from conveyor.operator.rbac import GATEWAY_RULES, OPERATOR_RULES
from conveyor.operator.runtime_manifests import runtime_children
from conveyor.operator.settings import OperatorSettings
from conveyor.operator.status import Problem, llmservice_status, merge_conditions

NOW = "2030-01-01T00:00:00Z"


def obj(**spec) -> dict:
    body = {"apiVersion": "conveyor.dev/v1alpha1", "kind": "LLMService",
            "metadata": {"name": "chat", "namespace": "ns", "uid": "u", "generation": 3},
            "spec": {"model": {"builtin": "conveyor-tiny"}, **spec}}  # fmt: skip
    return apply_defaults(body)


def deployment(
    *, replicas: int, ready: int, updated: int, spec_replicas: int, generation: int = 1
) -> dict:
    return {
        "metadata": {"generation": generation},
        "spec": {"replicas": spec_replicas},
        "status": {
            "observedGeneration": generation,
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": updated,
        },
    }


def conditions(status: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_status_phases_and_conditions() -> None:
    o = obj(replicas=2)
    pending = llmservice_status(o, None, problem=None, endpoint=None, now=NOW)
    assert pending["phase"] == "Pending" and pending["observedGeneration"] == 3
    assert conditions(pending)["Ready"] == ("False", "NoReadyReplica")
    rolling = llmservice_status(
        o,
        deployment(replicas=3, ready=2, updated=1, spec_replicas=2),
        problem=None,
        endpoint=None,
        now=NOW,
    )
    assert rolling["phase"] == "Progressing" and conditions(rolling)["Progressing"][0] == "True"
    assert conditions(rolling)["Ready"] == ("True", "ReplicasReady")
    ready = llmservice_status(
        o,
        deployment(replicas=2, ready=2, updated=2, spec_replicas=2),
        problem=None,
        endpoint={"url": "u"},
        now=NOW,
    )
    assert ready["phase"] == "Ready" and ready["endpoint"] == {"url": "u"}
    assert conditions(ready) == {
        "Ready": ("True", "ReplicasReady"),
        "Progressing": ("False", "RolloutComplete"),
        "Degraded": ("False", "AsExpected"),
    }
    degraded = llmservice_status(
        o, None, problem=Problem("InsufficientGPUs", "too many"), endpoint=None, now=NOW
    )
    assert degraded["phase"] == "Degraded" and conditions(degraded)["Degraded"] == (
        "True",
        "InsufficientGPUs",
    )
    zero = llmservice_status(
        obj(replicas=0),
        deployment(replicas=0, ready=0, updated=0, spec_replicas=0),
        problem=None,
        endpoint=None,
        now=NOW,
    )
    assert zero["phase"] == "ScaledToZero" and conditions(zero)["Ready"] == (
        "False",
        "ScaledToZero",
    )
    stalled = deployment(replicas=1, ready=0, updated=1, spec_replicas=1)
    stalled["status"]["conditions"] = [
        {
            "type": "Progressing",
            "status": "False",
            "reason": "ProgressDeadlineExceeded",
            "message": "slow",
        }
    ]
    assert (
        llmservice_status(o, stalled, problem=None, endpoint=None, now=NOW)["phase"] == "Degraded"
    )


def test_condition_transition_times_change_only_with_the_status() -> None:
    old = [{"type": "Ready", "status": "True", "lastTransitionTime": "then"}]
    same = merge_conditions(
        old, [{"type": "Ready", "status": "True", "reason": "r", "message": "m"}], NOW, 2
    )
    assert same[0]["lastTransitionTime"] == "then" and same[0]["observedGeneration"] == 2
    flipped = merge_conditions(
        old, [{"type": "Ready", "status": "False", "reason": "r", "message": "m"}], NOW, 2
    )
    assert flipped[0]["lastTransitionTime"] == NOW


def node(gpus: int, **labels: str) -> dict:
    return {
        "metadata": {"name": "n", "labels": labels},
        "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}},
    }


def test_gpu_fit_against_the_eligible_nodes() -> None:
    nodes = [node(8, pool="h100"), node(4, pool="a10")]
    assert gpu_problem({"resources": {"gpus": 8}}, nodes) is None
    assert gpu_problem({"resources": {"gpus": 0}}, []) is None
    problem = gpu_problem(
        {"resources": {"gpus": 8}, "placement": {"nodeSelector": {"pool": "a10"}}}, nodes
    )
    assert (
        problem is not None and problem.reason == "InsufficientGPUs" and "has 4" in problem.message
    )
    none = gpu_problem(
        {"resources": {"gpus": 1}}, [{"metadata": {"name": "cpu"}, "status": {"allocatable": {}}}]
    )
    assert none is not None and "no schedulable nodes advertise nvidia.com/gpu" in none.message
    cordoned = dict(node(8), spec={"unschedulable": True})
    assert gpu_problem({"resources": {"gpus": 2}}, [cordoned]) is not None


def test_lease_may_be_taken_when_free_own_or_unrenewed_for_its_duration() -> None:
    assert may_take({}, "a", None, 0.0, 15)
    assert may_take({"holderIdentity": ""}, "a", None, 0.0, 15)
    assert may_take({"holderIdentity": "a"}, "a", None, 0.0, 15)
    seen = Observation(("b", "t1"), since=100.0)
    assert not may_take({"holderIdentity": "b"}, "a", seen, 110.0, 15)
    assert may_take({"holderIdentity": "b"}, "a", seen, 115.0, 15)
    assert not may_take(
        {"holderIdentity": "b"}, "a", None, 1e9, 15
    )  # never observed: wait a full duration


def test_crd_names_subresources_and_printer_columns() -> None:
    crd = load_crd()
    assert crd["metadata"]["name"] == "llmservices.conveyor.dev"
    assert crd["spec"]["names"]["shortNames"] == ["llms"]
    (version,) = crd["spec"]["versions"]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas", "labelSelectorPath": ".status.selector",
    }  # fmt: skip
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Model",
        "Ready",
        "Desired",
        "Phase",
        "Queue",
        "TTFT-P95",
        "Age",
    ]
    status = schema()["properties"]["status"]["properties"]
    assert {
        "phase",
        "replicas",
        "readyReplicas",
        "desiredReplicas",
        "selector",
        "observedGeneration",
        "conditions",
        "endpoint",
        "autoscaler",
    } <= status.keys()
    assert {"queueDepthPerReplica", "ttftP95Seconds", "kvCacheUsage"} <= status["autoscaler"][
        "properties"
    ]["signals"]["properties"].keys()


def _allowed(rules: list[dict], group: str, resource: str, verb: str) -> bool:
    return any(
        group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rules
    )


def test_rbac_covers_every_child_and_grants_the_gateway_nothing_the_operator_lacks() -> None:
    o = obj(resources={"gpus": 1})
    manifests = runtime_children(o, OperatorSettings(), podmonitor=True) + gateway_children(
        "ns", [o], OperatorSettings()
    )
    for manifest in manifests:
        group = manifest["apiVersion"].rpartition("/")[0]
        for verb in ("get", "create", "patch"):
            assert _allowed(OPERATOR_RULES, group, PLURALS[manifest["kind"]], verb), (
                manifest["kind"],
                verb,
            )
    for rule in GATEWAY_RULES:  # RBAC forbids granting what one does not hold
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert _allowed(OPERATOR_RULES, group, resource, verb)
    for verb in ("get", "patch"):
        assert _allowed(OPERATOR_RULES, "conveyor.dev", "llmservices/status", verb)
    # the autoscaler reads how long replicas took to start from their pods, and no more
    assert _allowed(OPERATOR_RULES, "", "pods", "list")
    assert not _allowed(OPERATOR_RULES, "", "pods", "delete")
    assert not any("*" in r["verbs"] or "*" in r["resources"] for r in OPERATOR_RULES)
    kinds = [m["kind"] for m in operator_rbac("conveyor-system")]
    assert kinds == ["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"]
    deployment = operator_deployment("conveyor-system")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "conveyor-operator"


def test_command_line_to_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "conveyor-operator-abc")
    monkeypatch.setenv("POD_NAMESPACE", "conveyor-system")
    s = parse_settings(
        [
            "--namespace",
            "a",
            "--namespace",
            "b",
            "--gateway-replicas",
            "2",
            "--no-leader-election",
            "--resync-interval",
            "30",
        ]
    )
    assert s.namespaces == ("a", "b") and s.gateway_replicas == 2 and not s.leader_election
    assert (
        s.identity == "conveyor-operator-abc"
        and s.lease_namespace == "conveyor-system"
        and s.port == 8081
    )
    assert s.resync_interval_s == 30.0
    with pytest.raises(ValueError, match="--lease-renew-interval must be shorter"):
        parse_settings(["--lease-duration", "5", "--lease-renew-interval", "5"])
