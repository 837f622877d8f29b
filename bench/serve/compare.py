"""``conveyor bench serve-compare``: scheduling modes and queue policies, over HTTP.

The same workload against servers started with each ``--scheduler`` mode (continuous,
static, none) and each ``--scheduling-policy`` asked for (fcfs by default; priority, lpm),
one after another, on the same model and flags; prints the figures side by side, with each
one's throughput and TTFT against the first. A benchmark, not a test: it prints what it
measured and never fails on a time.

    conveyor bench serve-compare                       # continuous vs static vs none
    conveyor bench serve-compare --modes continuous --policies fcfs,lpm \
        --shared-prefix-len 384 --num-prefix-groups 12  # what lpm does under cache pressure
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
from conveyor.runtime.engine.settings import SCHEDULER_MODES, SCHEDULING_POLICIES

# Small enough that `none` (one request at a time) finishes in minutes on a CPU.
DEFAULT_WORKLOAD = WorkloadSettings(
    num_requests=64, input_len_min=16, input_len_max=64, output_len_mean=32, output_len_max=96
)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="conveyor bench serve-compare",
        description=(
            "Scheduling modes and queue policies over HTTP: the same workload against servers "
            "started with each --scheduler mode and --scheduling-policy asked for, one after "
            "another; prints them side by side, with ratios to the first."
        ),
    )
    g = parser.add_argument_group("servers")
    g.add_argument(
        "--modes",
        default=",".join(SCHEDULER_MODES),
        help="schedulers to compare, in order (default continuous,static,none)",
    )
    g.add_argument(
        "--policies",
        default="fcfs",
        help=f"waiting-queue policies to compare under each mode, in order: "
        f"{', '.join(SCHEDULING_POLICIES)} (default fcfs)",
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
    modes = list(dict.fromkeys(m.strip() for m in args.modes.split(",") if m.strip()))
    for m in modes:
        if m not in SCHEDULER_MODES:
            parser.error(f"--modes: {m!r} is not one of {', '.join(SCHEDULER_MODES)}")
    policies = list(dict.fromkeys(p.strip() for p in args.policies.split(",") if p.strip()))
    for p in policies:
        if p not in SCHEDULING_POLICIES:
            parser.error(f"--policies: {p!r} is not one of {', '.join(SCHEDULING_POLICIES)}")
    if not modes or not policies:
        parser.error("--modes and --policies each need at least one name")

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
    for label, flags in variants(modes, policies):
        print(
            f"== {label}: starting `conveyor serve {' '.join([*server_args, *flags])}`",
            file=sys.stderr,
        )
        with conveyor_serve([*server_args, *flags]) as server:
            settings = settings_from_args(args, server.url)
            summaries[label] = asyncio.run(run(settings))
        print(format_table(summaries[label]), file=sys.stderr)
    print(compare_table(summaries))
    if args.json:
        first = next(iter(summaries))
        write_json(
            args.json,
            {"server_args": server_args, "runs": summaries, f"vs_{first}": _ratios(summaries)},
        )
    return 0


def variants(modes: list[str], policies: list[str]) -> list[tuple[str, list[str]]]:
    """(label, server flags) for every mode and policy; a label names only what varies."""
    out = []
    for mode in modes:
        for policy in policies:
            named = [mode] if len(modes) > 1 or len(policies) == 1 else []
            named += [policy] if len(policies) > 1 else []
            out.append(("/".join(named), ["--scheduler", mode, "--scheduling-policy", policy]))
    return out


def _ratios(summaries: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Each run's throughput and TTFT p50 over the first run's."""
    base = next(iter(summaries.values()), None)
    if base is None:
        return {}
    out = {}
    for label, s in summaries.items():
        out[label] = {
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
    first = cols[0]
    rows: list[tuple[str, list[str]]] = [
        ("completed", [f"{s['completed']}/{s['num_requests']}" for s in summaries.values()]),
        ("errors", [str(sum(s["errors"].values())) for s in summaries.values()]),
        ("duration (s)", [f"{s['duration_s']:.1f}" for s in summaries.values()]),
        ("requests/s", [f"{s['request_throughput']:.2f}" for s in summaries.values()]),
        ("output tok/s", [f"{s['output_throughput']:.1f}" for s in summaries.values()]),
        (
            f"throughput / {first}",
            [ratio(ratios.get(m, {}).get("output_throughput")) for m in cols],
        ),
        ("TTFT p50 (ms)", [ms(s["ttft_p50"]) for s in summaries.values()]),
        ("TTFT p95 (ms)", [ms(s["ttft_p95"]) for s in summaries.values()]),
        (f"TTFT p50 / {first}", [ratio(ratios.get(m, {}).get("ttft_p50")) for m in cols]),
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
        ("prefix-cache hit rate", [_pct(v.get("prefix_cache_hit_rate"), 1) for v in servers]),
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


def _pct(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"
