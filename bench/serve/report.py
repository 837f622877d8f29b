"""The output of ``conveyor bench serve``: the table, the JSON and the plot."""

from __future__ import annotations

import json
import math
from typing import Any

from conveyor.bench.serve.summary import RequestResult


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.1f}"


def format_table(s: dict[str, Any]) -> str:
    rows = [
        ("requests completed", f"{s['completed']}/{s['num_requests']}"),
        ("errors", ", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "none"),
        ("duration (s)", f"{s['duration_s']:.2f}"),
        ("request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("input throughput (tok/s)", f"{s['input_throughput']:.1f}"),
        ("output throughput (tok/s)", f"{s['output_throughput']:.1f}"),
    ]
    for key, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E")):
        rows.append(
            (
                f"{label} mean/p50/p95/p99 (ms)",
                " / ".join(_ms(s[f"{key}_{p}"]) for p in ("mean", "p50", "p95", "p99")),
            )
        )
    server = s.get("server")
    if server:
        hit = server["prefix_cache_hit_rate"]
        rows.append(("prefix-cache hit rate", "-" if hit is None else f"{100 * hit:.1f}%"))
        rows.append(("preemptions", str(server["preemptions"])))
        rows.append(("engine step mean (ms)", _num(server["step_ms_mean"])))
        rows.append(("tokenize per request (ms)", _num(server["tokenize_ms_mean"], 3)))
        rows.append(("detokenize per step (ms)", _num(server["detokenize_ms_per_step"], 3)))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def write_json(path: str, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(_public(data), f, indent=2)
        f.write("\n")


def _public(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _public(v) for k, v in data.items() if not k.startswith("_")}
    if isinstance(data, list):
        return [_public(v) for v in data]
    return data


def plot(summary: dict[str, Any], path: str) -> None:
    """Latency distributions and output throughput over time, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results: list[RequestResult] = [r for r in summary["_results"] if r.ok]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    series = [
        ("TTFT (ms)", [1000 * r.ttft for r in results if r.ttft is not None]),
        ("TPOT (ms)", [1000 * t for r in results if (t := r.tpot) is not None]),
        ("ITL (ms)", [1000 * x for r in results for x in r.itls]),
        ("E2E latency (s)", [r.e2e for r in results if r.e2e is not None]),
    ]
    for ax, (title, values) in zip(axes.flat, series, strict=False):
        if values:
            ax.hist(values, bins=50)
        ax.set_title(title)
        ax.set_ylabel("count")
    ax = axes.flat[4]
    times = sorted(t for r in results for t in r.chunk_times)
    if times:
        width = max(summary["duration_s"] / 60, 0.1)
        bins = max(1, math.ceil(times[-1] / width))
        counts = [0] * bins
        for t in times:
            counts[min(int(t / width), bins - 1)] += 1
        ax.plot([width * (i + 0.5) for i in range(bins)], [c / width for c in counts])
    ax.set_title("output chunks/s over time")
    ax.set_xlabel("s")
    ax = axes.flat[5]
    ax.scatter([r.start for r in results], [r.e2e for r in results], s=4)
    ax.set_title("E2E latency (s) by start time")
    ax.set_xlabel("start (s)")
    fig.suptitle(f"conveyor bench serve: {summary['url']} ({summary['completed']} requests)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
