"""``conveyor bench KIND``: benchmarks print figures; they never assert on time."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS: dict[str, tuple[str, str]] = {
    "offline": (
        "conveyor.bench.engine.offline",
        "engine throughput: continuous vs static vs none vs HF",
    ),
    "structured": (
        "conveyor.bench.engine.structured",
        "grammar compile time and step time with constrained requests in the batch",
    ),
    "lora": (
        "conveyor.bench.engine.lora",
        "step time with LoRA adapters in the batch against the base model",
    ),
    "serve": ("conveyor.bench.serve.command", "HTTP load generator against a server or gateway"),
    "serve-compare": (
        "conveyor.bench.serve.compare",
        "scheduling modes and queue policies (fcfs, priority, lpm) side by side, over HTTP",
    ),
    "peer": ("conveyor.bench.peers.peer", "Conveyor vs vLLM for CPU, side by side"),
    "gateway": ("conveyor.bench.gateway.command", "routing policies and gateway overhead"),
    "autoscale": ("conveyor.bench.autoscale.command", "step load against the autoscaler"),
    "startup": (
        "conveyor.bench.startup",
        "conveyor serve's exec to /ready under a CPU limit, optionally against a git revision",
    ),
    "gpu": (
        "conveyor.bench.gpu.command",
        "kernels, decode MBU and continuous vs static batching on a GPU",
    ),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: conveyor bench KIND [ARGS...]\n\nkinds:")
        for name, (_, help_) in BENCHMARKS.items():
            print(f"  {name:<14} {help_}")
        return 0
    if argv[0] not in BENCHMARKS:
        print(
            f"conveyor bench: unknown benchmark {argv[0]!r}; one of {', '.join(BENCHMARKS)}",
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module(BENCHMARKS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)
