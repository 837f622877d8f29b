"""`conveyor up`'s refusals and its Ctrl-C path, without a cluster (the walk-through runs the
real `conveyor up` and `conveyor down` end to end)."""

from __future__ import annotations

from collections import namedtuple
from pathlib import Path

import pytest

from conveyor.cluster import stack
from conveyor.cluster.stack import StackSettings, main_up, preflight

Usage = namedtuple("Usage", "total used free")


def test_not_root_is_refused_with_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stack.os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit, match=r"needs root.*sudo.*--kubeconfig"):
        preflight(StackSettings())


def test_an_existing_cluster_needs_no_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(stack.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(stack, "tools_directory", lambda: tmp_path)
    monkeypatch.setattr(stack.Tools, "missing", lambda self: [])
    preflight(StackSettings(kubeconfig=tmp_path / "kubeconfig"))


def test_too_little_disk_for_the_first_build_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(stack.os, "geteuid", lambda: 0)
    monkeypatch.setattr(stack, "missing_host_tools", lambda: None)
    monkeypatch.setattr(stack, "tools_directory", lambda: tmp_path)
    monkeypatch.setattr(stack.Tools, "missing", lambda self: ["kube-apiserver"])
    monkeypatch.setenv("GOMODCACHE", str(tmp_path / "gomod"))
    monkeypatch.setattr(stack.shutil, "disk_usage", lambda _: Usage(10 << 30, 9 << 30, 1 << 30))
    with pytest.raises(SystemExit, match=r"about 6 GB of Go caches; 1\.0 GB is free"):
        preflight(StackSettings())


def test_a_machine_where_the_nodes_cannot_run_is_refused_with_what_to_do(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(stack.os, "geteuid", lambda: 0)
    monkeypatch.setattr(stack, "missing_host_tools", lambda: "runc not installed: run X")
    with pytest.raises(SystemExit, match=r"nodes cannot run here: runc not installed: run X"):
        preflight(StackSettings())
    # An existing cluster's nodes are its own: nothing of this machine is asked for.
    monkeypatch.setattr(stack, "tools_directory", lambda: tmp_path)
    monkeypatch.setattr(stack.Tools, "missing", lambda self: [])
    preflight(StackSettings(kubeconfig=tmp_path / "kubeconfig"))


def test_ctrl_c_during_up_undoes_what_that_run_started(monkeypatch: pytest.MonkeyPatch) -> None:
    undone: list[stack.Stack] = []
    monkeypatch.setattr(stack, "preflight", lambda settings: None)

    def interrupted(self: stack.Stack) -> dict:
        raise KeyboardInterrupt

    monkeypatch.setattr(stack.Stack, "up", interrupted)
    monkeypatch.setattr(stack.Stack, "abort", lambda self: undone.append(self))
    assert main_up([]) == 130
    assert len(undone) == 1


def test_abort_leaves_a_cluster_it_did_not_start() -> None:
    class Running:
        stopped = False

        def stop(self) -> None:
            self.stopped = True

    s = stack.Stack(StackSettings())
    s.cluster = Running()  # type: ignore[assignment]  # attached, not started by this run
    s.abort()
    assert not s.cluster.stopped  # type: ignore[attr-defined]


def test_the_example_is_the_named_llmservice_on_the_real_model() -> None:
    import yaml

    example = yaml.safe_load(stack.EXAMPLE.read_text())
    assert example["metadata"]["name"] == stack.EXAMPLE_NAME
    assert example["spec"]["model"] == {"builtin": stack.StackSettings().model}
    assert stack.StackSettings().model == "smollm2-135m-instruct"


def test_up_model_choice_replaces_the_examples_builtin(monkeypatch: pytest.MonkeyPatch) -> None:
    import yaml

    applied: list[str] = []
    s = stack.Stack(stack.StackSettings(model="conveyor-tiny"))
    monkeypatch.setattr(s, "kubectl", lambda *args, input_=None, **kw: applied.append(input_))
    s.apply_example()
    assert yaml.safe_load(applied[0])["spec"]["model"] == {"builtin": "conveyor-tiny"}
