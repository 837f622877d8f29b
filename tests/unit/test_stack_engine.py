"""`conveyor up --engine vllm`: the example LLMService on vLLM, as the operator will accept it."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from conveyor.cluster import stack, stack_images
from conveyor.cluster.settings import ClusterSettings
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


def test_on_the_local_cluster_the_example_on_vllm_names_vllm_for_cpu_s_image() -> None:
    text = re.sub(r"builtin: \S+", f"builtin: {stack.ENGINE_MODEL}", stack.EXAMPLE.read_text())
    example = stack.engine_example(yaml.safe_load(text), "vllm", local_cluster=True)
    assert example["spec"]["runtime"]["image"] == "vllm-cpu:0.32.0"
    obj = {"metadata": {"name": stack.EXAMPLE_NAME, "namespace": "d", "uid": "u"}}
    spec = apply_defaults({**example, "metadata": {**example["metadata"], "namespace": "d"}})
    pod = runtime_deployment({**obj, "spec": spec["spec"]}, OperatorSettings())
    (runtime,) = [
        c for c in pod["spec"]["template"]["spec"]["containers"] if c["name"] == "runtime"
    ]
    assert runtime["image"] == "vllm-cpu:0.32.0"


def test_a_reused_cluster_without_vllm_s_image_is_refused_for_vllm(
    tmp_path: Path,
) -> None:
    check = stack_images.check_engine_image
    images = (str(tmp_path / "conveyor-0.1.0.oci"),)
    cluster = ClusterSettings(node_images=images)
    with pytest.raises(RuntimeError, match="conveyor down"):
        check(cluster, "vllm")
    check(replace(cluster, node_images=(*images, str(tmp_path / "vllm-cpu-0.32.0.oci"))), "vllm")
    check(cluster, "conveyor")


def test_the_operator_and_gateway_run_the_torchless_image_where_the_nodes_hold_it(
    tmp_path: Path,
) -> None:
    """As on a real cluster: the chart's image is conveyor-control, the runtime's the full one;
    a cluster started without the control image (or an existing one) keeps the chart's one."""
    full, control = tmp_path / "conveyor-0.1.0.oci", tmp_path / "conveyor-control-0.1.0.oci"
    real = ClusterSettings(node_images=(str(full), str(control)))
    flags = stack_images.chart_images(real)
    assert flags[::2] == ["--set", "--set"]
    assert flags[1] == "image.repository=conveyor-control"
    assert re.fullmatch(r"runtime\.image=conveyor:\S+", flags[3])
    assert stack_images.chart_images(replace(real, node_images=(str(full),))) == []
    assert (
        stack_images.chart_images(ClusterSettings()) == [] and stack_images.chart_images(None) == []
    )
