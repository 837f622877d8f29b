"""Engine settings: what the user chose, parsed once, never written back.

Values derived at run time (number of KV blocks, EOS ids, the resolved dtype)
live in ``EngineState`` (``runtime/engine/state.py``), not here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

SCHEDULER_MODES: tuple[str, ...] = ("continuous", "static", "none")
SCHEDULING_POLICIES: tuple[str, ...] = ("fcfs", "priority", "lpm")
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS: tuple[str, ...] = ("auto", "safetensors", "dummy")
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "torch", "cpu", "triton")

DEFAULT_TOKEN_BUDGET: dict[str, int] = {"cpu": 512, "cuda": 2048}
"""Tokens per engine step when ``chunked_prefill_size`` is not set. On a GPU a step of 2,048
tokens costs little more than one of 512 (SGLang's and vLLM's default is 2,048). On a CPU a
step's time grows with its tokens (SmolLM2 on 2 cores: 0.3 s for 512, 1.2 s for 2,048), so
a smaller budget gives a burst of prompts its first tokens in turn rather than all after the
last chunk, and stalls the running decodes for a quarter of the time: against vLLM for CPU
(``conveyor bench peer``, 32 streams of 128 in / 128 out) TTFT p50 went from 1.02x vLLM's to
0.40x, at 1.25-1.28x its output tokens per second either way."""


class AdapterError(ValueError):
    """An adapter that cannot be served here; the message says why and what to do."""


@dataclass(frozen=True)
class LoRAModule:
    """One ``--lora-modules`` entry: the name requests use as ``model``, and the folder."""

    name: str
    path: str

    @classmethod
    def parse(cls, text: str) -> LoRAModule:
        """``name=path``, or vLLM's JSON form ``{"name": ..., "path": ...}``."""
        text = text.strip()
        if text.startswith("{"):
            try:
                given = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--lora-modules {text!r} is not valid JSON: {exc}") from None
            if not isinstance(given, dict) or not {"name", "path"} <= given.keys():
                raise ValueError(f'--lora-modules JSON needs "name" and "path", got {text!r}')
            name, path = str(given["name"]), str(given["path"])
        else:
            name, sep, path = text.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules takes name=path, got {text!r}")
        check_adapter_name(name.strip())
        if not path.strip():
            raise ValueError(f"--lora-modules {text!r} names no folder")
        return cls(name.strip(), path.strip())


def check_adapter_name(name: str) -> None:
    """An adapter's name is what requests send as ``model``: printable, without spaces."""
    if not name or len(name) > 256 or not name.isprintable() or any(c.isspace() for c in name):
        raise AdapterError(
            f"adapter name {name!r} must be 1-256 printable characters without spaces"
        )


@dataclass(frozen=True)
class EngineSettings:
    """How one engine is built and scheduled. Flag names follow SGLang and vLLM."""

    model: str = "smollm2-135m-instruct"
    """A built-in model (``smollm2-135m-instruct``, a real instruct model; ``conveyor-tiny``,
    random weights for tests), a GGUF file, a model directory, or a hub id already in the local
    cache. The default is the real model a new user should meet."""

    tokenizer: str | None = None
    """Tokenizer directory or id; defaults to the model's own."""

    dtype: str = "auto"
    """Weights and activations: ``auto`` takes the config's dtype on GPU and float32 on CPU
    (CPU half-precision matmuls are slow without AMX)."""

    load_format: str = "auto"
    """``safetensors`` loads the weights; ``dummy`` builds the architecture from the config with
    random weights, for benchmarks of real model shapes without the files."""

    device: str = "auto"
    """``auto`` picks CUDA when present, else CPU."""

    seed: int = 0
    """Seed for dummy weights and for requests that do not bring their own."""

    max_running_requests: int = 64
    """Cap on requests in the running batch (SGLang's name). 64 keeps CPU steps short; raise on GPU."""

    chunked_prefill_size: int | None = None
    """Token budget of one engine step: decodes first, prefill chunks fill the rest (tokens).
    None: ``DEFAULT_TOKEN_BUDGET`` for the device."""

    max_model_len: int | None = None
    """Longest prompt + output in tokens; defaults to the model's limit, clamped to the KV cache."""

    block_size: int = 16
    """Tokens per KV-cache block (SGLang calls it the page size). 16 is vLLM's default."""

    max_total_tokens: int | None = None
    """KV-cache size in tokens. When unset: on GPU from ``mem_fraction_static``, on CPU from
    ``cpu_kv_cache_bytes``."""

    mem_fraction_static: float = 0.88
    """GPU only: fraction of device memory for weights + KV cache (SGLang's default region)."""

    cpu_kv_cache_bytes: int = 1 << 30
    """CPU only: KV-cache budget in bytes when ``max_total_tokens`` is unset (1 GiB); each
    tensor-parallel rank's, for its own share of the KV heads."""

    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes (hash of full blocks)."""

    scheduler: str = "continuous"
    """``continuous`` refills a finished slot at the next step; ``static`` runs a batch until
    every member finishes; ``none`` runs one request at a time. Same kernels: only admission
    differs."""

    scheduling_policy: str = "fcfs"
    """The waiting queue's order: ``fcfs`` (arrival), ``priority`` (each request's
    ``priority``, lower first, as vLLM's) or ``lpm`` (most of the prompt in the prefix
    cache first, SGLang's ``--schedule-policy lpm``); ``scheduler.py``."""

    attention_backend: str = "auto"
    """``torch`` (the reference), ``cpu`` (C++ kernels), ``triton`` (GPU kernels) or ``auto``
    (triton on CUDA, cpu on CPU when its kernels are built, else torch)."""

    enforce_eager: bool = False
    """GPU only: never capture CUDA graphs."""

    piecewise_cuda_graph_max_tokens: int | None = None
    """GPU only: steps that hold a prefill, up to this many tokens, replay CUDA graphs between
    the layers' attention (``piecewise_graphs.py``); 0 turns them off. None: the step's token
    budget, so every step does."""

    num_threads: int | None = None
    """CPU threads for torch, shared out evenly among the tensor-parallel ranks; defaults to
    the process's CPU limit (cgroup quota or cores)."""

    generation_config: str = "auto"
    """Default sampling parameters for requests that leave them out: ``auto`` takes the
    model's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty,
    max_new_tokens), as vLLM does; ``vllm`` ignores it; else a folder holding one
    (``sampling_defaults.py``)."""

    tensor_parallel_size: int = 1
    """Ranks one replica's model is split over (one process and one GPU each; on CPU, each
    its share of the cores). 1: no split, no extra process. A model's attention heads, MLP
    width and KV heads (or the ranks, for fewer KV heads) must divide by it."""

    lora_modules: tuple[LoRAModule, ...] = ()
    """LoRA adapters served beside the base model from the start: requests choose one by
    sending its name as ``model`` (vLLM's ``--lora-modules name=path``)."""

    enable_lora: bool = False
    """Serve LoRA adapters; implied by ``lora_modules``. Without any given, adapters come
    through ``POST /v1/load_lora_adapter`` (the server's ``--allow-runtime-lora-updating``)."""

    max_loras: int | None = None
    """Device slots made for adapters at start (vLLM's flag, where it bounds the adapters one
    batch mixes; here a step mixes any loaded adapters, at a cost that grows with those in
    it). None: as many as ``lora_modules`` holds, at least 1. More are made as adapters are
    loaded."""

    max_cpu_loras: int | None = None
    """Adapters loaded at most (vLLM's name; here they all stay on the device): a load past
    it is refused until one is unloaded. None: no bound."""

    max_lora_rank: int = 16
    """The highest rank an adapter may have (vLLM's default, 16); lower ranks are padded."""

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    @property
    def lora_slots(self) -> int:
        """Slots made at start: ``max_loras``, and one for each of ``lora_modules``."""
        slots = max(self.max_loras or 1, len(self.lora_modules))
        return slots if self.max_cpu_loras is None else min(slots, self.max_cpu_loras)

    def token_budget(self, device_type: str) -> int:
        """``chunked_prefill_size``, or the default for a device of this type."""
        if self.chunked_prefill_size is not None:
            return self.chunked_prefill_size
        return DEFAULT_TOKEN_BUDGET.get(device_type, DEFAULT_TOKEN_BUDGET["cuda"])

    def __post_init__(self) -> None:
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("load_format", self.load_format, LOAD_FORMATS)
        _check_choice("scheduler", self.scheduler, SCHEDULER_MODES)
        _check_choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_positive("max_running_requests", self.max_running_requests)
        if self.chunked_prefill_size is not None:
            _check_positive("chunked_prefill_size", self.chunked_prefill_size)
        _check_positive("block_size", self.block_size)
        if self.piecewise_cuda_graph_max_tokens is not None and (
            not isinstance(self.piecewise_cuda_graph_max_tokens, int)
            or isinstance(self.piecewise_cuda_graph_max_tokens, bool)
            or self.piecewise_cuda_graph_max_tokens < 0
        ):
            raise ValueError(
                "piecewise_cuda_graph_max_tokens must be 0 (off) or a positive integer, "
                f"got {self.piecewise_cuda_graph_max_tokens!r}"
            )
        if self.max_model_len is not None:
            _check_positive("max_model_len", self.max_model_len)
        if self.max_total_tokens is not None:
            _check_positive("max_total_tokens", self.max_total_tokens)
        _check_positive("cpu_kv_cache_bytes", self.cpu_kv_cache_bytes)
        _check_positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.max_loras is not None:
            _check_positive("max_loras", self.max_loras)
        _check_positive("max_lora_rank", self.max_lora_rank)
        names = [m.name for m in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules names must differ, got {names}")
        if self.max_cpu_loras is not None:
            _check_positive("max_cpu_loras", self.max_cpu_loras)
            if self.max_cpu_loras < len(self.lora_modules):
                raise ValueError(
                    f"max_cpu_loras {self.max_cpu_loras} is fewer than the "
                    f"{len(self.lora_modules)} lora_modules given"
                )
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(
                f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}"
            )

    # -- command line ------------------------------------------------------------------

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add the engine's flags (canonical names first, SGLang/vLLM spellings as aliases)."""
        d = EngineSettings()
        g = parser.add_argument_group("engine")
        g.add_argument(
            "--model",
            "--model-path",
            default=d.model,
            help="smollm2-135m-instruct (built in, the default), conveyor-tiny (built in, random "
            "weights), a .gguf file, a model directory, or a cached hub id",
        )
        g.add_argument(
            "--tokenizer",
            "--tokenizer-path",
            default=None,
            help="tokenizer directory, .gguf file or id (default: the model's own)",
        )
        g.add_argument(
            "--dtype",
            default=d.dtype,
            choices=DTYPES,
            help="weights/activations dtype; auto = config dtype on GPU, float32 on CPU",
        )
        g.add_argument(
            "--load-format",
            default=d.load_format,
            choices=LOAD_FORMATS,
            help="dummy = random weights of the config's shapes (benchmarks)",
        )
        g.add_argument("--device", default=d.device, help="auto, cpu, cuda, cuda:N")
        g.add_argument(
            "--seed", type=int, default=d.seed, help="seed for dummy weights and unseeded sampling"
        )
        g.add_argument(
            "--max-running-requests",
            "--max-num-seqs",
            type=int,
            default=d.max_running_requests,
            help="max requests in the running batch (default %(default)s)",
        )
        g.add_argument(
            "--chunked-prefill-size",
            "--max-num-batched-tokens",
            type=int,
            default=d.chunked_prefill_size,
            help="token budget per engine step (default "
            + ", ".join(f"{n} on {dev.upper()}" for dev, n in DEFAULT_TOKEN_BUDGET.items())
            + ")",
        )
        g.add_argument(
            "--max-model-len",
            "--context-length",
            type=int,
            default=None,
            help="max prompt+output tokens (default: the model's, clamped to the KV cache)",
        )
        g.add_argument(
            "--block-size",
            "--page-size",
            type=int,
            default=d.block_size,
            help=f"tokens per KV-cache block (default {d.block_size})",
        )
        g.add_argument(
            "--max-total-tokens",
            type=int,
            default=None,
            help="KV-cache size in tokens (the way to size it on CPU)",
        )
        g.add_argument(
            "--mem-fraction-static",
            "--gpu-memory-utilization",
            type=float,
            default=d.mem_fraction_static,
            help=f"GPU: fraction of memory for weights + KV cache (default {d.mem_fraction_static})",
        )
        g.add_argument(
            "--cpu-kv-cache-bytes",
            type=parse_bytes,
            default=d.cpu_kv_cache_bytes,
            help="CPU: KV-cache budget when --max-total-tokens is unset (e.g. 512MiB; default 1GiB)",
        )
        g.add_argument(
            "--disable-prefix-caching",
            "--disable-radix-cache",
            action="store_true",
            help="do not reuse KV blocks of shared prompt prefixes",
        )
        g.add_argument(
            "--scheduler",
            default=d.scheduler,
            choices=SCHEDULER_MODES,
            help="continuous (default), static (batch runs to completion), none (one at a time)",
        )
        g.add_argument(
            "--scheduling-policy",
            "--schedule-policy",
            default=d.scheduling_policy,
            choices=SCHEDULING_POLICIES,
            help="order of the waiting queue: fcfs (arrival, default), priority (the request's "
            "'priority' field, lower first; vLLM's) or lpm (longest cached prefix first; "
            "SGLang's)",
        )
        g.add_argument(
            "--attention-backend",
            default=d.attention_backend,
            choices=ATTENTION_BACKENDS,
            help="auto = triton on CUDA, cpu (C++ kernels) on CPU when built, else torch",
        )
        g.add_argument(
            "--enforce-eager",
            "--disable-cuda-graph",
            action="store_true",
            help="GPU: never capture CUDA graphs",
        )
        g.add_argument(
            "--piecewise-cuda-graph-max-tokens",
            type=int,
            default=None,
            help="GPU: steps holding a prefill of up to this many tokens run as CUDA graphs "
            "between the layers' attention; 0 turns that off (default: the step token budget)",
        )
        g.add_argument(
            "--num-threads",
            type=int,
            default=None,
            help="CPU threads for torch, split evenly among tensor-parallel ranks (default: the "
            "CPU limit of this process)",
        )
        g.add_argument(
            "--generation-config",
            default=d.generation_config,
            metavar="{auto,vllm,FOLDER}",
            help="default temperature, top_p, top_k, min_p, repetition_penalty and max_tokens "
            "of requests that leave them out: auto (default) = the model's generation_config.json, "
            "as vLLM; vllm = ignore it; or a folder holding a generation_config.json",
        )
        g.add_argument(
            "--tensor-parallel-size",
            "--tp-size",
            type=int,
            default=d.tensor_parallel_size,
            help="split the model over this many ranks, one process (and GPU) each; the model's "
            f"heads must divide by it (default {d.tensor_parallel_size})",
        )

        g = parser.add_argument_group("LoRA adapters")
        g.add_argument(
            "--lora-modules",
            nargs="+",
            type=_lora_module_arg,
            default=[],
            metavar="NAME=PATH",
            help="LoRA adapters to serve (PEFT folders: adapter_config.json and "
            'adapter_model.safetensors), as name=path or vLLM\'s JSON {"name": ..., "path": '
            "...}; a request picks one by sending its name as model",
        )
        g.add_argument(
            "--enable-lora",
            action="store_true",
            help="serve LoRA adapters (implied by --lora-modules); with "
            "--allow-runtime-lora-updating they can be loaded later",
        )
        g.add_argument(
            "--max-loras",
            type=int,
            default=None,
            help="device slots made for adapters at start (more are made as adapters are "
            "loaded); vLLM's flag, where it bounds the adapters one batch mixes: a Conveyor "
            "step mixes any loaded adapters (default: one per --lora-modules, at least 1)",
        )
        g.add_argument(
            "--max-cpu-loras",
            type=int,
            default=None,
            help="adapters loaded at most (all on the device); a load past it is refused "
            "until one is unloaded (default: no bound)",
        )
        g.add_argument(
            "--max-lora-rank",
            type=int,
            default=d.max_lora_rank,
            help="the highest adapter rank served (default %(default)s)",
        )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineSettings:
        """The settings ``add_cli_args``' flags name, each under its field's name."""
        given = vars(args)
        values = {f.name: given[f.name] for f in dataclasses.fields(cls) if f.name in given}
        values["enable_prefix_caching"] = not args.disable_prefix_caching
        values["lora_modules"] = tuple(args.lora_modules)
        return cls(**values)

    def replace(self, **changes: Any) -> EngineSettings:
        return dataclasses.replace(self, **changes)


def _lora_module_arg(text: str) -> LoRAModule:
    try:
        return LoRAModule.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
}


def parse_bytes(text: str) -> int:
    """Parse ``512MiB``, ``2GB``, ``1073741824`` into bytes (argparse ``type``)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512MiB or 2GiB)")
    return int(float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()])


__all__ = ["AdapterError", "EngineSettings", "LoRAModule", "check_adapter_name", "parse_bytes"]
