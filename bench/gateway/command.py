"""``conveyor bench gateway``: routing policies side by side, and the gateway's own overhead.

Part ``routing``: several runtime replicas (built-in model, small KV caches) behind one
gateway per policy, a multi-turn shared-prefix chat workload (every user has a shared
system prompt, a long private document in the first message, and a growing conversation).
The working set of all conversations exceeds one replica's KV cache but fits in all of
them, which is when routing decides the cache hit rate. Each policy gets fresh text, so
no policy inherits another's cache. Prints TTFT p50/p95, throughput, the prefix-cache hit
rate from the replicas' /metrics and the spread of requests over replicas.

Part ``overhead``: a minimal streaming server (``stub``), reached directly and
through the gateway at the same concurrency: added TTFT and end-to-end latency; then
N streams held open at once through the gateway, for growing N, counting errors.

Figures only; nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import sys

from conveyor.bench.gateway.overhead import bench_overhead
from conveyor.bench.gateway.routing import bench_routing
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
    if s.part not in ("routing", "overhead", "all"):
        print("conveyor bench gateway: --part must be routing, overhead or all", file=sys.stderr)
        return 2
    if s.part in ("routing", "all"):
        bench_routing(s)
    if s.part in ("overhead", "all"):
        bench_overhead(s)
    return 0
