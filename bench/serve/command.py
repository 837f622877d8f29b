"""``conveyor bench serve --url URL``: the command line of the load generator."""

from __future__ import annotations

import argparse
import asyncio

from conveyor.bench.serve.load import BenchSettings, run
from conveyor.bench.serve.report import format_table, plot, write_json
from conveyor.bench.serve.workload import add_workload_args, workload_from_args


def add_load_args(
    parser: argparse.ArgumentParser, *, concurrency: int | None = None, model: bool = True
) -> None:
    d = BenchSettings()
    concurrency = concurrency or d.concurrency
    g = parser.add_argument_group("load")
    g.add_argument(
        "--endpoint",
        choices=["completions", "chat"],
        default=d.endpoint,
        help="completions (token id prompts, exact lengths; default) or chat",
    )
    if model:
        g.add_argument("--model", default=None, help="model name (default: the server's first)")
    g.add_argument(
        "--concurrency",
        type=int,
        default=concurrency,
        help=f"closed loop: requests kept in flight (default {concurrency})",
    )
    g.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="open loop: Poisson arrivals per second (overrides --concurrency)",
    )
    g.add_argument(
        "--max-concurrency", type=int, default=None, help="open loop: cap on requests in flight"
    )
    g.add_argument("--api-key", default=None, help="bearer token for the server")
    g.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (default 0)"
    )
    g.add_argument(
        "--timeout", type=float, default=d.timeout, help="per-request timeout in seconds"
    )
    g.add_argument(
        "--warmup",
        type=int,
        default=d.warmup,
        help=f"short requests sent before the run, not measured (default {d.warmup})",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def settings_from_args(a: argparse.Namespace, url: str) -> BenchSettings:
    return BenchSettings(
        url=url.rstrip("/"),
        endpoint=a.endpoint,
        model=getattr(a, "model", None),
        concurrency=a.concurrency,
        request_rate=a.request_rate,
        max_concurrency=a.max_concurrency,
        api_key=a.api_key,
        temperature=a.temperature,
        timeout=a.timeout,
        progress=not a.no_progress,
        warmup=a.warmup,
        workload=workload_from_args(a),
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="conveyor bench serve",
        description=(
            "An HTTP load generator for a runtime replica or a gateway: closed-loop concurrency "
            "or Poisson arrivals, synthetic workloads; prints a table, writes JSON and a plot."
        ),
    )
    parser.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="base URL of a replica or a gateway (default http://127.0.0.1:8000)",
    )
    parser.add_argument("--json", default=None, help="write the summary as JSON here")
    parser.add_argument(
        "--plot", default=None, help="draw latency distributions and throughput to this PNG"
    )
    add_load_args(parser)
    add_workload_args(parser)
    args = parser.parse_args(argv)
    settings = settings_from_args(args, args.url)
    summary = asyncio.run(run(settings))
    print(format_table(summary))
    if args.json:
        write_json(args.json, summary)
    if args.plot:
        plot(summary, args.plot)
    return 0 if summary["completed"] else 1
