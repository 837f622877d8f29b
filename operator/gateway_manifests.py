"""Pure builders of the namespace's shared gateway: ServiceAccount, Role, RoleBinding, Deployment, Service.

One gateway per namespace serves every LLMService in it (one base URL, routing by ``model``).
Each object carries an owner reference to every LLMService of the namespace, so the garbage
collector removes the gateway with the last of them and never before.
"""

from __future__ import annotations

from typing import Any

from conveyor.operator.names import (
    GATEWAY_NAME,
    GATEWAY_PORT,
    PORT_NAME,
    gateway_selector,
    managed_labels,
    rolling_update,
    scrape_annotations,
)
from conveyor.operator.owners import owner_reference
from conveyor.operator.rbac import GATEWAY_RULES
from conveyor.operator.settings import OperatorSettings

API_KEY_SECRET_KEY = "api-key"
"""Key of the operator's --gateway-api-key-secret Secret that holds the accepted bearer token."""
RUN_AS_USER = 1000


def _metadata(namespace: str, owners: list[dict[str, Any]]) -> dict[str, Any]:
    live = sorted(owners, key=lambda o: o["metadata"]["name"])
    return {
        "name": GATEWAY_NAME,
        "namespace": namespace,
        "labels": {**managed_labels("gateway")},
        "ownerReferences": [owner_reference(o, controller=False) for o in live],
    }


def gateway_url(namespace: str) -> str:
    """The gateway's in-cluster base URL (OpenAI clients append /chat/completions etc.)."""
    return f"http://{GATEWAY_NAME}.{namespace}.svc:{GATEWAY_PORT}/v1"


def gateway_service_account(namespace: str, owners: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(namespace, owners)}


def gateway_role(namespace: str, owners: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _metadata(namespace, owners),
        "rules": GATEWAY_RULES,
    }


def gateway_role_binding(namespace: str, owners: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(namespace, owners),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": GATEWAY_NAME},
        "subjects": [{"kind": "ServiceAccount", "name": GATEWAY_NAME, "namespace": namespace}],
    }


def gateway_deployment(
    namespace: str, owners: list[dict[str, Any]], settings: OperatorSettings
) -> dict[str, Any]:
    """The gateway pods: ``conveyor gateway`` discovering every LLMService of the namespace."""
    env: list[dict[str, Any]] = [
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    if settings.gateway_api_key_secret:
        ref = {"name": settings.gateway_api_key_secret, "key": API_KEY_SECRET_KEY}
        env.append({"name": "CONVEYOR_API_KEY", "valueFrom": {"secretKeyRef": ref}})
    container = {
        "name": "gateway",
        "image": settings.gateway_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["conveyor"],
        "args": [
            "gateway",
            "--port",
            str(GATEWAY_PORT),
            "--k8s-namespace",
            namespace,
            "--k8s-llmservices",
            "--routing",
            settings.gateway_routing,
            "--hold-timeout",
            f"{settings.gateway_hold_timeout_s:g}",
            *(["--queue-at-gateway"] if settings.gateway_queue else []),
        ],
        "ports": [{"name": PORT_NAME, "containerPort": GATEWAY_PORT, "protocol": "TCP"}],
        "env": env,
        "resources": {
            "requests": {"cpu": settings.gateway_cpu, "memory": settings.gateway_memory},
            "limits": {"cpu": settings.gateway_cpu, "memory": settings.gateway_memory},
        },
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": PORT_NAME},
            "periodSeconds": 2,
            "timeoutSeconds": 2,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": PORT_NAME},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        # finish in-flight streams after the endpoint is gone (uvicorn's graceful shutdown)
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", "5"]}}},
        "securityContext": {
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    labels = {**managed_labels("gateway")}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(namespace, owners),
        "spec": {
            "replicas": settings.gateway_replicas,
            "selector": {"matchLabels": gateway_selector()},
            "strategy": rolling_update(),
            "revisionHistoryLimit": 5,
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": scrape_annotations(GATEWAY_PORT),
                },
                "spec": {
                    "serviceAccountName": GATEWAY_NAME,
                    "containers": [container],
                    "terminationGracePeriodSeconds": 45,
                    "enableServiceLinks": False,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": RUN_AS_USER,
                        "runAsGroup": RUN_AS_USER,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                },
            },
        },
    }


def gateway_service(namespace: str, owners: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(namespace, owners),
        "spec": {
            "type": "ClusterIP",
            "selector": gateway_selector(),
            "ports": [
                {
                    "name": PORT_NAME,
                    "port": GATEWAY_PORT,
                    "targetPort": PORT_NAME,
                    "protocol": "TCP",
                }
            ],
        },
    }


def gateway_children(
    namespace: str, owners: list[dict[str, Any]], settings: OperatorSettings
) -> list[dict[str, Any]]:
    """Every gateway object, in the order they are applied (RBAC before the pods that use it)."""
    if not owners:
        raise ValueError("a gateway needs at least one LLMService to own it")
    return [
        gateway_service_account(namespace, owners),
        gateway_role(namespace, owners),
        gateway_role_binding(namespace, owners),
        gateway_service(namespace, owners),
        gateway_deployment(namespace, owners, settings),
    ]
