"""``conveyor bench KIND``: benchmarks print figures; they never assert on time."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS: dict[str, tuple[str, str]] = {
    "offline": (
        "conveyor.runtime.bench.offline",
        "engine throughput: continuous vs static vs none vs HF",
    ),
    "structured": (
        "conveyor.runtime.bench.structured",
        "grammar compile time and step time with constrained requests in the batch",
    ),
    "serve": ("conveyor.runtime.bench.serve", "HTTP load generator against a server or gateway"),
    "serve-compare": ("conveyor.runtime.bench.serve_compare", "the seed's comparison over HTTP"),
    "peer": ("conveyor.runtime.bench.peer", "Conveyor vs vLLM for CPU, side by side"),
    "gateway": ("conveyor.gateway.bench", "routing policies and gateway overhead"),
    "autoscale": ("conveyor.operator.bench_autoscale", "step load against the autoscaler"),
    "gpu": ("conveyor.runtime.bench.gpu", "kernels, decode MBU and the seed comparison on a GPU"),
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
