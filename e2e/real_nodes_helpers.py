"""Helpers of the e2e tests on the cluster's real nodes: why they cannot run here (a skip, or a
failure where they are required), a container's pid and cgroup on its node, and a watch of pods
that keeps every state it saw (a deleted pod's last status, its containers' exit codes, lasts
only milliseconds before the kubelet removes the object: polling misses it).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

import pytest

from conveyor.cluster.cluster import Cluster
from conveyor.cluster.image_build import default_image
from conveyor.cluster.kubelet_config import CRI_NAMESPACE
from conveyor.cluster.real_nodes import node_layouts
from conveyor.cluster.testing import KubeUnderTest

VERSION = importlib.metadata.version("conveyor")
IMAGE_PATH = default_image(VERSION)
"""The project's image as ``conveyor image build`` leaves it (never built by a test: 3.5 GB)."""
IMAGE = f"docker.io/library/conveyor:{VERSION}"
"""The name the nodes' containerd knows the project's image by."""
REQUIRED = os.environ.get("CONVEYOR_REAL_NODES_REQUIRED") == "1"
"""Set by scripts/test.sh, which builds what real nodes need: then a reason they cannot run is a
failure, since a skip would pass a run that tested nothing."""


def why_no_real_nodes() -> str | None:
    """None when real nodes with the project's image can start here, else why not (the node
    tools, the kubelet among them, are built by the cluster's start if missing: about 90 s
    with a warm Go cache)."""
    from conveyor.cluster.kubelet_node import missing_host_tools

    if not IMAGE_PATH.exists():
        return f"the project's image is not built ({IMAGE_PATH}): conveyor image build"
    if why := missing_host_tools():
        return why
    if (other := Cluster.attach()) is not None:
        return f"cluster {other.settings.name!r} runs on this machine (one cluster per machine)"
    return None


def cannot_run(why: str) -> NoReturn:
    """Skip, or fail where real nodes are required (``REQUIRED``)."""
    if REQUIRED:
        pytest.fail(
            f"real nodes are required (CONVEYOR_REAL_NODES_REQUIRED=1) but {why}", pytrace=False
        )
    pytest.skip(why)


def containerd_task_pid(cluster: Cluster, node: str, container_id: str) -> int:
    """The host pid of a container's init, from the real node's own containerd."""
    (layout,) = [lay for lay in node_layouts(cluster.settings) if lay.name == node]
    tasks = subprocess.run(
        ["ctr", "-a", str(layout.containerd_socket), "-n", CRI_NAMESPACE, "tasks", "ls"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    for line in tasks.splitlines()[1:]:  # TASK PID STATUS
        task, pid, _ = line.split()
        if task == container_id:
            return int(pid)
    raise AssertionError(f"no task {container_id} in {node}'s containerd:\n{tasks}")


def container_cgroup(cluster: Cluster, pod: dict[str, Any], controller: str) -> Path:
    """The directory of a real node's container's cgroup in one hierarchy (v1: the one holding
    ``controller``; v2: the unified one), read from its init's ``/proc/<pid>/cgroup``."""
    container_id = pod["status"]["containerStatuses"][0]["containerID"].partition("://")[2]
    pid = containerd_task_pid(cluster, pod["spec"]["nodeName"], container_id)
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return Path("/sys/fs/cgroup") / controllers / path.lstrip("/")
        if controllers == "":
            unified = Path("/sys/fs/cgroup/unified") / path.lstrip("/")
    return unified


class PodWatch:
    """``kubectl get pods --watch`` in one namespace, every event kept, until ``stop()``."""

    def __init__(self, kube: KubeUnderTest, namespace: str, selector: str) -> None:
        argv = [kube.kubectl_path, f"--kubeconfig={kube.kubeconfig}", "-n", namespace,
                "get", "pods", "-l", selector, "--watch", "--output-watch-events", "-o", "json"]  # fmt: skip
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        self.events: list[tuple[float, str, dict[str, Any]]] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        decoder = json.JSONDecoder()
        buffer = ""
        for line in self.proc.stdout:
            buffer += line
            while buffer.strip():
                try:
                    event, end = decoder.raw_decode(buffer.lstrip())
                except json.JSONDecodeError:
                    break  # an object not complete yet
                buffer = buffer.lstrip()[end:]
                with self._lock:
                    self.events.append((time.monotonic(), event["type"], event["object"]))

    def seen(self) -> list[tuple[float, str, dict[str, Any]]]:
        with self._lock:
            return list(self.events)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self._thread.join(timeout=10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def exit_codes(pod_events: list[dict[str, Any]]) -> dict[str, int]:
    """Container name -> the exit code of its last termination that the events show."""
    codes: dict[str, int] = {}
    for pod in pod_events:
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            if terminated := (status.get("state") or {}).get("terminated"):
                codes[status["name"]] = terminated["exitCode"]
    return codes
