"""A ``conveyor serve`` pod on the built-in model, shaped as the operator makes them, becomes Ready."""

from __future__ import annotations

import json
import sys
import time

from agent_helpers import container_status, create, http_get, pod, wait_ready

from conveyor.cluster import Cluster
from conveyor.cluster.testing import KubeUnderTest

PORT = 8000
CACHE = "/var/cache/conveyor"


def test_conveyor_serve_pod_becomes_ready_and_answers(
    kube: KubeUnderTest, node_agent: Cluster, namespace: str
) -> None:
    api = kube.api
    probe = {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1, "timeoutSeconds": 3}
    manifest = pod(
        "runtime",
        ["conveyor"],
        args=[
            "serve",
            "--model",
            "conveyor-tiny",
            "--served-model-name",
            "tiny",
            "--host",
            "0.0.0.0",
            "--port",
            str(PORT),
        ],
        ports=[{"name": "http", "containerPort": PORT}],
        env=[
            {"name": "CONVEYOR_CACHE", "value": CACHE},
            {"name": "HOME", "value": f"{CACHE}/home"},
            {"name": "HF_HUB_OFFLINE", "value": "1"},
        ],
        resources={
            "limits": {"cpu": "500m", "memory": "2Gi"},
            "requests": {"cpu": "100m", "memory": "256Mi"},
        },
        volumeMounts=[
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "cache", "mountPath": CACHE},
        ],
        startupProbe={
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 1,
            "failureThreshold": 600,
        },
        readinessProbe=probe,
        livenessProbe={
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
        },
        lifecycle={"preStop": {"exec": {"command": ["sleep", "1"]}}},
        securityContext={
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
        },
        pod_spec={
            "terminationGracePeriodSeconds": 10,
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 1000,
                "runAsGroup": 1000,
                "fsGroup": 1000,
            },
            "volumes": [
                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "256Mi"}},
                {"name": "tmp", "emptyDir": {}},
                {"name": "cache", "emptyDir": {}},
            ],
        },
    )
    started = time.monotonic()
    create(api, namespace, manifest)
    p = wait_ready(api, namespace, "runtime", timeout_s=600)
    print(
        f"\n[figure] conveyor serve pod created to Ready: {time.monotonic() - started:.1f} s",
        file=sys.stderr,
    )
    assert container_status(p)["restartCount"] == 0
    ip = p["status"]["podIP"]
    load = json.loads(http_get(f"http://{ip}:{PORT}/load"))
    assert load["ready"] is True
    models = json.loads(http_get(f"http://{ip}:{PORT}/v1/models"))
    assert [m["id"] for m in models["data"]] == ["tiny"]
