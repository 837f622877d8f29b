"""Pure builders of one LLMService's runtime children: Deployment, Service, PDB, PodMonitor.

Each takes the LLMService as the apiserver returns it (schema defaults applied) and returns
a manifest dict; the handlers apply them. Unit-tested on their output (tests/operator).
"""

from __future__ import annotations

from typing import Any

from conveyor.operator.engines import (
    BUILTIN_WRITER,
    CONVEYOR,
    WAIT_FOR_MODEL,
    Engine,
    builtin_model_dir,
    engine_flags,
    engine_of,
    lora_args,
)
from conveyor.operator.names import (
    CACHE_MOUNT,
    INSTANCE_LABEL,
    LLMSERVICE_LABEL,
    PORT_NAME,
    RUNTIME_PORT,
    VOLUME_MODEL_MOUNT,
    managed_labels,
    rolling_update,
    runtime_selector,
    scrape_annotations,
)
from conveyor.operator.owners import owner_reference
from conveyor.operator.settings import OperatorSettings

ENGINE_FLAGS: dict[str, str] = CONVEYOR.flags
"""spec.runtime field -> `conveyor serve` flag (canonical names, ARCHITECTURE.md)."""

PRESTOP_DELAY_S = 5
"""Seconds a stopping pod keeps serving before SIGTERM, so that the gateways see its endpoint
go (EndpointSlice watch) before it refuses new requests; SIGTERM then drains in-flight ones."""
GRACE_MARGIN_S = 10
"""Seconds past the drain timeout before the kubelet's SIGKILL."""
STARTUP_BUDGET_S = 3600
"""How long a replica may take to start (a hub download of a large model included)."""
RUN_AS_USER = 1000
"""The image's unprivileged user (Dockerfile)."""
GPU_RESOURCE = "nvidia.com/gpu"


def served_name(llmservice: dict[str, Any]) -> str:
    """The name clients send as ``model``: spec.model.servedName, else the LLMService's name."""
    name: str = llmservice["spec"]["model"].get("servedName") or llmservice["metadata"]["name"]
    return name


def desired_replicas(spec: dict[str, Any]) -> int:
    """Runtime replicas: spec.replicas, clamped to [min, max] while autoscaling is on."""
    replicas = int(spec.get("replicas", 1))
    scaling = spec.get("autoscaling") or {}
    if scaling.get("enabled"):
        replicas = max(
            scaling.get("minReplicas", 1), min(scaling.get("maxReplicas", replicas), replicas)
        )
    return replicas


def model_argument(model: dict[str, Any]) -> str:
    """The ``--model`` value for spec.model (exactly one source is set; the schema checks it)."""
    for source in ("builtin", "hub", "path"):
        if source in model:
            value: str = model[source]
            return value
    sub = model["volume"].get("subPath", "").strip("/")
    return f"{VOLUME_MODEL_MOUNT}/{sub}" if sub else VOLUME_MODEL_MOUNT


def serve_args(llmservice: dict[str, Any]) -> list[str]:
    """``conveyor serve`` arguments: model, name, port, the typed engine settings, then extraArgs."""
    spec = llmservice["spec"]
    runtime = spec.get("runtime") or {}
    args = [
        "serve",
        "--model", model_argument(spec["model"]),
        "--served-model-name", served_name(llmservice),
        "--host", "0.0.0.0",
        "--port", str(RUNTIME_PORT),
    ]  # fmt: skip
    gpus = int((spec.get("resources") or {}).get("gpus", 0))
    args += engine_flags(CONVEYOR, runtime, gpus) + lora_args(CONVEYOR, spec["model"])
    return args + list(runtime.get("extraArgs") or [])


def engine_model(spec: dict[str, Any]) -> str:
    """The model an engine other than Conveyor's is given: a built-in one as the directory
    the model container writes it to, any other as ``--model`` would name it."""
    if builtin := spec["model"].get("builtin"):
        return builtin_model_dir(CACHE_MOUNT, builtin)
    return model_argument(spec["model"])


def engine_command(llmservice: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(command, args) of the runtime container for the LLMService's engine.

    Conveyor: ``conveyor serve ...``. vLLM and SGLang: their own server with the shared
    settings as their own flags (``engines.py``), served name, host and port, then extraArgs.
    A built-in model is waited for until the model container has written it.
    """
    spec = llmservice["spec"]
    engine = engine_of(spec)
    if engine is CONVEYOR:
        return ["conveyor"], serve_args(llmservice)
    runtime = spec.get("runtime") or {}
    model = engine_model(spec)
    args = [model] if engine.model_flag is None else [engine.model_flag, model]
    args += [
        "--served-model-name", served_name(llmservice),
        "--host", "0.0.0.0",
        "--port", str(RUNTIME_PORT),
    ]  # fmt: skip
    gpus = int((spec.get("resources") or {}).get("gpus", 0))
    args += engine_flags(engine, runtime, gpus) + lora_args(engine, spec["model"])
    args += list(runtime.get("extraArgs") or [])
    command = list(engine.command)
    if "builtin" in spec["model"]:
        command = ["sh", "-c", WAIT_FOR_MODEL, model, *command]
    return command, args


def _labels(llmservice: dict[str, Any]) -> dict[str, str]:
    name = llmservice["metadata"]["name"]
    return {**managed_labels("runtime"), INSTANCE_LABEL: name, LLMSERVICE_LABEL: name}


def _metadata(llmservice: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    meta = llmservice["metadata"]
    return {
        "name": name or meta["name"],
        "namespace": meta["namespace"],
        "labels": _labels(llmservice),
        "ownerReferences": [owner_reference(llmservice)],
    }


def _resources(spec_resources: dict[str, Any]) -> dict[str, Any]:
    limits: dict[str, Any] = {}
    requests: dict[str, Any] = {}
    for key in ("cpu", "memory"):
        if key in spec_resources:
            limits[key] = requests[key] = str(spec_resources[key])
    if spec_resources.get("gpus", 0) > 0:
        limits[GPU_RESOURCE] = str(spec_resources["gpus"])
    result: dict[str, Any] = {}
    if limits:
        result["limits"] = limits
    if requests:
        result["requests"] = requests
    return result


def _env(llmservice: dict[str, Any], *, user: bool = True) -> list[dict[str, Any]]:
    """The runtime container's environment: cache locations, the pod's name, the hub token,
    the engine's own variables, then spec.runtime.env (``user``)."""
    model = llmservice["spec"]["model"]
    env: list[dict[str, Any]] = [
        {"name": "CONVEYOR_CACHE", "value": CACHE_MOUNT},
        {"name": "HF_HOME", "value": f"{CACHE_MOUNT}/hf"},
        {"name": "HOME", "value": f"{CACHE_MOUNT}/home"},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    if "hub" not in model:
        env.append({"name": "HF_HUB_OFFLINE", "value": "1"})  # nothing to download
    if token := model.get("hubTokenSecret"):
        ref = {"name": token["name"], "key": token.get("key", "token")}
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
    if not user:
        return env
    env += [{"name": k, "value": v} for k, v in engine_of(llmservice["spec"]).env.items()]
    return env + list((llmservice["spec"].get("runtime") or {}).get("env") or [])


def _volumes(spec: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    resources = spec.get("resources") or {}
    cache = spec.get("cache") or {}
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": resources.get("sharedMemory", "1Gi")}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "cache", "persistentVolumeClaim": {"claimName": cache["claimName"]}}
        if cache.get("claimName")
        else {"name": "cache", "emptyDir": {"sizeLimit": cache.get("sizeLimit", "20Gi")}},
    ]  # fmt: skip
    mounts: list[dict[str, Any]] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cache", "mountPath": CACHE_MOUNT},
    ]
    if volume := spec["model"].get("volume"):
        claim = {"claimName": volume["claimName"], "readOnly": True}
        volumes.append({"name": "model", "persistentVolumeClaim": claim})
        mounts.append({"name": "model", "mountPath": VOLUME_MODEL_MOUNT, "readOnly": True})
    return volumes, mounts


def _probe(path: str, *, period_s: int, timeout_s: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": PORT_NAME},
        "periodSeconds": period_s,
        "timeoutSeconds": timeout_s,
        "failureThreshold": failures,
    }


def _security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def model_container(
    llmservice: dict[str, Any], settings: OperatorSettings, mounts: list[dict[str, Any]]
) -> dict[str, Any]:
    """The container that writes a built-in model into the cache volume for an engine that
    cannot make it (Conveyor's image, which has the generator), then sleeps."""
    name = llmservice["spec"]["model"]["builtin"]
    return {
        "name": "model",
        "image": settings.runtime_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["python", "-c", BUILTIN_WRITER, name, builtin_model_dir(CACHE_MOUNT, name)],
        "env": _env(llmservice, user=False),
        "volumeMounts": [m for m in mounts if m["name"] in ("cache", "tmp")],
        "securityContext": _security_context(),
    }


def _engine_probes(engine: Engine) -> dict[str, Any]:
    return {
        # health answers once the server listens; ready once the model is loaded and not draining.
        "startupProbe": _probe(
            engine.health_path, period_s=5, timeout_s=5, failures=STARTUP_BUDGET_S // 5
        ),
        "readinessProbe": _probe(engine.ready_path, period_s=2, timeout_s=3, failures=2),
        "livenessProbe": _probe(engine.health_path, period_s=10, timeout_s=5, failures=3),
    }


def runtime_deployment(llmservice: dict[str, Any], settings: OperatorSettings) -> dict[str, Any]:
    """The Deployment of runtime replicas: one container of the LLMService's engine per pod
    (``conveyor serve``, ``vllm serve`` or SGLang's server), and for another engine than
    Conveyor's on a built-in model, the container that writes that model."""
    spec = llmservice["spec"]
    engine = engine_of(spec)
    runtime = spec.get("runtime") or {}
    placement = spec.get("placement") or {}
    resources = spec.get("resources") or {}
    drain_s = int(runtime.get("drainTimeoutSeconds", 30))
    volumes, mounts = _volumes(spec)
    command, args = engine_command(llmservice)
    container = {
        "name": "runtime",
        "image": runtime.get("image") or engine.image or settings.runtime_image,
        "imagePullPolicy": runtime.get("imagePullPolicy") or settings.image_pull_policy,
        "command": command,
        "args": args,
        "ports": [{"name": PORT_NAME, "containerPort": RUNTIME_PORT, "protocol": "TCP"}],
        "env": _env(llmservice),
        "resources": _resources(resources),
        "volumeMounts": mounts,
        **_engine_probes(engine),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_DELAY_S)]}}},
        "securityContext": _security_context(),
    }
    containers = [container]
    if engine is not CONVEYOR and "builtin" in spec["model"]:
        containers.append(model_container(llmservice, settings, mounts))
    tolerations = list(placement.get("tolerations") or [])
    if resources.get("gpus", 0) > 0:
        # GPU node pools are tainted; managed clusters add this through ExtendedResourceToleration.
        tolerations.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    pod_spec: dict[str, Any] = {
        "containers": containers,
        "volumes": volumes,
        "terminationGracePeriodSeconds": drain_s + PRESTOP_DELAY_S + GRACE_MARGIN_S,
        "automountServiceAccountToken": False,  # a replica never talks to the apiserver
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if placement.get("nodeSelector"):
        pod_spec["nodeSelector"] = dict(placement["nodeSelector"])
    if placement.get("affinity"):
        pod_spec["affinity"] = placement["affinity"]
    selector = runtime_selector(llmservice["metadata"]["name"])
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(llmservice),
        "spec": {
            "replicas": desired_replicas(spec),
            "selector": {"matchLabels": selector},
            # New replicas are Ready before old ones go; in-flight requests drain (preStop + SIGTERM).
            "strategy": rolling_update(),
            "revisionHistoryLimit": 5,
            "template": {
                "metadata": {
                    "labels": _labels(llmservice),
                    "annotations": scrape_annotations(RUNTIME_PORT),
                },
                "spec": pod_spec,
            },
        },
    }


def runtime_service(llmservice: dict[str, Any]) -> dict[str, Any]:
    """The runtime replicas' Service; its labels reach its EndpointSlices, which the gateway watches."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(llmservice),
        "spec": {
            "type": "ClusterIP",
            "selector": runtime_selector(llmservice["metadata"]["name"]),
            "ports": [
                {
                    "name": PORT_NAME,
                    "port": RUNTIME_PORT,
                    "targetPort": PORT_NAME,
                    "protocol": "TCP",
                }
            ],
        },
    }


def runtime_pdb(llmservice: dict[str, Any]) -> dict[str, Any]:
    """At most one replica voluntarily disrupted at a time; a replica stuck loading never blocks a drain."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(llmservice),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": runtime_selector(llmservice["metadata"]["name"])},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def runtime_podmonitor(llmservice: dict[str, Any]) -> dict[str, Any]:
    """A Prometheus Operator PodMonitor for the replicas (only where monitoring.coreos.com/v1 exists)."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": _metadata(llmservice),
        "spec": {
            "selector": {"matchLabels": runtime_selector(llmservice["metadata"]["name"])},
            "podMetricsEndpoints": [
                {
                    "port": PORT_NAME,
                    "path": "/metrics",
                    "interval": "15s",
                    "relabelings": [
                        {
                            "sourceLabels": ["__meta_kubernetes_pod_label_conveyor_dev_llmservice"],
                            "targetLabel": "llmservice",
                        }
                    ],
                }
            ],
        },
    }


def runtime_children(
    llmservice: dict[str, Any], settings: OperatorSettings, *, podmonitor: bool
) -> list[dict[str, Any]]:
    """Every runtime child, in the order they are applied."""
    children = [
        runtime_service(llmservice),
        runtime_pdb(llmservice),
        runtime_deployment(llmservice, settings),
    ]
    if podmonitor:
        children.append(runtime_podmonitor(llmservice))
    return children
