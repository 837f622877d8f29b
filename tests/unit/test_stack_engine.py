"""`conveyor up --engine vllm`: the example LLMService on vLLM, as the operator will accept it."""

from __future__ import annotations

import re

import pytest
import yaml

from conveyor.cluster import stack
from conveyor.operator.crd import apply_defaults
from conveyor.operator.engines import engine_problems
from conveyor.operator.runtime_manifests import runtime_deployment
from conveyor.operator.settings import OperatorSettings


def test_the_example_on_vllm_is_one_the_operator_runs_as_is() -> None:
    text = re.sub(r"builtin: \S+", f"builtin: {stack.ENGINE_MODEL}", stack.EXAMPLE.read_text())
    example = stack.engine_example(yaml.safe_load(text), "vllm")
    spec = apply_defaults({**example, "metadata": {**example["metadata"], "namespace": "d"}})[
        "spec"
    ]
    assert spec["engine"] == "vllm" and spec["model"] == {"builtin": "conveyor-tiny"}
    assert engine_problems(spec) == []  # nothing the apiserver or the operator would refuse
    assert "maxTotalTokens" not in spec["runtime"]
    obj = {"metadata": {"name": stack.EXAMPLE_NAME, "namespace": "d", "uid": "u"}, "spec": spec}
    pod = runtime_deployment(obj, OperatorSettings())["spec"]["template"]["spec"]
    runtime = next(c for c in pod["containers"] if c["name"] == "runtime")
    assert runtime["image"].startswith("vllm/vllm-openai:") and "--enforce-eager" in runtime["args"]
    assert "cpu" not in runtime["resources"].get("limits", {})


def test_engine_vllm_refuses_the_gguf_model_and_defaults_to_the_tiny_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        stack.main_up(["--engine", "vllm", "--model", "smollm2-135m-instruct"])
    assert exc.value.code == 2
    assert "only engine conveyor reads" in capsys.readouterr().err
    seen: list[stack.StackSettings] = []
    monkeypatch.setattr(stack, "preflight", lambda settings: seen.append(settings))
    monkeypatch.setattr(stack.Stack, "up", lambda self: (_ for _ in ()).throw(KeyboardInterrupt))
    monkeypatch.setattr(stack.Stack, "abort", lambda self: None)
    assert stack.main_up(["--engine", "vllm"]) == 130
    assert (seen[0].engine, seen[0].model) == ("vllm", stack.ENGINE_MODEL)


def test_real_nodes_run_only_the_projects_own_engine() -> None:
    settings = stack.StackSettings(engine="vllm", model=stack.ENGINE_MODEL, node_runtime="kubelet")
    with pytest.raises(SystemExit) as exc:
        stack.preflight(settings)
    assert "--engine vllm has no image for real nodes" in str(exc.value.code)


def test_node_runtime_reaches_the_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[stack.StackSettings] = []
    monkeypatch.setattr(stack, "preflight", lambda settings: seen.append(settings))
    monkeypatch.setattr(stack.Stack, "up", lambda self: (_ for _ in ()).throw(KeyboardInterrupt))
    monkeypatch.setattr(stack.Stack, "abort", lambda self: None)
    assert stack.main_up(["--node-runtime", "kubelet"]) == 130
    assert seen[0].node_runtime == "kubelet"


def test_a_node_runtime_from_the_environment_is_checked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CONVEYOR_NODE_RUNTIME", "docker")
    with pytest.raises(SystemExit) as exc:
        stack.main_up([])
    assert exc.value.code == 2
    assert "CONVEYOR_NODE_RUNTIME='docker' is not one of" in capsys.readouterr().err
