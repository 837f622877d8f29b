"""The cluster's DNS (CoreDNS): pods find Services by name, as on any Kubernetes cluster.

A server pod behind a ClusterIP Service and a headless one; a client pod resolves the
Service's short, namespaced and full names, the headless Service's pod, and the apiserver's
name, fetches a page through the Service by name, and fails at once on a name outside the
cluster (there is nothing outside to ask).
"""

from __future__ import annotations

import json

from pod_helpers import create, pod, wait_phase, wait_ready

from conveyor.cluster import Cluster
from conveyor.cluster.testing import KubeUnderTest

PORT = 8080

# Names that need the Service's endpoints are retried for a while: CoreDNS learns of the
# endpoints from a watch, shortly after the server is Ready.
CLIENT = """
import json, socket, sys, time, urllib.request
ns = sys.argv[1]

def resolve(name, deadline_s):
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return sorted({a[4][0] for a in socket.getaddrinfo(name, None, socket.AF_INET)})
        except socket.gaierror as exc:
            if time.monotonic() > deadline:
                return f'error: {exc}'
            time.sleep(0.5)

out = {name: resolve(name, 60) for name in
       ('web', f'web.{ns}', f'web.{ns}.svc.cluster.local', f'web-pods.{ns}.svc', 'kubernetes.default.svc')}
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
out['page'] = opener.open(f'http://web.{ns}.svc/', timeout=10).read().decode()
t0 = time.monotonic()
out['outside'] = resolve('conveyor-test.example.org', 0)
out['outside_s'] = round(time.monotonic() - t0, 2)
print(json.dumps(out), flush=True)
"""

SERVER = f"""
import http.server
class Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'hello from web'
        self.send_response(200)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)
http.server.ThreadingHTTPServer(('', {PORT}), Page).serve_forever()
"""


def _service(name: str, *, headless: bool = False) -> dict:
    spec: dict = {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": PORT}]}
    if headless:
        spec["clusterIP"] = "None"
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "spec": spec}


def test_pods_find_services_by_name(
    kube: KubeUnderTest, own_cluster: Cluster, namespace: str
) -> None:
    api = kube.api
    create(
        api,
        namespace,
        pod(
            "web",
            ["python", "-c", SERVER],
            labels={"app": "web"},
            ports=[{"containerPort": PORT}],
            readinessProbe={"tcpSocket": {"port": PORT}, "periodSeconds": 1},
        ),
    )
    service = create(api, namespace, _service("web"))
    create(api, namespace, _service("web-pods", headless=True))
    server = wait_ready(api, namespace, "web")
    create(
        api,
        namespace,
        pod("client", ["python", "-c", CLIENT, namespace], pod_spec={"restartPolicy": "Never"}),
    )
    p = wait_phase(api, namespace, "client", "Succeeded", "Failed")
    logs = kube.kubectl("logs", "-n", namespace, "client").stdout
    assert p["status"]["phase"] == "Succeeded", logs
    got = json.loads(logs.strip().splitlines()[-1])

    cluster_ip = [service["spec"]["clusterIP"]]
    assert got["web"] == got[f"web.{namespace}"] == cluster_ip, got
    assert got[f"web.{namespace}.svc.cluster.local"] == cluster_ip, got
    assert got[f"web-pods.{namespace}.svc"] == [server["status"]["podIP"]], got
    kubernetes = api.get("/api/v1/namespaces/default/services/kubernetes")
    assert got["kubernetes.default.svc"] == [kubernetes["spec"]["clusterIP"]], got
    assert got["page"] == "hello from web"
    assert str(got["outside"]).startswith("error:"), got
