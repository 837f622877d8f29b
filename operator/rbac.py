"""Every RBAC rule Conveyor needs, in one place.

The e2e tests and the Helm chart's ClusterRole and Role are generated from these lists, so a
permission a handler lacks fails a test instead of waiting for a user. No broader than the
handlers need: the operator reads Nodes (to tell a spec that cannot fit), writes the children
it owns, its Lease and Events; the gateway only reads EndpointSlices and LLMServices.
"""

from __future__ import annotations

from typing import Any

from conveyor.operator.names import GROUP, PLURAL

READ = ["get", "list", "watch"]
WRITE = ["get", "list", "watch", "create", "patch", "update", "delete"]

OPERATOR_RULES: list[dict[str, Any]] = [
    # the resource itself: watched, annotated by kopf (progress), status and scale written
    {
        "apiGroups": [GROUP],
        "resources": [PLURAL],
        "verbs": ["get", "list", "watch", "patch", "update"],
    },
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "verbs": ["get", "patch", "update"]},
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/scale"], "verbs": ["get", "patch", "update"]},
    # owner references with blockOwnerDeletion need update on the owner's finalizers
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/finalizers"], "verbs": ["update"]},
    # children: runtime and gateway
    {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": WRITE},
    {"apiGroups": [""], "resources": ["services", "serviceaccounts"], "verbs": WRITE},
    {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": WRITE},
    {
        "apiGroups": ["rbac.authorization.k8s.io"],
        "resources": ["roles", "rolebindings"],
        "verbs": WRITE,
    },
    {"apiGroups": ["monitoring.coreos.com"], "resources": ["podmonitors"], "verbs": WRITE},
    # GPU capacity of nodes (a spec that cannot fit is Degraded); replicas' addresses (the
    # autoscaler's scrapes; also needed to grant the gateway's Role, RBAC forbids escalation)
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list"]},
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": READ},
    # how long a replica's pod took from creation to Ready (the autoscaler sizes for the start)
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]},
    # kopf: events for each action, namespaces to watch, CRDs to find its resource
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": READ},
    {
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions"],
        "verbs": READ,
    },
]
"""The operator's ClusterRole (or, with watched namespaces, the same rules in each namespace)."""

LEASE_RULES: list[dict[str, Any]] = [
    {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "verbs": ["get", "create", "update", "patch"],
    },
]
"""The operator's Role in its own namespace, for leader election."""

GATEWAY_RULES: list[dict[str, Any]] = [
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": READ},
    {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": READ},
]
"""The Role of each namespace's gateway: which LLMServices exist, and where their replicas are."""


def cluster_role(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": OPERATOR_RULES,
    }
