"""The operator's own install without Helm: its ServiceAccount, RBAC (from ``rbac.py``), Deployment.

Used by ``conveyor operator manifests`` and by the e2e tests, which run the operator as a pod
under exactly these permissions (never as cluster admin), so a missing rule fails a test.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import yaml

from conveyor.operator.crd import load_crd
from conveyor.operator.names import (
    APP,
    APP_LABEL,
    COMPONENT_LABEL,
    IMAGE,
    OPERATOR_PORT,
    PORT_NAME,
)
from conveyor.operator.rbac import LEASE_RULES, OPERATOR_RULES

NAME = "conveyor-operator"


def _labels() -> dict[str, str]:
    return {APP_LABEL: APP, COMPONENT_LABEL: "operator"}


def operator_rbac(namespace: str, *, name: str = NAME) -> list[dict[str, Any]]:
    """ServiceAccount, ClusterRole + binding (the handlers' rules), Role + binding (the Lease)."""
    meta = {"name": name, "labels": _labels()}
    subject = [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]
    rbac = "rbac.authorization.k8s.io"
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {**meta, "namespace": namespace},
        },
        {
            "apiVersion": f"{rbac}/v1",
            "kind": "ClusterRole",
            "metadata": meta,
            "rules": OPERATOR_RULES,
        },
        {
            "apiVersion": f"{rbac}/v1",
            "kind": "ClusterRoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": rbac, "kind": "ClusterRole", "name": name},
            "subjects": subject,
        },
        {
            "apiVersion": f"{rbac}/v1",
            "kind": "Role",
            "metadata": {**meta, "namespace": namespace},
            "rules": LEASE_RULES,
        },
        {
            "apiVersion": f"{rbac}/v1",
            "kind": "RoleBinding",
            "metadata": {**meta, "namespace": namespace},
            "roleRef": {"apiGroup": rbac, "kind": "Role", "name": name},
            "subjects": subject,
        },
    ]


def operator_deployment(
    namespace: str,
    *,
    image: str = IMAGE,
    replicas: int = 2,
    args: tuple[str, ...] = (),
    name: str = NAME,
) -> dict[str, Any]:
    """The operator's Deployment: ``replicas`` pods, one acting (the Lease), the others standing by."""
    env = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    probe = {
        "httpGet": {"path": "/healthz", "port": PORT_NAME},
        "periodSeconds": 10,
        "timeoutSeconds": 5,
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": _labels()},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": _labels()},
            "template": {
                "metadata": {
                    "labels": _labels(),
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(OPERATOR_PORT),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": {
                    "serviceAccountName": name,
                    "enableServiceLinks": False,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": 1000,
                        "runAsGroup": 1000,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [
                        {
                            "name": "operator",
                            "image": image,
                            "command": ["conveyor"],
                            "args": ["operator", "--lease-name", name, *args],
                            "ports": [{"name": PORT_NAME, "containerPort": OPERATOR_PORT}],
                            "env": env,
                            "livenessProbe": probe,
                            "readinessProbe": probe,
                            "resources": {
                                "requests": {"cpu": "100m", "memory": "256Mi"},
                                "limits": {"cpu": "1", "memory": "512Mi"},
                            },
                            "securityContext": {
                                "allowPrivilegeEscalation": False,
                                "readOnlyRootFilesystem": True,
                                "capabilities": {"drop": ["ALL"]},
                            },
                        }
                    ],
                },
            },
        },
    }


def main_manifests(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="conveyor operator manifests", description=__doc__)
    parser.add_argument("--namespace", default="conveyor-system", help="namespace of the operator")
    parser.add_argument(
        "--image", default=IMAGE, help="the operator's image (default: %(default)s)"
    )
    parser.add_argument("--replicas", type=int, default=2, help="operator replicas (one acts)")
    args = parser.parse_args(argv)
    docs = [
        load_crd(),
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": args.namespace}},
        *operator_rbac(args.namespace),
        operator_deployment(args.namespace, image=args.image, replicas=args.replicas),
    ]
    yaml.safe_dump_all(docs, sys.stdout, sort_keys=False)
    return 0
