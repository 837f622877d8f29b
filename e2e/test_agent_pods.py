"""Pods that really run: readiness, Services, volumes, environment, logs (the node agent)."""

from __future__ import annotations

import base64
import re
import subprocess
import sys
import time

from agent_helpers import (
    container_status,
    create,
    get_pod,
    http_get,
    pod,
    wait_phase,
    wait_ready,
)

from conveyor.cluster import Cluster
from conveyor.cluster.testing import ECHO_SERVER, KubeUnderTest

PORT = 8080


def echo_pod(name: str, reply: str, app: str) -> dict:
    """The part-1 echo server on all of the pod's addresses, Ready through an HTTP readiness probe."""
    return pod(
        name,
        ["python", "-c", ECHO_SERVER, "0.0.0.0", str(PORT), reply],
        labels={"app": app},
        ports=[{"name": "http", "containerPort": PORT}],
        readinessProbe={"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
    )


def test_http_pods_become_ready_and_serve_at_pod_ip_and_cluster_ip(
    kube: KubeUnderTest, node_agent: Cluster, namespace: str
) -> None:
    api = kube.api
    create(
        api,
        namespace,
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "echo"},
            "spec": {"selector": {"app": "echo"}, "ports": [{"port": 80, "targetPort": PORT}]},
        },
    )
    started = time.monotonic()
    for name in ("echo-a", "echo-b"):
        create(api, namespace, echo_pod(name, f"hello from {name}", "echo"))
    ready = {name: wait_ready(api, namespace, name) for name in ("echo-a", "echo-b")}
    print(
        f"\n[figure] two trivial HTTP pods created to both Ready: {time.monotonic() - started:.2f} s",
        file=sys.stderr,
    )

    ips = {}
    for name, p in ready.items():
        status = p["status"]
        assert status["phase"] == "Running"
        assert status["hostIP"] == node_agent.host_address
        assert status["podIPs"] == [{"ip": status["podIP"]}]
        assert status["startTime"]
        cs = container_status(p)
        assert cs["ready"] and cs["started"] and cs["restartCount"] == 0
        assert "running" in cs["state"]
        ips[name] = status["podIP"]
        # The same port on two pods, each at its own address.
        assert http_get(f"http://{status['podIP']}:{PORT}/") == f"hello from {name}"
    assert len(set(ips.values())) == 2

    def slice_addresses() -> set[str]:
        slices = api.get(
            f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices",
            labelSelector="kubernetes.io/service-name=echo",
        )["items"]
        return {
            a
            for s in slices
            for e in s.get("endpoints") or []
            if (e.get("conditions") or {}).get("ready")
            for a in e["addresses"]
        }

    api.wait_for(
        "both pods in the EndpointSlice",
        lambda: slice_addresses() == set(ips.values()),
        timeout_s=60,
    )
    cluster_ip = api.get(f"/api/v1/namespaces/{namespace}/services/echo")["spec"]["clusterIP"]
    replies = set()

    def both_answer() -> bool:
        replies.add(http_get(f"http://{cluster_ip}:80/"))
        return replies == {"hello from echo-a", "hello from echo-b"}

    api.wait_for("both pods answering at the ClusterIP", both_answer, timeout_s=60, interval_s=0.01)


def test_secret_as_volume_and_env_dev_shm_and_kubectl_logs(
    kube: KubeUnderTest, node_agent: Cluster, namespace: str
) -> None:
    api = kube.api
    create(
        api,
        namespace,
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "creds"},
            "data": {"password": base64.b64encode(b"s3cret").decode()},
        },
    )
    create(
        api,
        namespace,
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "settings"},
            "data": {"MODE": "fast"},
        },
    )
    script = (
        "import os; "
        "print('file', open('/etc/creds/password').read()); "
        "print('env', os.environ['PASSWORD'], os.environ['MODE'], os.environ['POD_NAME'], os.environ['POD_IP']); "
        "st = os.statvfs('/dev/shm'); print('shm', st.f_blocks * st.f_frsize); "
        "print('cwd', os.getcwd()); "
        "print('api', os.environ['KUBERNETES_SERVICE_HOST'], os.environ['KUBERNETES_SERVICE_PORT'])"
    )
    create(
        api,
        namespace,
        pod(
            "reader",
            ["python", "-c", script],
            workingDir="/work-dir",
            env=[
                {
                    "name": "PASSWORD",
                    "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}},
                },
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            ],
            envFrom=[{"configMapRef": {"name": "settings"}}],
            volumeMounts=[
                {"name": "creds", "mountPath": "/etc/creds", "readOnly": True},
                {"name": "shm", "mountPath": "/dev/shm"},
                {"name": "work", "mountPath": "/work-dir"},
            ],
            pod_spec={
                "restartPolicy": "Never",
                "volumes": [
                    {"name": "creds", "secret": {"secretName": "creds"}},
                    {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}},
                    {"name": "work", "emptyDir": {}},
                ],
            },
        ),
    )
    done = wait_phase(api, namespace, "reader", "Succeeded", "Failed")
    logs = kube.kubectl("logs", "-n", namespace, "reader").stdout
    assert done["status"]["phase"] == "Succeeded", logs
    terminated = container_status(done)["state"]["terminated"]
    assert terminated["exitCode"] == 0 and terminated["reason"] == "Completed"
    lines = dict(line.split(" ", 1) for line in logs.splitlines())
    assert lines["file"] == "s3cret"
    assert lines["env"] == f"s3cret fast reader {done['status']['podIP']}"
    assert int(lines["shm"]) == 64 * 2**20
    assert lines["cwd"] == "/work-dir"
    service = api.get("/api/v1/namespaces/default/services/kubernetes")["spec"]["clusterIP"]
    assert lines["api"] == f"{service} 443"


def test_unknown_image_waits_with_err_image_pull(
    kube: KubeUnderTest, node_agent: Cluster, namespace: str
) -> None:
    api = kube.api
    manifest = pod("nope", ["true"])
    manifest["spec"]["containers"][0]["image"] = "registry.example/nothing-here:1"
    create(api, namespace, manifest)
    p = wait_phase(api, namespace, "nope", "Pending")

    def waiting_reason(p: dict) -> str | None:
        return (container_status(p).get("state") or {}).get("waiting", {}).get("reason")

    api.wait_for(
        "ErrImagePull",
        lambda: waiting_reason(get_pod(api, namespace, "nope")) == "ErrImagePull",
        timeout_s=60,
    )
    p = get_pod(api, namespace, "nope")
    assert "nothing-here" in container_status(p)["state"]["waiting"]["message"]
    assert p["status"]["phase"] == "Pending"


def test_kubectl_port_forward_reaches_the_pod(
    kube: KubeUnderTest, node_agent: Cluster, namespace: str
) -> None:
    api = kube.api
    create(api, namespace, echo_pod("forwarded", "through kwok", "forwarded"))
    wait_ready(api, namespace, "forwarded")
    proc = subprocess.Popen(
        [
            kube.kubectl_path,
            f"--kubeconfig={kube.kubeconfig}",
            "-n",
            namespace,
            "port-forward",
            "pod/forwarded",
            f":{PORT}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # "Forwarding from 127.0.0.1:NNNNN -> 8080"
        match = re.search(r"127\.0\.0\.1:(\d+) ->", first)
        assert match, first
        assert http_get(f"http://127.0.0.1:{match.group(1)}/") == "through kwok"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()
