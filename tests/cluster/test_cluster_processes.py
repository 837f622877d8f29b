"""The cluster's process owner, its state file and the build script's cache key (no cluster started)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.cluster.cluster import rotate_logs
from conveyor.cluster.process import (
    ManagedProcess,
    ProcessRecord,
    group_members,
    process_start_time,
)
from conveyor.cluster.state import ClusterState
from conveyor.cluster.teardown import ClusterAlreadyRunning, clean_leftovers
from conveyor.cluster.tools import BUILD_SCRIPT, GO_MODULES, build_times, pinned_version


def test_managed_process_logs_and_stops_its_whole_group(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "sleeper.log"
    # The shell starts a child of its own: stopping must end both.
    proc = ManagedProcess("sleeper", ["/bin/sh", "-c", "echo started; sleep 300 & wait"], log)
    record = proc.start()
    assert record.alive()
    proc.stop(grace_s=5)
    assert not record.alive()
    assert not proc.alive()
    text = log.read_text()
    assert "==== " in text and "starting sleeper" in text
    assert group_members(record.pid) == [], "a process of the group survived"


def test_process_that_ignores_sigterm_is_killed(tmp_path: Path) -> None:
    proc = ManagedProcess(
        "stubborn",
        [
            sys.executable,
            "-c",
            "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(300)",
        ],
        tmp_path / "stubborn.log",
    )
    record = proc.start()
    proc.stop(grace_s=0.5)
    assert not record.alive()


def test_a_recycled_pid_is_not_mistaken_for_the_process() -> None:
    me = ProcessRecord("me", os.getpid(), process_start_time(os.getpid()))
    assert me.alive()
    assert not ProcessRecord("me", os.getpid(), me.start_time + 1).alive()
    assert not ProcessRecord("gone", 2**22 + 12345, 1).alive()


def test_state_round_trip_and_refusal_beside_a_running_cluster(tmp_path: Path) -> None:
    me = ProcessRecord("etcd", os.getpid(), process_start_time(os.getpid()))
    state = ClusterState(
        "other", "cvtest0", "198.18.0.0/20", "198.19.0.0/20", "198.18.0.0/15", processes=[me]
    )
    assert ClusterState.from_json(state.to_json()) == state
    work = tmp_path / "other"
    work.mkdir()
    (work / "state.json").write_text(__import__("json").dumps(state.to_json()))
    with pytest.raises(ClusterAlreadyRunning, match="conveyor cluster down --name other"):
        clean_leftovers(tmp_path)
    assert (work / "state.json").exists(), "a running cluster's state is never cleaned up"


def test_versions_are_stated_once_in_the_go_modules() -> None:
    assert pinned_version("k8s.io/kubernetes") == "v1.35.4"
    assert pinned_version("go.etcd.io/etcd/server/v3", "etcd") == "v3.6.16"
    assert pinned_version("helm.sh/helm/v3", "helm") == "v3.21.4"
    assert pinned_version("github.com/prometheus/prometheus", "prometheus") == "v0.316.0"
    staging = (GO_MODULES / "kubernetes" / "go.mod").read_text()
    assert "k8s.io/client-go => k8s.io/client-go v0.35.4" in staging
    for folder in ("kubernetes", "etcd", "coredns", "helm", "prometheus", "node"):
        assert (GO_MODULES / folder / "go.sum").stat().st_size > 0


@pytest.mark.skipif(shutil.which("go") is None, reason="the Go toolchain is not installed")
def test_build_cache_is_keyed_by_the_pins(tmp_path: Path) -> None:
    copy = tmp_path / "cluster"
    copy.mkdir()
    shutil.copy(BUILD_SCRIPT, copy / BUILD_SCRIPT.name)
    shutil.copytree(GO_MODULES, copy / "go")
    env = {**os.environ, "CONVEYOR_TOOLS_CACHE": str(tmp_path / "cache")}
    script = str(copy / BUILD_SCRIPT.name)

    def print_dir() -> str:
        return subprocess.run(
            [script, "--print-dir"], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()

    first = print_dir()
    assert first.startswith(str(tmp_path / "cache"))
    assert print_dir() == first
    assert subprocess.run([script, "--check"], env=env).returncode == 1
    helm_mod = copy / "go" / "helm" / "go.mod"
    helm_mod.write_text(helm_mod.read_text().replace("v3.21.4", "v3.21.5"))
    assert print_dir() != first


def test_build_times_are_read_from_the_build_record(tmp_path: Path) -> None:
    (tmp_path / "build-times.tsv").write_text("etcd\t57\nkubectl\t40\ntotal\t97\nkubectl\t3\n")
    assert build_times(tmp_path) == {"etcd": 57, "kubectl": 43}
    assert build_times(tmp_path / "missing") == {}


def test_cli_status_of_a_cluster_that_never_ran(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from conveyor.cluster.cli import main

    assert main(["status", "--name", "nothing-here", "--state-root", str(tmp_path)]) == 1
    assert "is not running" in capsys.readouterr().out


def test_restart_kills_a_component_and_starts_the_same_command_line(tmp_path: Path) -> None:
    """What the fault tests do to etcd or a kubelet, on a cluster attached from another
    process: the component is known by its record alone, so its command line is read back."""
    from conveyor.cluster import Cluster, ClusterSettings
    from conveyor.cluster.api import wait_for
    from conveyor.cluster.state import read_state, write_state

    cluster = Cluster(ClusterSettings(name="restart-test", state_root=tmp_path))
    cluster.work_dir.mkdir(parents=True)
    first = ManagedProcess("component", ["sleep", "300"], cluster.logs_dir / "component.log")
    record = first.start()
    try:
        cluster.state = ClusterState("restart-test", "br", "p", "s", "g", processes=[record])
        write_state(cluster.work_dir, cluster.state)
        cluster.processes["component"] = ManagedProcess.adopt(record, first.log_path)
        cmdline = Path(f"/proc/{record.pid}/cmdline")
        wait_for("sleep's exec", lambda: cmdline.read_bytes(), timeout_s=10, interval_s=0.01)
        second = cluster.restart("component")
        first._reap()
        assert not record.alive()
        assert second.record is not None and second.record.pid != record.pid
        again = Path(f"/proc/{second.record.pid}/cmdline")
        wait_for("sleep's exec again", lambda: again.read_bytes(), timeout_s=10, interval_s=0.01)
        assert again.read_bytes() == b"sleep\x00300\x00"
        saved = read_state(cluster.work_dir)
        assert saved is not None and saved.processes == [second.record]
    finally:
        for proc in (first, cluster.processes["component"]):
            proc.stop(grace_s=1)


def test_a_new_cluster_moves_the_last_ones_logs_aside(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    rotate_logs(logs)  # the first cluster: nothing to move
    assert logs.is_dir() and not (tmp_path / "logs.previous").exists()
    (logs / "kubelet-gpu-node-0.log").write_text("real nodes\n")
    rotate_logs(logs)
    assert list(logs.iterdir()) == []
    assert (tmp_path / "logs.previous" / "kubelet-gpu-node-0.log").read_text() == "real nodes\n"
    (logs / "etcd.log").write_text("etcd\n")
    rotate_logs(logs)  # only the last run's are kept
    assert sorted(p.name for p in (tmp_path / "logs.previous").iterdir()) == ["etcd.log"]
