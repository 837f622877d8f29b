"""The project's image on real nodes (node runtime ``kubelet``), every node cloned from one seed.

Two CPU nodes get the images ``conveyor up`` gives its nodes (the project's, ``conveyor image
build``'s OCI layout, among them) through the seed containerd root (``node_seed``): a pod
running ``conveyor serve --model conveyor-tiny`` from the image (not the checkout) becomes Ready
by the runtime's own ``/ready`` and answers ``/v1/completions`` from the host at its pod IP; a
file of the image changed in a container on one node is unchanged in a container on the other
node and in the seed (the nodes' roots share the seed's files by hardlinks). Prints the seed's
import (cold, when it was made), each node's clone and start -> Ready, and the runtime pod's
create -> Ready.

Runs where the node tools are built (``cluster/build-tools.sh --set node``), containerd and runc
are installed and the project's image is there (``conveyor image build``; no test
builds it, it is 3.5 GB), as root, with no other cluster running on the machine.
"""

from __future__ import annotations

import importlib.metadata
import json
import time
import urllib.request

import pytest

from conveyor.cluster.cluster import Cluster
from conveyor.cluster.image_build import default_image
from conveyor.cluster.kubelet_node import missing_host_tools, node_tools_built
from conveyor.cluster.real_nodes import default_node_images, node_layouts, node_seed
from conveyor.cluster.settings import ClusterSettings
from conveyor.cluster.testing import leftovers_of

VERSION = importlib.metadata.version("conveyor")
IMAGE_PATH = default_image(VERSION)
IMAGE = f"docker.io/library/conveyor:{VERSION}"
NAME = "realnode-image"
MARK = "changed-on-cpu-node-0"


def _why_not() -> str | None:
    if (missing := missing_host_tools()) is not None:
        return missing
    if node_tools_built() is None:
        return "the node tools are not built: cluster/build-tools.sh --set node (about 90 s warm)"
    if not IMAGE_PATH.exists():
        return f"the project's image is not built ({IMAGE_PATH}): conveyor image build"
    if (other := Cluster.attach()) is not None:
        return f"cluster {other.settings.name!r} runs on this machine (one cluster per machine)"
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")


def _pod(name: str, node: str, command: list[str], **container: object) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "c",
                    "image": IMAGE,
                    "imagePullPolicy": "Never",
                    "command": command,
                    **container,
                }
            ],
        },
    }


def _ready(pod: dict) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def test_the_project_image_serves_on_real_nodes_cloned_from_one_seed() -> None:
    # The images `conveyor up` gives its nodes, not the project's alone: the same seed, so this
    # test neither imports gigabytes again nor evicts the seed the end-to-end phase uses.
    images = default_node_images()
    settings = ClusterSettings(
        name=NAME, gpu_nodes=0, cpu_nodes=2, node_images=tuple(str(p) for p in images)
    )
    cluster = Cluster(settings)
    try:
        cluster.start()
        seed = node_seed(images)  # cached by now
        t = cluster.timings
        print(f"\nseed import (cold, when it was made): {seed.import_s:.1f} s"
              f"{'' if t['seed_import_s'] else ' (cached for this run)'}")  # fmt: skip
        for layout in node_layouts(settings):
            n = layout.name
            print(f"{n}: clone {t[f'{n}_clone_s']:.2f} s, containerd up at "
                  f"{t[f'{n}_containerd_s']:.2f} s, start -> Ready {t[f'{n}_start_to_ready_s']:.2f} s")  # fmt: skip
        api = cluster.api
        pods = "/api/v1/namespaces/default/pods"

        serve = _pod(
            "serve",
            "cpu-node-0",
            ["conveyor", "serve", "--model", "conveyor-tiny", "--port", "8000"],
            readinessProbe={
                "httpGet": {"path": "/ready", "port": 8000},
                "periodSeconds": 1,
                "failureThreshold": 600,
            },
        )
        t0 = time.monotonic()
        api.create(pods, serve)
        pod = api.wait_for("the runtime pod Ready", lambda: _ready(p := api.get(f"{pods}/serve")) and p,
                           timeout_s=300, interval_s=0.1)  # fmt: skip
        print(f"runtime pod create -> Ready: {time.monotonic() - t0:.2f} s")
        body = json.dumps({"model": "conveyor-tiny", "prompt": "hello", "max_tokens": 4}).encode()
        request = urllib.request.Request(
            f"http://{pod['status']['podIP']}:8000/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            completion = json.load(response)
        assert completion["choices"][0]["text"] is not None
        assert completion["usage"]["completion_tokens"] > 0

        # A file of the image changed on one node: the other node and the seed keep it.
        root = {"securityContext": {"runAsUser": 0}}
        writer = _pod(
            "writer",
            "cpu-node-0",
            ["/bin/sh", "-c", f"echo {MARK} >> /etc/os-release && exec sleep 3600"],
            readinessProbe={"exec": {"command": ["grep", "-q", MARK, "/etc/os-release"]},
                            "periodSeconds": 1},
            **root,
        )  # fmt: skip
        api.create(pods, writer)
        api.wait_for("the writer Ready", lambda: _ready(api.get(f"{pods}/writer")), timeout_s=60)
        reader = _pod(
            "reader",
            "cpu-node-1",
            ["/bin/sh", "-c", f"grep -c {MARK} /etc/os-release; echo read; exec sleep 3600"],
            **root,
        )
        api.create(pods, reader)
        log = api.wait_for(
            "the reader's log",
            lambda: "read" in (t := api.request("GET", f"{pods}/reader/log", raw=True)) and t,
            timeout_s=60,
        )
        assert log.split() == ["0", "read"], log
        in_seed = list(
            seed.root.glob("io.containerd.snapshotter.v1.overlayfs/snapshots/*/fs/etc/os-release")
        )
        assert in_seed and not any(MARK in p.read_text() for p in in_seed)
    except BaseException:
        print(cluster.log_tails(20))
        raise
    finally:
        t_down = time.monotonic()
        cluster.stop()
        print(f"cluster down: {time.monotonic() - t_down:.1f} s")
    assert leftovers_of(cluster) == {}
    assert not any(layout.root.exists() for layout in node_layouts(settings))
