"""The cluster's components by name: each start written down, a wait that fails with the log."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.cluster.cgroups import ClusterCgroup
from conveyor.cluster.components import Components
from conveyor.cluster.process import ProcessRecord


def components(tmp_path: Path, records: list[ProcessRecord]) -> Components:
    # A cgroup root with no hierarchy in it: the processes join no cgroup.
    cgroup = ClusterCgroup("components-test", root=tmp_path / "no-cgroups")
    return Components(tmp_path / "logs", cgroup, timeout_s=30, on_start=records.append)


def test_each_start_is_written_down_in_order(tmp_path: Path) -> None:
    records: list[ProcessRecord] = []
    parts = components(tmp_path, records)
    try:
        first = parts.start("first", ["sleep", "300"])
        second = parts.start("second", ["sleep", "301"])
        assert list(parts.processes) == ["first", "second"]
        assert records == [first.record, second.record]
        again = parts.restart("first")
        assert first.record is not None and not first.record.alive()
        assert records[-1] == again.record and list(parts.processes) == ["first", "second"]
        assert again.argv == ["sleep", "300"]
        assert parts.log_path("first").read_text().count("starting first") == 2
    finally:
        for proc in parts.processes.values():
            proc.stop(grace_s=1)


def test_a_wait_ends_when_the_component_exits_with_its_log(tmp_path: Path) -> None:
    parts = components(tmp_path, [])
    proc = parts.start("broken", ["/bin/sh", "-c", "echo bad flag --foo; exec sleep 300"])
    try:
        parts.wait("broken", "its log line", lambda: "bad flag" in proc.tail())
        proc.kill()  # a crash
        with pytest.raises(RuntimeError, match=r"broken exited .* before /healthz") as err:
            parts.wait("broken", "/healthz", lambda: False)
        assert "bad flag --foo" in str(err.value)
    finally:
        proc.stop(grace_s=1)
