"""The node agent re-asserts a pod's status when another writer changed it, as a kubelet does.

After a control-plane freeze the node lifecycle controller had marked every pod of the
(stale-lease) nodes not Ready; nothing set them Ready again, so Services had no ready
endpoint and the LLMService stayed Pending with its pods running fine.
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from conveyor.cluster.pod_worker import PodWorker


def running_worker(tmp_path: Path) -> PodWorker:
    ctx: Any = SimpleNamespace(pods_dir=lambda: tmp_path, cluster_name="test", host_ip="10.0.0.1")
    pod = {
        "metadata": {"uid": "u-1", "namespace": "ns", "name": "p"},
        "spec": {"containers": [{"name": "c", "image": "conveyor"}]},
        "status": {},
    }
    worker = PodWorker(ctx, pod)
    worker.pod_ip = "10.1.0.5"
    runner = worker.runners[0]
    runner.state = {"running": {"startedAt": "2026-01-01T00:00:00Z"}}
    runner.ever_ran = runner.ready = runner.started = True
    worker._sent = worker.build_status()  # what the agent last sent, and the API holds
    worker._dirty.clear()
    return worker


def pod_with_status(worker: PodWorker, status: dict[str, Any]) -> dict[str, Any]:
    return {**copy.deepcopy(worker.pod), "status": status}


def ready(status: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == "Ready")


def test_the_agent_s_own_status_coming_back_changes_nothing(tmp_path: Path) -> None:
    worker = running_worker(tmp_path)
    assert worker._sent is not None
    worker.update(pod_with_status(worker, copy.deepcopy(worker._sent)))
    assert not worker._dirty.is_set()


def test_a_pod_marked_not_ready_by_another_writer_is_made_ready_again(tmp_path: Path) -> None:
    worker = running_worker(tmp_path)
    assert worker._sent is not None
    api_status = copy.deepcopy(worker._sent)
    # What the node lifecycle controller writes when the node's lease went stale.
    ready(api_status).update(status="False", lastTransitionTime="2030-01-01T00:00:00Z")
    worker.update(pod_with_status(worker, api_status))

    assert worker._dirty.is_set()
    resent = worker.build_status()
    assert ready(resent)["status"] == "True"
    # A transition back to True, stamped now, not the other writer's time.
    assert ready(resent)["lastTransitionTime"] != "2030-01-01T00:00:00Z"


def test_another_writer_s_own_condition_is_left_alone(tmp_path: Path) -> None:
    worker = running_worker(tmp_path)
    assert worker._sent is not None
    api_status = copy.deepcopy(worker._sent)
    api_status["conditions"].append({"type": "DisruptionTarget", "status": "True"})
    worker.update(pod_with_status(worker, api_status))
    assert not worker._dirty.is_set()


def test_an_adopted_running_container_is_reported_ready_from_the_first_report(
    tmp_path: Path,
) -> None:
    """A restarted agent finds a container's run alive: the pod's first status report keeps it
    running and Ready, as the API showed it (not ContainerCreating and not Ready until the first
    probe, which made every pod flap at each restart of the agent)."""
    import json
    import os

    from conveyor.cluster.process import process_start_time

    run_dir = tmp_path / "u-1" / "containers" / "c"
    (run_dir / "0").mkdir(parents=True)
    (run_dir / "state.json").write_text(
        json.dumps({"restart_count": 0, "backoff_s": 0.0, "last_state": {}, "attempt": 0})
    )
    # The run's shim: this very process stands in for it (alive, with its start time).
    pid = os.getpid()
    (run_dir / "0" / "shim.json").write_text(
        json.dumps({"pid": pid, "start_time": process_start_time(pid), "started_at": 1.0e9})
    )
    ctx: Any = SimpleNamespace(pods_dir=lambda: tmp_path, cluster_name="test", host_ip="10.0.0.1")
    reported = {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True"}],
        "containerStatuses": [
            {"name": "c", "containerID": "conveyor://u-1-c-0", "ready": True, "started": True}
        ],
    }
    pod = {
        "metadata": {"uid": "u-1", "namespace": "ns", "name": "p"},
        "spec": {"containers": [{"name": "c", "image": "conveyor"}]},
        "status": reported,
    }
    worker = PodWorker(ctx, pod)
    first = worker.build_status()
    assert ready(first)["status"] == "True"
    (container,) = first["containerStatuses"]
    assert container["ready"] and container["started"]
    assert "running" in container["state"]
