"""``conveyor bench gateway``: the gateway's routing policies and its own overhead, side by
side with the Rust routers users would put in front of vLLM or SGLang instead (``--peers
vllm-router,sglang-router``: installed pinned into cached environments, ``routers.py``).

Part ``overhead`` (a stub replica, no model, so the proxy is what is measured): one stub
reached directly and through each proxy. The added latency: probes one at a time
(non-streamed, and streamed: time to first chunk) while 16, then 200 streams stay open
on the same path, p50/p99 minus the direct path's; then the most concurrent streams each
path holds with no error, ramping up to 4,000 and more (the file-descriptor limit is
raised to its hard limit first, and printed with what it bounds).

Part ``routing`` (runtime replicas, the built-in model, small KV caches): the same
multi-turn shared-prefix chat workload (every user has a shared system prompt, a long
private document in the first message, and a growing conversation) through the gateway's
policies and each router's cache-aware policy (and vllm-router's consistent hashing, on
the ``user`` field). The working set of all conversations exceeds one replica's KV cache
but fits in all of them, which is when routing decides the cache hit rate. Each run gets
fresh text, so none inherits another's cache; the runs are interleaved in ``--rounds``
(``rounds.py``), so load from other work falls on every proxy alike. TTFT p50/p95,
throughput, the prefix-cache hit rate from the replicas' /metrics and the spread of requests
over replicas (also from their /metrics, so it counts the same for every proxy), and where
TTFT went: the replicas' own TTFT and queue time, the proxy's hops, turns that missed their
conversation's cache, the proxy's CPU per request.

Part ``grow`` (``grow.py``): the same workload with one replica fewer, and that replica
added once half the requests have finished (the gateway: a line in its backends file; the
routers: their HTTP API): the prefix-cache hit rate before and after, and the new replica's
share of the requests after it.

Then one table: each figure per proxy and the gateway's over the best peer's, and a PNG.
Figures only; nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from conveyor.bench.gateway import report, routers
from conveyor.bench.gateway.overhead import bench_overhead, gateway_name
from conveyor.bench.gateway.routing import bench_routing, parse_policies
from conveyor.bench.gateway.settings import BenchSettings


def _field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal under it in the class body), by name."""
    import ast
    import inspect
    import itertools
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for field, doc in itertools.pairwise(body):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(field.target, ast.Name)
            and isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant)
        ):
            docs[field.target.id] = " ".join(str(doc.value.value).split()).rstrip(".")
    return docs


def main(argv: list[str]) -> int:
    defaults = BenchSettings()
    parser = argparse.ArgumentParser(
        prog="conveyor bench gateway", description=__doc__.split("\n\n")[0]
    )
    docs = _field_docs(BenchSettings)
    for name, default in vars(defaults).items():
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=type(default),
            default=default,
            help=f"{docs[name]} (default {default})",
        )
    s = BenchSettings(**vars(parser.parse_args(argv)))
    try:
        parts = parse_parts(s.part)
        if "grow" in parts and s.replicas < 2:
            raise ValueError("--part grow needs --replicas 2 or more (the last joins mid-run)")
        peers = routers.parse_peers(s.peers)
        parse_policies(s.policies)
        if s.rounds < 1:
            raise ValueError("--rounds takes a number of rounds, 1 or more")
        concurrency = _numbers(s.overhead_concurrency, "--overhead-concurrency")
        steps = _numbers(s.max_streams, "--max-streams")
        workers = _numbers(s.gateway_workers, "--gateway-workers")
        if min(workers) < 1:
            raise ValueError("--gateway-workers takes numbers of processes, 1 or more")
    except ValueError as exc:
        print(f"conveyor bench gateway: {exc}", file=sys.stderr)
        return 2
    try:
        installed = [(r, routers.ensure(r, lambda m: print(f"[peers] {m}", flush=True)))
                     for r in peers]  # fmt: skip
    except routers.RouterInstallError as exc:
        print(f"conveyor bench gateway: {exc}", file=sys.stderr)
        return 1
    print(raise_open_files_limit())
    overhead: report.Overhead = {}
    held: dict[str, int] = {}
    routing: report.Routing = {}
    grown: report.Routing = {}
    if "overhead" in parts:
        overhead, held = bench_overhead(
            installed, concurrency, s.overhead_requests, steps, workers, s.rounds
        )
    if parts & {"routing", "grow"}:
        with tempfile.TemporaryDirectory(prefix="conveyor-bench-gateway-") as workdir:
            routing, grown = bench_routing(s, installed, parts, Path(workdir))
    gateways = [gateway_name(n) for n in workers] if "overhead" in parts else ["conveyor"]
    proxies = [*gateways, *(r.name for r in peers)]
    print("\n== side by side" + (" (ratios: conveyor / best peer)" if peers else "") + " ==")
    print(report.summary(proxies, overhead, held, routing, grown))
    if s.plot:
        report.plot(Path(s.plot), proxies, overhead, held, routing)
        print(f"\nplot: {s.plot}")
    return 0


PARTS = ("overhead", "routing", "grow")


def parse_parts(spec: str) -> set[str]:
    """``--part``: comma-separated parts, or ``all``; ValueError naming the known ones."""
    parts = {p.strip() for p in spec.split(",") if p.strip()}
    if parts == {"all"}:
        return set(PARTS)
    if not parts or not parts <= set(PARTS):
        raise ValueError(f"--part takes all or a comma-separated list of {', '.join(PARTS)} "
                         f"(got {spec!r})")  # fmt: skip
    return parts


def _numbers(spec: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 0:
        raise ValueError(f"{flag} takes comma-separated whole numbers (got {spec!r})")
    return values


def raise_open_files_limit() -> str:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (the proxies, stubs and
    routers started from here inherit it) and say what bounds the streams held."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    ports = "?"
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        ports = str(int(high) - int(low) + 1)
    except (OSError, ValueError):
        pass
    return (
        f"open files: {now} per process (soft limit raised from {soft}; hard {hard}); a stream "
        f"through a proxy takes 2 of the proxy's (client and replica side), 1 of the client's and "
        f"1 of the stub's, so a proxy holds at most ~{now // 2} streams; loopback ports: {ports} "
        f"ephemeral, 2 per proxied stream"
    )
