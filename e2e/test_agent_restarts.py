"""Restarts, back-off, liveness, and the CPU and memory limits of pods the node agent (or on
real nodes the kubelet) runs."""

from __future__ import annotations

import time

from agent_helpers import container_status, create, get_pod, pod, wait_phase, wait_pod
from real_nodes_helpers import container_cgroup, runs_on_real_nodes

from conveyor.cluster import Cluster
from conveyor.cluster.podcgroups import ContainerCgroup
from conveyor.cluster.testing import KubeUnderTest


def test_exiting_container_restarts_then_backs_off(
    kube: KubeUnderTest, node_agent: Cluster, namespace: str
) -> None:
    api = kube.api
    create(api, namespace, pod("crasher", ["sh", "-c", "echo started; exit 3"]))
    messages: list[str] = []

    def restarted_twice(p: dict) -> bool:
        waiting = (container_status(p).get("state") or {}).get("waiting") or {}
        if waiting.get("reason") == "CrashLoopBackOff" and waiting["message"] not in messages:
            messages.append(waiting["message"])
        return container_status(p).get("restartCount", 0) >= 2

    p = wait_pod(api, namespace, "crasher", "restartCount >= 2", restarted_twice)
    last = container_status(p)["lastState"]["terminated"]
    assert last["exitCode"] == 3 and last["reason"] == "Error"
    assert p["status"]["phase"] == "Running"
    # The first restart is immediate; then the back-off doubles, as a kubelet's does.
    wait_pod(
        api,
        namespace,
        "crasher",
        "a 20 s back-off",
        lambda p: restarted_twice(p) and any("back-off 20s" in m for m in messages),
    )
    assert any("back-off 10s" in m for m in messages), messages


def test_failing_liveness_probe_restarts_the_container(
    kube: KubeUnderTest, node_agent: Cluster, namespace: str
) -> None:
    api = kube.api
    create(
        api,
        namespace,
        pod(
            "unlively",
            ["sleep", "1000"],
            # Nothing listens on this port: the probe fails, the container is restarted.
            livenessProbe={"tcpSocket": {"port": 9}, "periodSeconds": 1, "failureThreshold": 2},
            pod_spec={"terminationGracePeriodSeconds": 2},
        ),
    )
    p = wait_pod(
        api,
        namespace,
        "unlively",
        "restarted",
        lambda p: container_status(p).get("restartCount", 0) >= 1,
    )
    last = container_status(p)["lastState"]["terminated"]
    if runs_on_real_nodes(node_agent):
        # sleep is the container's PID 1, which the kernel spares the signals it does not
        # handle: SIGTERM is ignored, and the kubelet SIGKILLs it after the grace period.
        assert last["exitCode"] == 128 + 9
    else:
        assert last["exitCode"] == 128 + 15  # SIGTERM, which sleep does not catch
    assert last["reason"] == "Error"


def test_container_over_its_memory_limit_is_oom_killed(
    kube: KubeUnderTest, node_agent: Cluster, namespace: str
) -> None:
    api = kube.api
    create(
        api,
        namespace,
        pod(
            "hog",
            ["python", "-c", "blocks = [bytearray(2**20) for _ in range(400)]; print('survived')"],
            resources={"limits": {"memory": "64Mi", "cpu": "100m"}},
            pod_spec={"restartPolicy": "Never"},
        ),
    )
    p = wait_phase(api, namespace, "hog", "Failed", "Succeeded")
    assert p["status"]["phase"] == "Failed"
    terminated = container_status(p)["state"]["terminated"]
    assert terminated["reason"] == "OOMKilled"
    assert terminated["exitCode"] == 137


def test_cpu_limited_busy_loop_gets_no_more_than_its_share(
    kube: KubeUnderTest, node_agent: Cluster, namespace: str
) -> None:
    api = kube.api
    limit = 0.2
    create(
        api,
        namespace,
        pod(
            "spinner",
            [
                "python",
                "-c",
                "import os; print(open('/sys/fs/cgroup/cpu/cpu.cfs_quota_us').read(), flush=True)\nwhile True: pass",
            ],
            resources={"limits": {"cpu": "200m", "memory": "64Mi"}},
        ),
    )
    p = wait_pod(
        api,
        namespace,
        "spinner",
        "running",
        lambda p: "running" in (container_status(p).get("state") or {}),
    )
    if runs_on_real_nodes(node_agent):  # the kubelet's cgroups (v1 here)
        cpu_dir = container_cgroup(node_agent, p, "cpu")
        cpuacct = container_cgroup(node_agent, p, "cpuacct") / "cpuacct.usage"

        def cpu_usage_s() -> float:
            return int(cpuacct.read_text()) / 1e9
    else:
        cgroup = ContainerCgroup(node_agent.settings.name, p["metadata"]["uid"], "main")
        cpu_dir = cgroup.dirs["cpu"]

        def cpu_usage_s() -> float:
            used = cgroup.cpu_usage_s()
            assert used is not None
            return used

    assert (cpu_dir / "cpu.cfs_quota_us").read_text().strip() == str(int(limit * 100_000))
    usage_0, wall_0 = cpu_usage_s(), time.monotonic()
    # Let it burn a second of CPU time (5 s of wall time at its limit), as the cgroup counts it.
    kube.api.wait_for(
        "1 s of CPU used",
        lambda: cpu_usage_s() - usage_0 >= 1.0,
        timeout_s=120,
        interval_s=0.1,
    )
    used, wall = cpu_usage_s() - usage_0, time.monotonic() - wall_0
    throttled = dict(line.split() for line in (cpu_dir / "cpu.stat").read_text().splitlines())
    assert int(throttled["nr_throttled"]) > 0
    # Generous: the share is 0.2 of a core; an unthrottled loop would use a whole one.
    assert used / wall < limit * 2, f"{used:.2f} s CPU in {wall:.2f} s"
    logs = kube.kubectl("logs", "-n", namespace, "spinner").stdout
    assert logs.split()[0] == str(int(limit * 100_000)), "the process sees its own cgroup's quota"
    assert get_pod(api, namespace, "spinner")["status"]["phase"] == "Running"
