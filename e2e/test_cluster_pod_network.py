"""The pod network: a server in a pod, found through its Service.

A kubelet runs both pods from the project's image, on the CNI bridge plugin's network, and the
same addresses are checked from the host and from inside the pods.
"""

from __future__ import annotations

import ipaddress

from pod_helpers import create, http_get, pod, wait_phase, wait_ready

from conveyor.cluster import Cluster
from conveyor.cluster.testing import KubeUnderTest

TIMEOUT_S = 90
PORT = 8080
SERVE = """
import http.server, sys
body = sys.argv[1].encode()
class Echo(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
http.server.ThreadingHTTPServer(("", int(sys.argv[2])), Echo).serve_forever()
"""
"""A pod's server: answers every GET with its first argument."""
FETCH = """
import sys, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
print(opener.open(sys.argv[1], timeout=10).read().decode(), end="")
"""
"""Run inside a pod: GET a URL and print the body."""


def _ready_endpoints(kube: KubeUnderTest, namespace: str) -> list[dict]:
    """The echo Service's ready endpoints, once it has one."""

    def ready() -> list[dict] | None:
        slices = kube.api.get(
            f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices",
            labelSelector="kubernetes.io/service-name=echo",
        )["items"]
        endpoints = [e for s in slices for e in s.get("endpoints") or []]
        return [e for e in endpoints if e["conditions"].get("ready")] or None

    return kube.api.wait_for(
        "the echo pod in its Service's EndpointSlice", ready, timeout_s=TIMEOUT_S
    )


def _answer_at_cluster_ip(kube: KubeUnderTest, cluster_ip: str) -> str:
    """What the ClusterIP answers from the host, once kube-proxy has written its rules."""

    def answer() -> str | None:
        try:
            return http_get(f"http://{cluster_ip}:80/")
        except OSError:
            return None  # kube-proxy has not written the Service's rules yet

    return kube.api.wait_for("the ClusterIP to answer", answer, timeout_s=TIMEOUT_S)


def test_server_in_a_pod_is_reached_at_its_pod_ip_and_cluster_ip(
    kube: KubeUnderTest, own_cluster: Cluster, namespace: str
) -> None:
    """Each pod gets its own address from the CNI bridge plugin's range, the server's Service
    endpoint follows its readiness probe, and its ClusterIP answers from the host, from another
    pod and from the pod itself (hairpin)."""
    api = kube.api
    probe = {"httpGet": {"path": "/", "port": PORT}, "periodSeconds": 1}
    create(api, namespace, pod(
        "echo", ["python", "-c", SERVE, "hello from echo", str(PORT)],
        ports=[{"name": "http", "containerPort": PORT}], readinessProbe=probe,
    ))  # fmt: skip
    create(api, namespace, pod("client", ["sleep", "600"]))
    service = create(api, namespace, {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "echo"},
        "spec": {"selector": {"app": "echo"}, "ports": [{"port": 80, "targetPort": "http"}]},
    })  # fmt: skip
    cluster_ip = service["spec"]["clusterIP"]
    assert ipaddress.ip_address(cluster_ip) in own_cluster.plan.service_cidr
    echo = wait_ready(api, namespace, "echo")
    client = wait_phase(api, namespace, "client", "Running")
    pod_ip = echo["status"]["podIP"]
    addresses = {pod_ip, client["status"]["podIP"]}
    assert len(addresses) == 2, "two pods, two addresses"
    assert all(ipaddress.ip_address(a) in own_cluster.plan.pod_cidr for a in addresses)

    endpoints = _ready_endpoints(kube, namespace)
    assert [a for e in endpoints for a in e["addresses"]] == [pod_ip]
    assert http_get(f"http://{pod_ip}:{PORT}/") == "hello from echo"
    assert _answer_at_cluster_ip(kube, cluster_ip) == "hello from echo"
    for name in ("client", "echo"):  # another pod, then the server's own pod (hairpin)
        fetched = kube.kubectl(
            "-n", namespace, "exec", name, "--", "python", "-c", FETCH, f"http://{cluster_ip}:80/"
        )  # fmt: skip
        assert fetched.stdout == "hello from echo", (name, fetched.stderr)
