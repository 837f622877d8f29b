"""``conveyor dashboard render``: draw each dashboard's panels as Grafana would, into a PNG.

The same JSON Grafana imports, the same queries with the same substitutions
(``conveyor.observability.grafana``), evaluated with Prometheus ``query_range`` and drawn
with matplotlib on the dashboard's own grid, so someone without Grafana can look.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conveyor.observability import dashboards, grafana
from conveyor.observability.prometheus import PrometheusAPI

ROW_HEIGHT_IN = 0.42
"""Inches per Grafana grid unit of height (a panel of height 8 is about 3.4 inches)."""
WIDTH_IN = 22.0


@dataclass(frozen=True)
class RenderedPanel:
    title: str
    series: int
    """Series drawn (0: the panel shows "No data")."""


def _format_axis(ax: Any, unit: str) -> None:
    from matplotlib.ticker import FuncFormatter, PercentFormatter

    if unit == "percentunit":
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    elif unit == "s":

        def seconds(value: float, _pos: int) -> str:
            if value == 0:
                return "0"
            if abs(value) < 1:
                return f"{value * 1000:.0f} ms"
            return f"{value:.1f} s"

        ax.yaxis.set_major_formatter(FuncFormatter(seconds))
    suffix = {"reqps": "req/s", "ops": "/s"}.get(unit)
    if suffix:
        ax.set_ylabel(suffix, fontsize=7)


def _draw_panel(
    ax: Any,
    item: dict[str, Any],
    api: PrometheusAPI,
    values: dict[str, str],
    start: float,
    end: float,
    scrape_interval_s: float,
) -> int:
    import matplotlib.dates as mdates

    step = grafana.interval_s(start, end, scrape_interval_s)
    defaults = item.get("fieldConfig", {}).get("defaults", {})
    unit = defaults.get("unit", "")
    drawn = 0
    for query in grafana.panel_queries({"panels": [item]}):
        expr = query.resolved(values, start, end, scrape_interval_s)
        dashed = " target" in query.legend
        for series in api.query_range(expr, start, end, step):
            points = [(float(t), float(v)) for t, v in series["values"]]
            points = [(t, v) for t, v in points if math.isfinite(v)]
            if not points:
                continue
            times = [dt.datetime.fromtimestamp(t) for t, _ in points]
            ax.plot(
                times,
                [v for _, v in points],
                linewidth=1.6 if dashed else 1.1,
                linestyle="--" if dashed else "-",
                label=grafana.legend(query.legend, series["metric"]) or expr[:40],
            )
            drawn += 1
    steps = defaults.get("thresholds", {}).get("steps", [])
    if defaults.get("custom", {}).get("thresholdsStyle", {}).get("mode") in ("dashed", "line"):
        for step_ in steps:
            if step_.get("value") is not None:
                ax.axhline(step_["value"], color=step_["color"], linestyle=":", linewidth=1)
    ax.set_title(item["title"], fontsize=9, loc="left")
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    ax.set_xlim(dt.datetime.fromtimestamp(start), dt.datetime.fromtimestamp(end))
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
    if defaults.get("min") is not None:
        ax.set_ylim(bottom=defaults["min"])
    if defaults.get("max") is not None:
        ax.set_ylim(top=defaults["max"] * 1.05)
    _format_axis(ax, unit)
    if drawn:
        ax.legend(fontsize=6, loc="upper left", ncol=2 if drawn > 6 else 1, framealpha=0.6)
    else:
        ax.text(0.5, 0.5, "No data", ha="center", va="center", transform=ax.transAxes, color="grey")
    return drawn


def render_dashboard(
    model: dict[str, Any],
    api: PrometheusAPI,
    start: float,
    end: float,
    out: Path,
    *,
    scrape_interval_s: float = 15.0,
) -> list[RenderedPanel]:
    """Draw one dashboard into ``out`` (PNG); what each panel showed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.gridspec import GridSpec

    values, _ = grafana.resolve_variables(model, api, start, end)
    items = model["panels"]
    height = max(i["gridPos"]["y"] + i["gridPos"]["h"] for i in items)
    fig_height = height * ROW_HEIGHT_IN + 0.8
    fig = plt.figure(figsize=(WIDTH_IN, fig_height))
    grid = GridSpec(
        height, 24, figure=fig, hspace=1.6, wspace=1.2,
        top=1 - 0.7 / fig_height, bottom=0.2 / fig_height, left=0.03, right=0.99,
    )  # fmt: skip
    window = f"{dt.datetime.fromtimestamp(start):%Y-%m-%d %H:%M:%S} to {dt.datetime.fromtimestamp(end):%H:%M:%S}"
    fig.suptitle(
        f"{model['title']}    ({window})", fontsize=13, x=0.01, y=1 - 0.15 / fig_height, ha="left"
    )
    rendered = []
    for item in items:
        pos = item["gridPos"]
        if item.get("type") == "row":
            ax = fig.add_subplot(grid[pos["y"], :])
            ax.axis("off")
            ax.text(0, 0.0, item["title"], fontsize=11, fontweight="bold", transform=ax.transAxes)
            continue
        ax = fig.add_subplot(
            grid[pos["y"] + 1 : pos["y"] + pos["h"], pos["x"] : pos["x"] + pos["w"]]
        )
        drawn = _draw_panel(ax, item, api, values, start, end, scrape_interval_s)
        rendered.append(RenderedPanel(item["title"], drawn))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return rendered


def render_all(
    api: PrometheusAPI,
    start: float,
    end: float,
    out_dir: Path,
    *,
    scrape_interval_s: float = 15.0,
) -> dict[Path, list[RenderedPanel]]:
    """Every dashboard into ``out_dir/<stem>.png``."""
    results = {}
    for name, text in dashboards.all_json().items():
        path = out_dir / name.replace(".json", ".png")
        results[path] = render_dashboard(
            json.loads(text), api, start, end, path, scrape_interval_s=scrape_interval_s
        )
    return results
