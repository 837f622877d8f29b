"""``conveyor bench serve-compare``: continuous vs static vs none scheduling, over HTTP.

The same workload against servers started with ``--scheduler continuous``, ``static``
and ``none``, one after another, on the same model and flags; prints the figures side by
side, with each mode's throughput and TTFT against continuous batching. A benchmark, not
a test: it prints what it measured and never fails on a time.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from conveyor.bench.procs import conveyor_serve
from conveyor.bench.serve.command import add_load_args, settings_from_args
from conveyor.bench.serve.load import run
from conveyor.bench.serve.report import format_table, write_json
from conveyor.bench.serve.workload import WorkloadSettings, add_workload_args
from conveyor.runtime.engine.settings import SCHEDULER_MODES

# Small enough that `none` (one request at a time) finishes in minutes on a CPU.
DEFAULT_WORKLOAD = WorkloadSettings(
    num_requests=64, input_len_min=16, input_len_max=64, output_len_mean=32, output_len_max=96
)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="conveyor bench serve-compare",
        description=(
            "Continuous vs static vs none scheduling over HTTP: the same workload against "
            "servers started with --scheduler continuous, static and none, one after another; "
            "prints them side by side."
        ),
    )
    g = parser.add_argument_group("servers")
    g.add_argument(
        "--modes",
        default=",".join(SCHEDULER_MODES),
        help="schedulers to compare, in order (default continuous,static,none)",
    )
    g.add_argument(
        "--model", default="conveyor-tiny", help="model every server loads (default conveyor-tiny)"
    )
    g.add_argument(
        "--max-running-requests", type=int, default=16, help="running batch cap (default 16)"
    )
    g.add_argument(
        "--max-total-tokens", type=int, default=16384, help="KV-cache tokens (default 16384)"
    )
    g.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra flag for every server, e.g. --server-arg=--num-threads=2 (repeatable)",
    )
    parser.add_argument("--json", default=None, help="write every mode's summary as JSON here")
    add_load_args(parser, concurrency=DEFAULT_WORKLOAD.num_requests, model=False)
    add_workload_args(parser, DEFAULT_WORKLOAD)
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in SCHEDULER_MODES:
            parser.error(f"--modes: {m!r} is not one of {', '.join(SCHEDULER_MODES)}")

    server_args = [
        "--model",
        args.model,
        "--max-running-requests",
        str(args.max_running_requests),
        "--max-total-tokens",
        str(args.max_total_tokens),
        *args.server_arg,
    ]
    summaries: dict[str, dict[str, Any]] = {}
    for mode in modes:
        print(
            f"== --scheduler {mode}: starting `conveyor serve {' '.join(server_args)}`",
            file=sys.stderr,
        )
        with conveyor_serve([*server_args, "--scheduler", mode]) as server:
            settings = settings_from_args(args, server.url)
            summaries[mode] = asyncio.run(run(settings))
        print(format_table(summaries[mode]), file=sys.stderr)
    print(compare_table(summaries))
    if args.json:
        write_json(
            args.json,
            {"server_args": server_args, "modes": summaries, "continuous_vs": _ratios(summaries)},
        )
    return 0


def _ratios(summaries: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    base = summaries.get("continuous")
    if base is None:
        return {}
    out = {}
    for mode, s in summaries.items():
        out[mode] = {
            "output_throughput": _div(s["output_throughput"], base["output_throughput"]),
            "ttft_p50": _div(s["ttft_p50"], base["ttft_p50"]),
        }
    return out


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare_table(summaries: dict[str, dict[str, Any]]) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1000 * x:.0f}"

    def ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    ratios = _ratios(summaries)
    cols = list(summaries)
    rows: list[tuple[str, list[str]]] = [
        ("completed", [f"{s['completed']}/{s['num_requests']}" for s in summaries.values()]),
        ("errors", [str(sum(s["errors"].values())) for s in summaries.values()]),
        ("duration (s)", [f"{s['duration_s']:.1f}" for s in summaries.values()]),
        ("requests/s", [f"{s['request_throughput']:.2f}" for s in summaries.values()]),
        ("output tok/s", [f"{s['output_throughput']:.1f}" for s in summaries.values()]),
        (
            "throughput / continuous",
            [ratio(ratios.get(m, {}).get("output_throughput")) for m in cols],
        ),
        ("TTFT p50 (ms)", [ms(s["ttft_p50"]) for s in summaries.values()]),
        ("TTFT p95 (ms)", [ms(s["ttft_p95"]) for s in summaries.values()]),
        ("TTFT p50 / continuous", [ratio(ratios.get(m, {}).get("ttft_p50")) for m in cols]),
        ("TPOT p50 (ms)", [ms(s["tpot_p50"]) for s in summaries.values()]),
        ("TPOT p95 (ms)", [ms(s["tpot_p95"]) for s in summaries.values()]),
        ("ITL p50 (ms)", [ms(s["itl_p50"]) for s in summaries.values()]),
        ("E2E p50 (ms)", [ms(s["e2e_p50"]) for s in summaries.values()]),
        ("E2E p99 (ms)", [ms(s["e2e_p99"]) for s in summaries.values()]),
    ]
    servers = [s.get("server") or {} for s in summaries.values()]
    rows += [
        ("engine step mean (ms)", [_f(v.get("step_ms_mean")) for v in servers]),
        ("tokenize / request (ms)", [_f(v.get("tokenize_ms_mean"), 3) for v in servers]),
        ("detokenize / step (ms)", [_f(v.get("detokenize_ms_per_step"), 3) for v in servers]),
        ("detokenize / step time", [_pct(v.get("detokenize_share_of_step")) for v in servers]),
        ("preemptions", [str(v.get("preemptions", "-")) for v in servers]),
    ]
    width = max(len(r[0]) for r in rows)
    colw = max(12, *(len(c) for c in cols), *(len(x) for _, vals in rows for x in vals))
    lines = [f"{'':<{width}}  " + "  ".join(f"{c:>{colw}}" for c in cols)]
    lines += [
        f"{label:<{width}}  " + "  ".join(f"{v:>{colw}}" for v in vals) for label, vals in rows
    ]
    return "\n".join(lines)


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"
