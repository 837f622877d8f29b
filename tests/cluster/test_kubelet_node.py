"""One real node (node runtime ``kubelet``) against the cluster's own control plane.

A GPU node (kubelet, containerd, runc, the fake GPU device plugin) runs a busybox pod from an
image built here: it becomes Ready, gets its fake GPUs, reaches the apiserver through the
``kubernetes`` Service; a pod over its memory limit is OOMKilled by the kernel and reported so
by the kubelet; ``stop`` leaves nothing. Prints node start -> Ready and pod create -> Ready.

Runs where the node tools are built (``cluster/build-tools.sh --set node``; no test builds
them) and containerd, runc and busybox-static are installed, as root, with no other cluster
running on the machine.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from conveyor.cluster.cluster import Cluster
from conveyor.cluster.kubelet_node import missing_host_tools, node_tools_built
from conveyor.cluster.leftovers import rulesets
from conveyor.cluster.node_images import static_image
from conveyor.cluster.real_nodes import image_cache
from conveyor.cluster.settings import ClusterSettings
from conveyor.cluster.testing import leftovers_of

BUSYBOX = Path("/bin/busybox")
IMAGE = "docker.io/library/busybox:conveyor-test"
NAME = "realnode-test"


def _why_not() -> str | None:
    if (missing := missing_host_tools()) is not None:
        return missing
    if not BUSYBOX.exists():
        return "busybox-static is not installed (apt-get install busybox-static)"
    if node_tools_built() is None:
        return "the node tools are not built: cluster/build-tools.sh --set node (about 90 s warm)"
    if (other := Cluster.attach()) is not None:
        return f"cluster {other.settings.name!r} runs on this machine (one cluster per machine)"
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")


def _pod(name: str, command: str, *, memory: str, gpus: int = 0, **spec: object) -> dict:
    limits: dict[str, object] = {"memory": memory}
    if gpus:
        limits["nvidia.com/gpu"] = gpus
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
            "containers": [
                {
                    "name": "c",
                    "image": IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["/bin/busybox", "sh", "-c", command],
                    "resources": {"limits": limits},
                }
            ],
            **spec,
        },
    }


def _ready(pod: dict) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def test_a_real_node_runs_pods_from_an_image_and_leaves_nothing() -> None:
    archive = static_image(
        {"/bin/busybox": BUSYBOX}, entrypoint=["/bin/busybox"], ref=IMAGE, cache=image_cache()
    )
    settings = ClusterSettings(name=NAME, gpu_nodes=1, cpu_nodes=0, node_images=(str(archive),))
    baseline = rulesets()
    cluster = Cluster(settings)
    try:
        cluster.start()
        node_ready_s = cluster.timings["gpu-node-0_start_to_ready_s"]
        print(f"\nreal node start -> Ready: {node_ready_s:.2f} s "
              f"(cluster up {cluster.timings['start_total_s']:.1f} s)")  # fmt: skip
        api = cluster.api
        pods = "/api/v1/namespaces/default/pods"
        service_ip = str(cluster.plan.kubernetes_service_ip)
        works = _pod(
            "works",
            'echo "gpus=$NVIDIA_VISIBLE_DEVICES"; '
            f"/bin/busybox nc -w 3 {service_ip} 443 </dev/null && echo reached-apiserver; "
            "exec /bin/busybox sleep 3600",
            memory="64Mi",
            gpus=2,
        )
        works["spec"]["containers"][0]["readinessProbe"] = {
            "exec": {"command": ["/bin/busybox", "true"]},
            "periodSeconds": 1,
        }
        t0 = time.monotonic()
        api.create(pods, works)
        pod = api.wait_for("the pod Ready", lambda: _ready(p := api.get(f"{pods}/works")) and p,
                           timeout_s=60, interval_s=0.05)  # fmt: skip
        print(f"pod create -> Ready: {time.monotonic() - t0:.2f} s")
        assert pod["spec"]["nodeName"] == "gpu-node-0"
        assert pod["status"]["podIP"].startswith("198.18.15.")  # the node's slice
        log = api.wait_for(
            "the pod's log",
            lambda: (
                "reached-apiserver" in (t := api.request("GET", f"{pods}/works/log", raw=True))
                and t
            ),
            timeout_s=30,
        )
        assert "gpus=fake-gpu-" in log and log.count("fake-gpu-") == 2

        hog = (
            "x=$(/bin/busybox head -c 200000000 /dev/zero | /bin/busybox tr '\\0' a); echo survived"
        )
        api.create(pods, _pod("hog", hog, memory="32Mi", restartPolicy="Never"))

        def terminated() -> dict | None:
            statuses = api.get(f"{pods}/hog").get("status", {}).get("containerStatuses", [])
            return statuses and statuses[0]["state"].get("terminated")

        state = api.wait_for("the memory hog to end", terminated, timeout_s=60)
        assert (state["reason"], state["exitCode"]) == ("OOMKilled", 137)
    except BaseException:
        print(cluster.log_tails(20))
        raise
    finally:
        t_down = time.monotonic()
        cluster.stop()
        print(f"cluster down: {time.monotonic() - t_down:.1f} s")
    assert leftovers_of(cluster) == {}
    # The kubelet's iptables chains (KUBE-FIREWALL, KUBE-KUBELET-CANARY, ...) if it made any;
    # the rest of the rules may change under other work on a shared machine.
    assert _kube_rules(rulesets()) == _kube_rules(baseline)


def _kube_rules(rules: dict[str, str]) -> dict[str, list[str]]:
    """The iptables lines that name a Kubernetes chain (the nftables tables are leftovers' own)."""
    return {
        tool: sorted(line for line in text.splitlines() if "KUBE" in line)
        for tool, text in rules.items()
        if tool != "nft"
    }
