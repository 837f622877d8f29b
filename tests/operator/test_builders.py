"""Every builder on its output, for a minimal spec and a full one (defaults applied from the CRD)."""

from __future__ import annotations

from typing import Any

import pytest

from conveyor.operator.crd import apply_defaults
from conveyor.operator.gateway_manifests import gateway_children, gateway_url
from conveyor.operator.names import GATEWAY_NAME, selector_string
from conveyor.operator.rbac import GATEWAY_RULES
from conveyor.operator.runtime_manifests import (
    ENGINE_FLAGS,
    GRACE_MARGIN_S,
    PRESTOP_DELAY_S,
    desired_replicas,
    runtime_children,
    runtime_deployment,
    runtime_pdb,
    runtime_podmonitor,
    runtime_service,
    serve_args,
)
from conveyor.operator.settings import OperatorSettings

SETTINGS = OperatorSettings(runtime_image="registry.example/conveyor:1.0")


def llmservice(name: str, spec: dict[str, Any], uid: str = "uid-1") -> dict[str, Any]:
    """What the apiserver hands the operator: the schema's defaults filled in."""
    body = {
        "apiVersion": "conveyor.dev/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": name, "namespace": "team", "uid": uid, "generation": 1},
        "spec": spec,
    }
    return apply_defaults(body)


MINIMAL = llmservice("tiny", {"model": {"builtin": "conveyor-tiny"}})
FULL = llmservice(
    "qwen",
    {
        "model": {
            "hub": "Qwen/Qwen2.5-7B-Instruct",
            "servedName": "qwen-7b",
            "hubTokenSecret": {"name": "hf"},
        },
        "runtime": {
            "image": "my/conveyor:cu12",
            "imagePullPolicy": "Always",
            "maxRunningRequests": 128,
            "maxQueuedRequests": 256,
            "chunkedPrefillSize": 4096,
            "memFractionStatic": 0.85,
            "maxTotalTokens": 200000,
            "maxModelLen": 8192,
            "dtype": "bfloat16",
            "blockSize": 32,
            "scheduler": "continuous",
            "schedulingPolicy": "lpm",
            "drainTimeoutSeconds": 60,
            "toolCallParser": "hermes",
            "extraArgs": ["--seed", "7"],
            "env": [{"name": "NCCL_DEBUG", "value": "WARN"}],
        },
        "resources": {"gpus": 2, "cpu": "8", "memory": "64Gi", "sharedMemory": "8Gi"},
        "cache": {"claimName": "model-cache"},
        "placement": {
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            "tolerations": [
                {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}
            ],
            "affinity": {
                "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}
            },
        },
        "replicas": 9,
        "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6},
        "routing": {"policy": "least-load"},
    },
)
VOLUME = llmservice(
    "vol",
    {"model": {"volume": {"claimName": "models", "subPath": "llama/8b"}}, "resources": {"gpus": 0}},
)


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


@pytest.mark.parametrize("obj", [MINIMAL, FULL, VOLUME], ids=["minimal", "full", "volume"])
def test_labels_and_selectors_match_each_other(obj: dict[str, Any]) -> None:
    name = obj["metadata"]["name"]
    deployment, service, pdb, monitor = (
        runtime_deployment(obj, SETTINGS), runtime_service(obj), runtime_pdb(obj), runtime_podmonitor(obj)
    )  # fmt: skip
    selector = deployment["spec"]["selector"]["matchLabels"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector == {
        "app.kubernetes.io/name": "conveyor",
        "app.kubernetes.io/component": "runtime",
        "conveyor.dev/llmservice": name,
    }
    assert selector.items() <= pod_labels.items()
    for child in (service, pdb, monitor):
        chosen = child["spec"]["selector"]
        assert chosen.get("matchLabels", chosen) == selector
    # the Service's labels reach its EndpointSlices: the gateway selects them like this
    assert {
        "conveyor.dev/llmservice": name,
        "app.kubernetes.io/component": "runtime",
    }.items() <= service["metadata"]["labels"].items()
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "8000",
        "prometheus.io/path": "/metrics",
    }


@pytest.mark.parametrize("obj", [MINIMAL, FULL], ids=["minimal", "full"])
def test_every_child_is_owned_by_its_llmservice(obj: dict[str, Any]) -> None:
    for child in runtime_children(obj, SETTINGS, podmonitor=True):
        assert child["metadata"]["namespace"] == "team"
        assert child["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "conveyor.dev/v1alpha1",
                "kind": "LLMService",
                "name": obj["metadata"]["name"],
                "uid": "uid-1",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    kinds = [c["kind"] for c in runtime_children(obj, SETTINGS, podmonitor=False)]
    assert kinds == ["Service", "PodDisruptionBudget", "Deployment"]


def test_minimal_spec_runs_the_builtin_model_on_one_gpu_with_runtime_defaults() -> None:
    deployment = runtime_deployment(MINIMAL, SETTINGS)
    c = container(deployment)
    assert c["image"] == "registry.example/conveyor:1.0"
    assert c["command"] == ["conveyor"]
    assert c["args"] == [
        "serve", "--model", "conveyor-tiny", "--served-model-name", "tiny",
        "--host", "0.0.0.0", "--port", "8000", "--drain-timeout", "30",
    ]  # fmt: skip
    assert c["resources"] == {"limits": {"nvidia.com/gpu": "1"}}
    assert deployment["spec"]["replicas"] == 1
    env = {e["name"]: e for e in c["env"]}
    assert env["HF_HUB_OFFLINE"]["value"] == "1"
    assert env["CONVEYOR_CACHE"]["value"] == "/var/cache/conveyor"
    pod = deployment["spec"]["template"]["spec"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert "nodeSelector" not in pod and "affinity" not in pod
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["cache"] == {"name": "cache", "emptyDir": {"sizeLimit": "20Gi"}}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}


def test_full_spec_turns_every_engine_setting_into_its_serve_flag() -> None:
    args = serve_args(FULL)
    runtime = FULL["spec"]["runtime"]
    for field, name in ENGINE_FLAGS.items():
        assert flag(args, name) == str(runtime[field]), name
    assert flag(args, "--model") == "Qwen/Qwen2.5-7B-Instruct"
    assert flag(args, "--served-model-name") == "qwen-7b"
    assert args[-2:] == ["--seed", "7"]  # extraArgs last, as given
    # each flag is one the runtime accepts
    import argparse

    from conveyor.runtime.server.settings import ServerSettings

    parser = argparse.ArgumentParser()
    ServerSettings.add_cli_args(parser)
    parsed = ServerSettings.from_cli_args(parser.parse_args(args[1:]))
    assert parsed.engine.max_running_requests == 128 and parsed.engine.block_size == 32
    assert parsed.max_queued_requests == 256 and parsed.drain_timeout == 60
    assert parsed.model_name == "qwen-7b"
    assert parsed.tool_call_parser == "hermes"


def test_tool_call_parser_is_typed_with_the_runtimes_parsers_and_passed_only_when_set() -> None:
    """spec.runtime.toolCallParser: the CRD offers exactly the parsers ``conveyor serve
    --tool-call-parser`` knows (a typo is rejected by the apiserver, not by a crash-looping
    pod), and a spec without it passes no flag (tool_choice auto stays refused)."""
    import yaml

    from conveyor.operator.crd import CRD_FILE
    from conveyor.runtime.server.settings import TOOL_CALL_PARSERS

    crd = yaml.safe_load(CRD_FILE.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    field = spec["properties"]["runtime"]["properties"]["toolCallParser"]
    assert field["type"] == "string" and field["enum"] == list(TOOL_CALL_PARSERS)
    assert "default" not in field and "toolCallParser" not in MINIMAL["spec"]["runtime"]
    assert "--tool-call-parser" not in serve_args(MINIMAL)
    hermes = llmservice(
        "chat", {"model": {"builtin": "conveyor-tiny"}, "runtime": {"toolCallParser": "hermes"}}
    )
    args = serve_args(hermes)
    assert flag(args, "--tool-call-parser") == "hermes"
    assert (
        runtime_deployment(hermes, SETTINGS)["spec"]["template"]["spec"]["containers"][0]["args"]
        == args
    )


def test_full_spec_resources_placement_volumes_and_replicas() -> None:
    deployment = runtime_deployment(FULL, SETTINGS)
    c = container(deployment)
    pod = deployment["spec"]["template"]["spec"]
    assert c["image"] == "my/conveyor:cu12" and c["imagePullPolicy"] == "Always"
    assert c["resources"] == {
        "limits": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "2"},
        "requests": {"cpu": "8", "memory": "64Gi"},
    }
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"][0]["key"] == "dedicated" and len(pod["tolerations"]) == 2
    assert "podAntiAffinity" in pod["affinity"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["cache"]["persistentVolumeClaim"] == {"claimName": "model-cache"}
    assert volumes["dshm"]["emptyDir"]["sizeLimit"] == "8Gi"
    env = {e["name"]: e for e in c["env"]}
    assert "HF_HUB_OFFLINE" not in env  # a hub model may be downloaded
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert env["NCCL_DEBUG"]["value"] == "WARN"
    # autoscaling on: spec.replicas (9) clamped to [2, 6]
    assert deployment["spec"]["replicas"] == 6
    assert pod["terminationGracePeriodSeconds"] == 60 + PRESTOP_DELAY_S + GRACE_MARGIN_S


def test_model_from_a_volume_is_mounted_read_only() -> None:
    deployment = runtime_deployment(VOLUME, SETTINGS)
    c = container(deployment)
    assert flag(c["args"], "--model") == "/models/volume/llama/8b"
    assert {"name": "model", "mountPath": "/models/volume", "readOnly": True} in c["volumeMounts"]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    assert "tolerations" not in deployment["spec"]["template"]["spec"]


@pytest.mark.parametrize("obj", [MINIMAL, FULL], ids=["minimal", "full"])
def test_probes_security_and_rollout(obj: dict[str, Any]) -> None:
    deployment = runtime_deployment(obj, SETTINGS)
    c = container(deployment)
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    startup = c["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800  # model loading is slow
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(PRESTOP_DELAY_S)]
    assert c["securityContext"] == {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    pod = deployment["spec"]["template"]["spec"]
    assert (
        pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    )
    assert pod["automountServiceAccountToken"] is False
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/dev/shm", "/tmp", "/var/cache/conveyor"} <= mounts
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }


def test_service_pdb_and_podmonitor() -> None:
    service = runtime_service(MINIMAL)
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}
    ]
    pdb = runtime_pdb(MINIMAL)
    assert pdb["apiVersion"] == "policy/v1" and pdb["spec"]["maxUnavailable"] == 1
    monitor = runtime_podmonitor(MINIMAL)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
    assert endpoint["relabelings"][0]["targetLabel"] == "llmservice"


def test_desired_replicas_is_the_users_unless_autoscaling_clamps_it() -> None:
    assert desired_replicas({"replicas": 3}) == 3
    assert desired_replicas({"replicas": 0}) == 0
    scaling = {"enabled": True, "minReplicas": 1, "maxReplicas": 4}
    assert desired_replicas({"replicas": 9, "autoscaling": scaling}) == 4
    assert desired_replicas({"replicas": 0, "autoscaling": scaling}) == 1
    assert desired_replicas({"replicas": 9, "autoscaling": {**scaling, "enabled": False}}) == 9


def test_gateway_is_owned_by_every_llmservice_of_the_namespace() -> None:
    other = llmservice("code", {"model": {"builtin": "conveyor-tiny"}}, uid="uid-2")
    children = gateway_children("team", [other, MINIMAL], SETTINGS)
    assert [c["kind"] for c in children] == [
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "Service",
        "Deployment",
    ]
    for child in children:
        assert child["metadata"]["name"] == GATEWAY_NAME
        refs = child["metadata"]["ownerReferences"]
        assert [(r["name"], r["uid"], r["controller"]) for r in refs] == [
            ("code", "uid-2", False),
            ("tiny", "uid-1", False),
        ]
    _sa, role, binding, service, deployment = children
    assert role["rules"] == GATEWAY_RULES
    assert binding["roleRef"]["name"] == GATEWAY_NAME
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": GATEWAY_NAME, "namespace": "team"}
    ]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == GATEWAY_NAME
    c = pod["containers"][0]
    assert c["args"][:6] == [
        "gateway",
        "--port",
        "8080",
        "--k8s-namespace",
        "team",
        "--k8s-llmservices",
    ]
    assert deployment["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    assert (
        deployment["spec"]["selector"]["matchLabels"].items()
        <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    assert service["spec"]["ports"][0]["port"] == 8080
    assert "nvidia.com/gpu" not in c["resources"]["limits"]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert gateway_url("team") == "http://conveyor-gateway.team.svc:8080/v1"
    # the gateway's flags are ones `conveyor gateway` accepts
    from conveyor.gateway.cli import parse_settings

    parsed = parse_settings(c["args"][1:])
    assert parsed.k8s_llmservices and parsed.k8s_namespace == "team" and parsed.port == 8080


def test_gateway_api_key_comes_from_the_configured_secret() -> None:
    settings = OperatorSettings(gateway_api_key_secret="gw-keys", gateway_replicas=2)
    deployment = gateway_children("team", [MINIMAL], settings)[-1]
    env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["CONVEYOR_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "gw-keys",
        "key": "api-key",
    }
    assert deployment["spec"]["replicas"] == 2
    with pytest.raises(ValueError, match="at least one LLMService"):
        gateway_children("team", [], settings)


def test_the_gateway_queues_requests_when_the_operator_is_told_to() -> None:
    from conveyor.gateway.cli import parse_settings
    from conveyor.operator.cli import parse_settings as operator_settings

    for flags, queues in (
        ([], False),
        (["--gateway-queue"], True),
        (["--no-gateway-queue"], False),
    ):
        settings = operator_settings(flags)
        deployment = gateway_children("team", [MINIMAL], settings)[-1]
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        assert parse_settings(args[1:]).queue_at_gateway is queues


def test_selector_string() -> None:
    assert selector_string({"a": "1", "b": "2"}) == "a=1,b=2"


def test_the_default_images_are_this_releases_tag_not_latest() -> None:
    """An untagged `conveyor` means `conveyor:latest`: no release publishes it and an offline
    node (the one-machine cluster's real nodes) cannot pull it."""
    from conveyor import __version__

    service = MINIMAL
    gateway = gateway_children("team", [service], OperatorSettings())
    deployment = runtime_deployment(service, OperatorSettings())
    images = {c["image"] for c in deployment["spec"]["template"]["spec"]["containers"]} | {
        c["image"]
        for child in gateway
        if child["kind"] == "Deployment"
        for c in child["spec"]["template"]["spec"]["containers"]
    }
    assert images == {f"conveyor:{__version__}"}
