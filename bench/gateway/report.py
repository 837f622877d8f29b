"""The side-by-side summary of ``conveyor bench gateway --peers``: one table, the gateway's
figures over the best peer's, and a PNG."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

Overhead = dict[int, dict[str, dict[str, float | None]]]
Routing = dict[str, dict[str, float]]


@dataclass(frozen=True)
class Row:
    metric: str
    values: dict[str, float | None]
    """Per proxy (``conveyor`` and each peer)."""
    lower_is_better: bool
    fmt: Callable[[float], str]
    target: str = ""


def best_routing(routing: Routing, proxy: str) -> str | None:
    """The label of ``proxy``'s run with the lowest TTFT p50 (its best policy here)."""
    runs = [label for label in routing if label.split(" ", 1)[0] == proxy]
    return min(runs, key=lambda label: routing[label]["ttft_p50"], default=None)


def rows(
    proxies: list[str],
    overhead: Overhead,
    held: dict[str, int],
    routing: Routing,
    grown: Routing | None = None,
) -> list[Row]:
    out: list[Row] = []

    def ms(v: float) -> str:
        return f"{v * 1000:+.2f}"

    for c, figures in overhead.items():
        for kind, what in (("whole", "non-streamed"), ("ttft", "streamed TTFT")):
            for q in (50, 99):
                target = "<= +2 ms, <= 2x peer" if (c >= 200 and q == 99) else ""
                out.append(Row(
                    f"added p{q} ms, {what}, {c} streams",
                    {p: figures.get(p, {}).get(f"{kind}_added_p{q}") for p in proxies},
                    True, ms, target,
                ))  # fmt: skip
    if held:
        out.append(Row("most streams held, 0 errors", {p: float(held.get(p, 0)) for p in proxies},
                       False, lambda v: f"{v:.0f}", ">= 4000"))  # fmt: skip
    if routing:
        # the routing part runs the gateway with one process: its figures go under "conveyor"
        chosen: dict[str, str | None] = {}
        for p in proxies:
            if p == "conveyor":
                chosen[p] = "conveyor prefix-aware" if "conveyor prefix-aware" in routing else None
            else:
                chosen[p] = None if is_conveyor(p) else best_routing(routing, p)

        def pick(key: str) -> dict[str, float | None]:
            return {p: None if chosen[p] is None else routing[str(chosen[p])][key] for p in proxies}

        out += [
            Row("routing: TTFT p50 ms", pick("ttft_p50"), True, lambda v: f"{v * 1000:.0f}",
                "<= 0.8x best peer"),
            Row("routing: TTFT p95 ms", pick("ttft_p95"), True, lambda v: f"{v * 1000:.0f}"),
            Row("routing: req/s", pick("req_s"), False, lambda v: f"{v:.2f}", ">= best peer"),
            Row("routing: prefix hit", pick("hit"), False, lambda v: f"{v:.1%}"),
            Row("routing: max/min requests", pick("spread"), True, lambda v: f"{v:.2f}", "<= 1.5"),
        ]  # fmt: skip
        out.append(Row("routing: policy", {}, True, str, ", ".join(
            f"{p}: {str(chosen[p]).split(' ', 1)[-1]}" for p in proxies if chosen[p]
        )))  # fmt: skip
    if grown:
        out += grow_rows(proxies, routing, grown)
    return out


def grow_rows(proxies: list[str], routing: Routing, grown: Routing) -> list[Row]:
    """The grow phase under the policy each proxy's routing row shows (without a routing
    phase: the gateway's prefix-aware, a router's cache_aware)."""
    chosen: dict[str, str | None] = {}
    for p in proxies:
        if p == "conveyor":
            label: str | None = "conveyor prefix-aware"
        elif is_conveyor(p):
            label = None
        else:
            label = best_routing(routing, p) or f"{p} cache_aware"
        chosen[p] = label if label in grown else None

    def pick(key: str) -> dict[str, float | None]:
        return {p: None if chosen[p] is None else grown[str(chosen[p])][key] for p in proxies}

    return [
        Row("grow: prefix hit before join", pick("hit_before"), False, lambda v: f"{v:.1%}"),
        Row("grow: prefix hit after join", pick("hit_after"), False, lambda v: f"{v:.1%}"),
        Row("grow: new replica's share after", pick("new_share"), False, lambda v: f"{v:.1%}",
            "fair: 1/replicas"),
    ]  # fmt: skip


def is_conveyor(proxy: str) -> bool:
    """``conveyor`` (one process) and ``conveyor-xN`` (``--workers N``) are the gateway."""
    return proxy == "conveyor" or proxy.startswith("conveyor-x")


def ratio(row: Row, proxies: list[str], mine_name: str = "conveyor") -> str:
    """``mine_name``'s figure over the best peer's (for an added latency: over the lower
    one's, floored at 0.1 ms so a peer at noise level does not make the ratio infinite)."""
    mine = row.values.get(mine_name)
    peers = [v for p, v in row.values.items() if not is_conveyor(p) and v is not None]
    if mine is None or not peers:
        return ""
    best = min(peers) if row.lower_is_better else max(peers)
    if row.metric.startswith("added"):
        return f"{max(mine, 1e-4) / max(best, 1e-4):.2f}x"
    return f"{mine / best:.2f}x" if best else ""


def summary(
    proxies: list[str],
    overhead: Overhead,
    held: dict[str, int],
    routing: Routing,
    grown: Routing | None = None,
) -> str:
    mine = [p for p in proxies if is_conveyor(p)]
    body = []
    for row in rows(proxies, overhead, held, routing, grown):
        if not row.values:
            body.append([row.metric, *([""] * len(proxies)), *([""] * len(mine)), row.target])
            continue
        cells = ["-" if row.values.get(p) is None else row.fmt(float(row.values[p] or 0.0))
                 for p in proxies]  # fmt: skip
        body.append([row.metric, *cells, *(ratio(row, proxies, m) for m in mine), row.target])
    headers = ["metric", *proxies, *(f"{m} / best peer" for m in mine), "target"]
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(headers)]
    text_columns = (0, len(headers) - 1)

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i in text_columns else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    head = line(headers)
    return "\n".join([head, "-" * len(head), *(line(r) for r in body)])


def plot(
    path: Path, proxies: list[str], overhead: Overhead, held: dict[str, int], routing: Routing
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sum(bool(x) for x in (overhead, held, routing))
    if not panels:
        return
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5), squeeze=False)
    ax_iter = iter(axes[0])
    if overhead:
        ax = next(ax_iter)
        groups = [(c, k, w) for c in overhead for k, w in (("whole", "whole"), ("ttft", "TTFT"))]
        width = 0.8 / len(proxies)
        for i, p in enumerate(proxies):
            values = [1000 * float(overhead[c].get(p, {}).get(f"{k}_added_p99") or 0.0)
                      for c, k, _ in groups]  # fmt: skip
            ax.bar([g + i * width for g in range(len(groups))], values, width, label=p)
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
        ax.set_xticklabels([f"{w}\n{c} streams" for c, _, w in groups])
        ax.set_ylabel("added p99 latency over direct (ms)")
        ax.set_title("proxy overhead (stub replica)")
        ax.legend()
    if held:
        ax = next(ax_iter)
        ax.bar(list(held), list(held.values()), color="tab:green")
        ax.tick_params(axis="x", labelrotation=20)
        ax.set_ylabel("most concurrent streams held, 0 errors")
        ax.set_title("concurrency")
    if routing:
        ax = next(ax_iter)
        labels = list(routing)
        ax.barh(labels, [1000 * routing[x]["ttft_p95"] for x in labels], color="tab:gray",
                label="TTFT p95")  # fmt: skip
        ax.barh(labels, [1000 * routing[x]["ttft_p50"] for x in labels], color="tab:blue",
                label="TTFT p50")  # fmt: skip
        ax.set_xlabel("ms (shared-prefix multi-turn chat, runtime replicas)")
        ax.set_title("routing")
        ax.invert_yaxis()
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
