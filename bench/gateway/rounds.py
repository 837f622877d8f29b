"""The routing part's runs in rounds: each round runs every proxy once on fresh text, in an
order rotated each round, and the figures are the median over rounds with their range.

On a machine shared with other work, load that comes and goes lands on whichever proxy runs
then; with the proxies one after another, one proxy's whole run could fall in a busy minute
and another's in a quiet one. Interleaved, every proxy meets the busy minutes alike, and a
ratio taken within one round compares runs minutes apart.

Besides the client's figures, each run says where a request's TTFT went: the replicas' own
TTFT and queue time (from their /metrics, so they count the same whichever proxy sent the
requests), the client's TTFT over the replicas' (the proxy's hops, and for the gateway its
own TTFT metric: arrival at the gateway to first token sent), the turns that missed their
conversation's cache (from each stream's usage event), and the proxy's CPU seconds.
"""

from __future__ import annotations

import asyncio
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

from conveyor.bench.gateway.settings import BenchSettings
from conveyor.bench.gateway.table import table
from conveyor.bench.gateway.workload import (
    all_counters,
    hit_rate,
    missed_turns,
    moved_turns,
    replica_means,
    requests_each,
    run_workload,
)
from conveyor.bench.stats import percentile
from conveyor.gateway.metrics import TIME_TO_FIRST_TOKEN as GATEWAY_TTFT

if TYPE_CHECKING:
    from conveyor.bench.gateway.routing import RoutingRun

Figures = dict[str, float]
T = TypeVar("T")


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load_average() -> float:
    """The machine's 1-minute load average."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def gateway_ttft_mean(url: str) -> float | None:
    """The gateway's own mean TTFT (arrival to first token sent), from its /metrics."""
    totals = {"_sum": 0.0, "_count": 0.0}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            for suffix in totals:
                if sample.name == GATEWAY_TTFT + suffix:
                    totals[suffix] += sample.value
    return totals["_sum"] / totals["_count"] if totals["_count"] else None


def one_run(run: RoutingRun, s: BenchSettings, urls: list[str], salt: str) -> Figures:
    """``run``'s proxy in front of ``urls`` for one pass of the workload: its figures."""
    proxy = run.start(urls)
    try:
        before = all_counters(urls)
        cpu = cpu_seconds(proxy.pid)
        turns, wall = asyncio.run(run_workload(proxy.url, s, salt=salt))
        cpu = cpu_seconds(proxy.pid) - cpu
        after = all_counters(urls)
        own = gateway_ttft_mean(proxy.url) if run.proxy == "conveyor" else None
    finally:
        proxy.stop()
    counts = requests_each(before, after)
    ttfts = [t.ttft for t in turns]
    replica_ttft, replica_queue = replica_means(before, after)
    missed, known = missed_turns(turns)
    moved = moved_turns(turns)
    client_ttft = sum(ttfts) / len(ttfts)
    return {
        "ttft_p50": percentile(ttfts, 50) or 0.0,
        "ttft_p95": percentile(ttfts, 95) or 0.0,
        "req_s": len(turns) / wall,
        "tok_s": len(turns) * s.max_tokens / wall,
        "hit": hit_rate(before, after),
        "max_req": max(counts),
        "min_req": min(counts),
        "spread": max(counts) / max(1.0, min(counts)),
        "ttft_mean": client_ttft,
        "gateway_ttft": float("nan") if own is None else own,
        "replica_ttft": replica_ttft,
        "replica_queue": replica_queue,
        "hops": client_ttft - replica_ttft,
        "missed": missed,
        "known": known,
        "moved": float("nan") if moved is None else moved,
        "cpu_ms_req": 1000 * cpu / len(turns),
        "load": load_average(),
        "wall": wall,
    }


def rotated(items: list[T], r: int) -> list[T]:
    """``items`` in round ``r``'s order: each round starts one further along."""
    shift = r % len(items)
    return items[shift:] + items[:shift]


def median_figures(rounds: list[Figures]) -> Figures:
    """Each figure's median over rounds, and ``<key>_lo``/``<key>_hi`` its range."""
    out: Figures = {}
    for key in rounds[0]:
        values = [r[key] for r in rounds]
        out[key] = statistics.median(values)
        out[key + "_lo"], out[key + "_hi"] = min(values), max(values)
    return out


def interleaved(
    s: BenchSettings, runs: list[RoutingRun], urls: list[str]
) -> tuple[dict[str, Figures], dict[str, list[Figures]]]:
    """Every run once per round, the order rotated each round: (median figures by label,
    each round's figures by label)."""
    per_round: dict[str, list[Figures]] = {run.label: [] for run in runs}
    # fresh replicas run their first batches slower (allocations, first shapes): whichever
    # proxy ran first in round 1 paid for it, so one pass goes through the first, uncounted
    warm = one_run(runs[0], s, urls, salt="warm-up")
    print(f"  warm-up through {runs[0].label} (not counted): {warm['wall']:.1f}s, TTFT p50 "
          f"{warm['ttft_p50'] * 1000:.0f} ms", flush=True)  # fmt: skip
    for r in range(s.rounds):
        for run in rotated(runs, r):
            f = one_run(run, s, urls, salt=f"{run.label} round {r}")
            per_round[run.label].append(f)
            print(f"  round {r + 1}/{s.rounds}: {run.label}: {f['wall']:.1f}s, TTFT p50 "
                  f"{f['ttft_p50'] * 1000:.0f} ms, {f['req_s']:.2f} req/s, load average "
                  f"{f['load']:.1f}", flush=True)  # fmt: skip
    return {label: median_figures(rs) for label, rs in per_round.items()}, per_round


def _ranged(f: Figures, key: str, fmt: Callable[[float], str]) -> str:
    return f"{fmt(f[key])} [{fmt(f[key + '_lo'])}-{fmt(f[key + '_hi'])}]"


def _ms(value: float) -> str:
    return "-" if value != value else f"{value * 1000:.0f}"


def print_tables(figures: dict[str, Figures], rounds: int) -> None:
    """The routing table (median [range] over rounds) and where TTFT went."""
    rows = []
    for label, f in figures.items():
        rows.append([
            label, _ranged(f, "ttft_p50", _ms), _ranged(f, "ttft_p95", _ms),
            _ranged(f, "req_s", lambda v: f"{v:.2f}"), f"{f['tok_s']:.1f}", f"{f['hit']:.1%}",
            f"{f['max_req']:.0f}/{f['min_req']:.0f}", f"{f['spread']:.2f}",
            f"{f['load_lo']:.1f}-{f['load_hi']:.1f}",
        ])  # fmt: skip
    print(f"\nmedian [min-max] over {rounds} rounds:")
    print(table(
        ["proxy policy", "TTFT p50 ms", "TTFT p95 ms", "req/s", "out tok/s", "prefix hit",
         "max/min req", "ratio", "load avg"],
        rows,
    ))  # fmt: skip
    rows = [[
        label, _ms(f["ttft_mean"]), _ms(f["gateway_ttft"]), _ms(f["replica_ttft"]),
        _ms(f["replica_queue"]), _ms(f["hops"]), f"{f['missed']:.0f} of {f['known']:.0f}",
        "-" if f["moved"] != f["moved"] else f"{f['moved']:.0f}", f"{f['cpu_ms_req']:.1f}",
    ] for label, f in figures.items()]  # fmt: skip
    print("\nwhere TTFT goes (means in ms, median over rounds): the client's; the gateway's own"
          "\n(arrival to first token sent); the replicas' own and their queue time; the client's"
          "\nover the replicas' (the proxy's hops); turns after the first that found under half"
          "\nof the previous turn's prompt cached; turns the gateway sent to another replica"
          "\nthan the previous one; the proxy's CPU per request:")  # fmt: skip
    print(table(
        ["proxy policy", "client TTFT", "gateway TTFT", "replica TTFT", "replica queue",
         "client-replica", "missed turns", "moved", "proxy CPU ms/req"],
        rows,
    ))  # fmt: skip


def ratio_per_round(
    per_round: dict[str, list[Figures]], mine: str, peers: list[str], key: str, lower: bool
) -> list[float]:
    """``mine``'s figure over the best peer's within each round."""
    out = []
    for r, f in enumerate(per_round[mine]):
        values = [per_round[p][r][key] for p in peers]
        best = min(values) if lower else max(values)
        if best:
            out.append(f[key] / best)
    return out
