"""The stack's Prometheus record: a pid that is not Prometheus's is never reused or signalled."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conveyor.cluster.stack_prometheus import running_prometheus, stop_prometheus


def test_a_recycled_pid_is_not_the_stacks_prometheus(tmp_path: Path) -> None:
    state_file = tmp_path / "stack.json"
    # A process of another program holds the recorded pid: it waits for its stdin to close.
    other = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        state = {"prometheus_pid": other.pid, "prometheus": "http://127.0.0.1:9090"}
        state_file.write_text(json.dumps(state))
        assert running_prometheus(state_file) is None
        stop_prometheus(state_file)
        assert other.poll() is None, "stop_prometheus signalled a process that is not Prometheus"
        assert not state_file.exists()
    finally:
        assert other.stdin is not None
        other.stdin.close()
        other.wait(timeout=30)


def test_no_state_file_means_no_prometheus(tmp_path: Path) -> None:
    state_file = tmp_path / "stack.json"
    assert running_prometheus(state_file) is None
    stop_prometheus(state_file)
    assert not state_file.exists()
