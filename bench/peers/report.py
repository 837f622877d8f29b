"""The figures of ``conveyor bench peer``: medians over rounds, ratios, the table, the PNG."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

METRICS = ("output_tok_s", "ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms", "tpot_p95_ms",
           "peak_rss_mib", "startup_s")  # fmt: skip


def summarize(runs: list[dict[str, Any]], servers: list[str], clients: list[str]) -> dict:
    """Median over rounds per (client, server), and Conveyor / vLLM per client."""
    out: dict[str, Any] = {}
    for client in clients:
        per: dict[str, dict[str, float | None]] = {}
        for server in servers:
            rows = [r for r in runs if r["client"] == client and r["server"] == server]
            per[server] = {
                m: statistics.median(v) if (v := [r[m] for r in rows if r.get(m) is not None])
                else None
                for m in METRICS
            }  # fmt: skip
        if "conveyor" in per and "vllm" in per:
            per["ratio"] = {
                m: (a / b if (a := per["conveyor"][m]) is not None and (b := per["vllm"][m])
                    else None)
                for m in METRICS
            }  # fmt: skip
        out[client] = per
    return out


def format_table(runs, summary, machine, args, path: Path) -> str:
    labels = {
        "output_tok_s": ("output tok/s", "{:.1f}"), "ttft_p50_ms": ("TTFT p50 ms", "{:.0f}"),
        "ttft_p95_ms": ("TTFT p95 ms", "{:.0f}"), "tpot_p50_ms": ("TPOT p50 ms", "{:.1f}"),
        "tpot_p95_ms": ("TPOT p95 ms", "{:.1f}"), "peak_rss_mib": ("peak RSS MiB", "{:.0f}"),
        "startup_s": ("start-up s", "{:.1f}"),
    }  # fmt: skip
    lines = [
        f"conveyor bench peer: {path.name}, {args.dtype}, max running {args.max_running_requests}, "
        f"{args.num_prompts} prompts {args.input_len} in / {args.output_len} out, concurrency "
        f"{args.max_concurrency}, {args.rounds} rounds alternating",
        f"machine: {machine['cores']:.0f} cores, load average (1 min) mean "
        f"{machine['load1_mean']:.2f}, max {machine['load1_max']:.2f}",
        "",
        f"{'round':<6}{'server':<10}{'client':<16}"
        + "".join(f"{labels[m][0]:>14}" for m in METRICS),
    ]
    for r in runs:
        cells = "".join(
            f"{(labels[m][1].format(r[m]) if r.get(m) is not None else '-'):>14}" for m in METRICS
        )
        lines.append(f"{r['round']:<6}{r['server']:<10}{r['client']:<16}{cells}")
    lines.append("")
    lines.append("median over rounds; ratio = conveyor / vllm (tok/s: higher is better; "
                 "TTFT, TPOT, RSS, start-up: lower is better)")  # fmt: skip
    for client, per in summary.items():
        for server, figures in per.items():
            fmt = "{:.2f}x" if server == "ratio" else None
            cells = "".join(
                f"{((fmt or labels[m][1]).format(v) if (v := figures[m]) is not None else '-'):>14}"
                for m in METRICS
            )
            lines.append(f"{'':<6}{server:<10}{client:<16}{cells}")
    return "\n".join(lines)


def plot(summary: dict, servers: list[str], clients: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = ("output_tok_s", "ttft_p50_ms", "tpot_p50_ms", "peak_rss_mib")
    titles = ("output tok/s (higher is better)", "TTFT p50 ms", "TPOT p50 ms", "peak RSS MiB")
    fig, axes = plt.subplots(1, len(shown), figsize=(4 * len(shown), 3.6))
    width = 0.8 / max(1, len(servers))
    for ax, metric, title in zip(axes, shown, titles, strict=True):
        for i, server in enumerate(servers):
            values = [summary[c][server][metric] or 0 for c in clients]
            xs = [j + i * width for j in range(len(clients))]
            ax.bar(xs, values, width, label=server)
        ax.set_xticks([j + width * (len(servers) - 1) / 2 for j in range(len(clients))])
        ax.set_xticklabels([f"{c} client" for c in clients])
        ax.set_title(title, fontsize=10)
    axes[0].legend(loc="lower left", fontsize=8, framealpha=0.9)
    fig.suptitle("conveyor bench peer: Conveyor vs vLLM for CPU (median over rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
