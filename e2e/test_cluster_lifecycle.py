"""The cluster starts with its nodes Ready, stops without leftovers, and recovers from a crash.

These tests stop and start the session's cluster (the fixture's object is replaced where
a new one is made), so they cost two warm starts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from pod_helpers import create, pod, wait_phase
from real_nodes_helpers import containerd_task_pid

from conveyor.cluster import Cluster, ClusterAlreadyRunning, ClusterSettings
from conveyor.cluster.leftovers import find_leftovers, rulesets
from conveyor.cluster.nodes import GPU_RESOURCE
from conveyor.cluster.process import process_start_time
from conveyor.cluster.testing import KubeUnderTest, leftovers_of


def _ready(node: dict) -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions", [])
    )


def _assert_nodes(kube: KubeUnderTest, cluster: Cluster) -> None:
    nodes = json.loads(kube.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    by_name = {n["metadata"]["name"]: n for n in nodes}
    gpu, cpu = cluster.node_names()
    assert set(by_name) >= set(gpu + cpu)
    for name in gpu + cpu:
        assert _ready(by_name[name]), by_name[name]["status"].get("conditions")
    for name in gpu:
        node = by_name[name]
        labels = node["metadata"]["labels"]
        assert labels[f"{GPU_RESOURCE}.product"] == cluster.settings.gpu_product
        assert labels[f"{GPU_RESOURCE}.count"] == str(cluster.settings.gpus_per_node)
        assert labels[f"{GPU_RESOURCE}.memory"] == str(cluster.settings.gpu_memory_mib)
        assert node["status"]["allocatable"][GPU_RESOURCE] == str(cluster.settings.gpus_per_node)
        assert {"key": GPU_RESOURCE, "effect": "NoSchedule"} in node["spec"]["taints"]
    for name in cpu:
        assert not by_name[name]["spec"].get("taints")
        assert GPU_RESOURCE not in by_name[name]["status"]["allocatable"]
    # kubectl as a user runs it, with the version the pins state.
    table = kube.kubectl("get", "nodes").stdout
    assert all(name in table for name in gpu + cpu)
    version = json.loads(kube.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == version["clientVersion"]["gitVersion"]


def _assert_nothing_left(cluster: Cluster, baseline: dict[str, str]) -> None:
    left = find_leftovers(
        cluster.plan, cluster_name=cluster.settings.name, tools_dir=cluster.tools.directory
    )
    assert left == {k: [] for k in left}, left
    assert rulesets() == baseline
    assert not cluster.running()


def test_nodes_are_ready_with_gpu_labels_and_taints(
    kube: KubeUnderTest, own_cluster: Cluster
) -> None:
    _assert_nodes(kube, own_cluster)


def test_stop_leaves_nothing_and_start_again(kube: KubeUnderTest, owned_cluster: Cluster) -> None:
    pids = [p.record.pid for p in owned_cluster.processes.values()]
    assert pids and owned_cluster.running()
    owned_cluster.stop()
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}"), f"pid {pid} still exists"
    _assert_nothing_left(owned_cluster, kube.baseline_rulesets)
    owned_cluster.start()
    _assert_nodes(kube, owned_cluster)


def test_second_start_is_refused_while_a_cluster_runs(
    kube: KubeUnderTest, own_cluster: Cluster
) -> None:
    other = Cluster(ClusterSettings(name="e2e-second", tools_dir=own_cluster.tools.directory))
    with pytest.raises(ClusterAlreadyRunning):
        other.start()
    assert own_cluster.running()
    assert own_cluster.api.readyz()[0]


def test_start_cleans_up_after_a_crashed_cluster(
    kube: KubeUnderTest, owned_cluster: Cluster
) -> None:
    # A pod runs through the crash. In `default`: the fresh start below wipes etcd, so nothing
    # of it outlives the test.
    api = owned_cluster.api
    create(api, "default", pod("survivor", ["sleep", "600"]))
    running = wait_phase(api, "default", "survivor", "Running")
    container_id = running["status"]["containerStatuses"][0]["containerID"].partition("://")[2]
    container = containerd_task_pid(owned_cluster, running["spec"]["nodeName"], container_id)
    started = process_start_time(container)

    # A crash: every component's process group SIGKILLed at once. The pod's container (its own
    # process group, under containerd's shim), the bridge, the cgroups, the nodes' cgroup
    # trees and the state file are left behind.
    for proc in owned_cluster.processes.values():
        os.killpg(proc.record.pid, signal.SIGKILL)
    for proc in owned_cluster.processes.values():
        proc.stop(0)  # reaps the killed child; sends nothing more
    crashed = leftovers_of(owned_cluster)
    assert owned_cluster.settings.bridge in crashed.get("links", []), crashed
    assert crashed.get("cgroups") and crashed.get("real node cgroups"), crashed
    assert process_start_time(container) == started, "the pod's container died with the cluster"

    # A new owner (as after a reboot of the tooling) finds the leftovers and removes them.
    fresh = Cluster(owned_cluster.settings)
    kube.cluster = fresh
    fresh.start()
    assert process_start_time(container) != started, "the crashed run's container still runs"
    now = leftovers_of(fresh)
    for kind in ("processes", "real node processes"):
        assert not set(crashed.get(kind, [])) & set(now.get(kind, [])), (kind, crashed, now)
    _assert_nodes(kube, fresh)


def _conveyor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "conveyor", "cluster", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_status_says_where_the_cluster_is_and_up_refuses_a_second(own_cluster: Cluster) -> None:
    name = own_cluster.settings.name
    status = _conveyor("status", "--name", name)
    assert status.returncode == 0, status.stderr
    assert f"export KUBECONFIG={own_cluster.kubeconfig_path}" in status.stdout
    assert "gpu-node-0" in status.stdout
    info = json.loads(_conveyor("status", "--name", name, "--json", "--figures").stdout)
    assert info["running"] and info["server"] == own_cluster.server
    assert set(info["figures"]["memory_rss_mib"]) == set(own_cluster.processes)
    tools = own_cluster.tools.directory
    refused = _conveyor("up", "--name", "e2e-cli", "--tools-dir", str(tools))
    assert refused.returncode == 1
    assert "one cluster runs per machine" in refused.stderr
    assert own_cluster.running()
