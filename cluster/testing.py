"""Helpers for tests against a cluster (``e2e/`` and any test given a cluster): no pytest inside.

``KubeUnderTest`` is the cluster a test run uses, ours or the one ``KUBECONFIG``
names. ``PodProcesses`` makes pods by hand: a network from ``PodNetworks``, a server process
in it, the pod's status patched through the API, as the node agent does for the pods it runs.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from conveyor.cluster.api import ApiClient, kubeconfig, write_kubeconfig
from conveyor.cluster.cluster import Cluster
from conveyor.cluster.leftovers import find_leftovers
from conveyor.cluster.podnet import PodNetwork

# A tiny HTTP server for pod network namespaces. It answers GET with its name and never
# looks names up (http.server's HTTPServer does, on bind, which would send DNS queries).
ECHO_SERVER = r"""
import socketserver, sys
from http.server import BaseHTTPRequestHandler
address, port, reply = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode()
class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)
    def log_message(self, *args):
        pass
socketserver.TCPServer.allow_reuse_address = True
with socketserver.TCPServer((address, port), Handler) as server:
    server.serve_forever()
"""

# Fetch a URL without any proxy and print the body (run inside a pod network namespace).
FETCH = r"""
import sys, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
print(opener.open(sys.argv[1], timeout=5).read().decode())
"""


def leftovers_of(cluster: Cluster) -> dict[str, list[str]]:
    """What ``cluster``, stopped, left on the host: the kinds with something (empty: nothing)."""
    tools = cluster.tools.directory if cluster.tools is not None else None
    left = find_leftovers(cluster.plan, cluster_name=cluster.settings.name, tools_dir=tools)
    return {kind: found for kind, found in left.items() if found}


@dataclass
class KubeUnderTest:
    """The cluster the tests run against: ours (``cluster`` set) or the one ``KUBECONFIG`` names."""

    kubeconfig: Path
    kubectl_path: str
    cluster: Cluster | None
    baseline_rulesets: dict[str, str] = field(default_factory=dict)
    owned: bool = True
    """False when the tests found a cluster already running and only use it."""

    @property
    def api(self) -> ApiClient:
        if self.cluster is not None:
            return self.cluster.api
        return ApiClient.from_kubeconfig(self.kubeconfig)

    def token_kubeconfig(self, token: str, path: Path) -> Path:
        """Write a kubeconfig for the same server that logs in with ``token`` alone."""
        creds = self.api.credentials
        write_kubeconfig(
            path,
            kubeconfig(server=creds.server, ca=creds.ca_file, user="token-user", token=token),
        )
        return path

    def kubectl(
        self,
        *args: str,
        input_: str | None = None,
        check: bool = True,
        kubeconfig_path: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against the cluster, as a user would (as admin unless told another kubeconfig)."""
        proc = subprocess.run(
            [self.kubectl_path, f"--kubeconfig={kubeconfig_path or self.kubeconfig}", *args],
            capture_output=True,
            text=True,
            input=input_,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr}"
            )
        return proc


class PodProcesses:
    """Hand-made pods for tests: a network from ``PodNetworks``, a server process in it, the status patched.

    What the node agent does for the pods it runs; here each piece is owned by the test and removed.
    """

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.networks: list[tuple[str, str]] = []
        self.processes: list[subprocess.Popen[bytes]] = []

    def network(self, namespace: str, name: str) -> PodNetwork:
        """Make the pod's network namespace."""
        net = self.cluster.pod_networks.create(namespace, name)
        self.networks.append((namespace, name))
        return net

    def serve(self, net: PodNetwork, port: int, reply: str) -> None:
        """Run the echo server in the pod's network on ``port``; return once it listens."""
        proc = subprocess.Popen(
            net.exec_argv([sys.executable, "-c", ECHO_SERVER, str(net.address), str(port), reply]),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self.processes.append(proc)
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"echo server exited: {proc.stderr.read().decode() if proc.stderr else ''}"
                )
            # Connecting from the host to the pod's address stays on the bridge.
            with socket.socket() as s:
                s.settimeout(1)
                if s.connect_ex((str(net.address), port)) == 0:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"echo server in {net.netns} does not listen on {net.address}:{port}"
                )
            time.sleep(0.05)

    def python_in(self, net: PodNetwork, code: str, *args: str) -> str:
        """Run a Python snippet inside a pod's network namespace; its stdout, stripped."""
        proc = subprocess.run(
            net.exec_argv([sys.executable, "-c", code, *args]),
            capture_output=True,
            text=True,
            timeout=60,
        )
        if proc.returncode != 0:
            raise AssertionError(f"python in {net.netns} ({args}) failed: {proc.stderr.strip()}")
        return proc.stdout.strip()

    def fetch_from(self, net: PodNetwork, url: str) -> str:
        """GET ``url`` from inside a pod's network namespace."""
        return self.python_in(net, FETCH, url)

    def mark_running(self, namespace: str, name: str, net: PodNetwork) -> dict:
        """Report the pod Running and Ready at its address, through the status subresource."""
        pod = self.cluster.api.get(f"/api/v1/namespaces/{namespace}/pods/{name}")
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        conditions = [
            {"type": t, "status": "True", "lastTransitionTime": now}
            for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
        ]
        containers = [
            {
                "name": c["name"],
                "image": c["image"],
                "imageID": "",
                "ready": True,
                "started": True,
                "restartCount": 0,
                "state": {"running": {"startedAt": now}},
            }
            for c in pod["spec"]["containers"]
        ]
        return self.cluster.api.strategic_patch(
            f"/api/v1/namespaces/{namespace}/pods/{name}/status",
            {
                "status": {
                    "phase": "Running",
                    "podIP": str(net.address),
                    "podIPs": [{"ip": str(net.address)}],
                    "hostIP": self.cluster.host_address,
                    "hostIPs": [{"ip": self.cluster.host_address}],
                    "startTime": now,
                    "conditions": conditions,
                    "containerStatuses": containers,
                }
            },
        )

    def close(self) -> None:
        for proc in self.processes:
            proc.terminate()
        for proc in self.processes:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stderr is not None:
                proc.stderr.close()
        for namespace, name in self.networks:
            self.cluster.pod_networks.delete(namespace, name)
