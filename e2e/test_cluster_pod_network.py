"""The pod network: a server in a pod's network namespace, found through its Service.

On the node agent the test makes the pod's network with the code the agent calls
(``PodNetworks``) and reports the pod's status through the real API, as a kubelet does. On
real nodes a kubelet runs both pods from the project's image, on the CNI bridge plugin's
network, and the same addresses are checked from the host and from inside the pods.
"""

from __future__ import annotations

import ipaddress
import urllib.request

import pytest
from agent_helpers import create, pod, wait_phase, wait_ready
from real_nodes_helpers import runs_on_real_nodes

from conveyor.cluster import Cluster
from conveyor.cluster.testing import KubeUnderTest, PodProcesses
from conveyor.operator.names import IMAGE

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
"""A pod's server on real nodes: answers every GET with its first argument."""
FETCH = """
import sys, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
print(opener.open(sys.argv[1], timeout=10).read().decode(), end="")
"""
"""Run inside a pod on real nodes: GET a URL and print the body."""


def _get(url: str) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=5) as resp:
        return resp.read().decode()


def _pod(name: str, app: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        # The test makes this pod's network and status by hand: the node agent leaves it alone.
        "metadata": {
            "name": name,
            "labels": {"app": app},
            "annotations": {"conveyor.dev/node-agent": "skip"},
        },
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": IMAGE,
                    "ports": [{"name": "http", "containerPort": PORT}],
                    "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
                }
            ]
        },
    }


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
            return _get(f"http://{cluster_ip}:80/")
        except OSError:
            return None  # kube-proxy has not written the Service's rules yet

    return kube.api.wait_for("the ClusterIP to answer", answer, timeout_s=TIMEOUT_S)


def _scheduled(kube: KubeUnderTest, namespace: str, name: str) -> dict:
    return kube.api.wait_for(
        f"pod {name} scheduled",
        lambda: (
            (p := kube.api.get(f"/api/v1/namespaces/{namespace}/pods/{name}"))["spec"].get(
                "nodeName"
            )
            and p
        ),
        timeout_s=TIMEOUT_S,
    )


def test_server_in_a_pod_is_reached_at_its_pod_ip_and_cluster_ip(
    kube: KubeUnderTest, own_cluster: Cluster, namespace: str, pods: PodProcesses
) -> None:
    api = kube.api
    api.create(f"/api/v1/namespaces/{namespace}/pods", _pod("echo", "echo"))
    api.create(f"/api/v1/namespaces/{namespace}/pods", _pod("client", "client"))
    service = api.create(
        f"/api/v1/namespaces/{namespace}/services",
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "echo"},
            "spec": {"selector": {"app": "echo"}, "ports": [{"port": 80, "targetPort": "http"}]},
        },
    )
    cluster_ip = service["spec"]["clusterIP"]
    assert ipaddress.ip_address(cluster_ip) in own_cluster.plan.service_cidr

    echo_net = pods.network(namespace, "echo")
    client_net = pods.network(namespace, "client")
    pods.serve(echo_net, PORT, "hello from echo")
    for name, net in (("echo", echo_net), ("client", client_net)):
        _scheduled(kube, namespace, name)
        pods.mark_running(namespace, name, net)

    endpoints = _ready_endpoints(kube, namespace)
    assert endpoints[0]["addresses"] == [str(echo_net.address)]
    assert endpoints[0]["targetRef"]["name"] == "echo"

    # From the host: the pod IP directly, then the ClusterIP through kube-proxy's rules.
    assert _get(f"http://{echo_net.address}:{PORT}/") == "hello from echo"
    assert _answer_at_cluster_ip(kube, cluster_ip) == "hello from echo"
    # From another pod's network namespace, and from the pod itself (hairpin), at the ClusterIP.
    assert pods.fetch_from(client_net, f"http://{cluster_ip}:80/") == "hello from echo"
    assert pods.fetch_from(echo_net, f"http://{cluster_ip}:80/") == "hello from echo"


def test_pod_networks_get_distinct_addresses_from_the_slice(
    own_cluster: Cluster, pods: PodProcesses
) -> None:
    a = pods.network("addr-test", "a")
    b = pods.network("addr-test", "b")
    assert a.address != b.address
    for net in (a, b):
        assert net.address in own_cluster.plan.pod_cidr
        assert net.gateway == own_cluster.plan.host_address
    assert {a.netns, b.netns} <= set(own_cluster.pod_networks.list_netns())


def test_a_server_in_a_pod_on_a_real_node_is_reached_at_its_pod_ip_and_cluster_ip(
    kube: KubeUnderTest, own_cluster: Cluster, namespace: str
) -> None:
    """The same, with pods a kubelet runs: the server's pod IP comes from the CNI bridge
    plugin's range, its Service's endpoint follows its readiness probe, and its ClusterIP
    answers from the host, from another pod and from the pod itself (hairpin)."""
    if not runs_on_real_nodes(own_cluster):
        pytest.skip("real nodes only; the node agent's pods: the test above")
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
    echo = wait_ready(api, namespace, "echo")
    wait_phase(api, namespace, "client", "Running")
    pod_ip = echo["status"]["podIP"]
    assert ipaddress.ip_address(pod_ip) in own_cluster.plan.pod_cidr

    endpoints = _ready_endpoints(kube, namespace)
    assert [a for e in endpoints for a in e["addresses"]] == [pod_ip]
    assert _get(f"http://{pod_ip}:{PORT}/") == "hello from echo"
    assert _answer_at_cluster_ip(kube, cluster_ip) == "hello from echo"
    for name in ("client", "echo"):  # another pod, then the server's own pod (hairpin)
        fetched = kube.kubectl(
            "-n", namespace, "exec", name, "--", "python", "-c", FETCH, f"http://{cluster_ip}:80/"
        )  # fmt: skip
        assert fetched.stdout == "hello from echo", (name, fetched.stderr)
