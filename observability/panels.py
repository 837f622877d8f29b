"""Pieces shared by the dashboards: the datasource, variables, PromQL helpers and panel builders.

Every panel is a Grafana time series built with ``grafana-foundation-sdk``; the dashboards'
JSON is what Grafana, the chart's ConfigMaps, ``conveyor dashboard render`` and the panel
query check all read.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import prometheus, timeseries
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    DynamicConfigValue,
    Threshold,
    ThresholdsMode,
    VariableOption,
    VariableRefresh,
    VariableSort,
)

DATASOURCE_VARIABLE = "datasource"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
"""Every panel and variable queries the Prometheus the user picks in ``$datasource``."""

ALL = ".*"
"""What a variable's "All" stands for: every value, including ones that appear after the
dashboard was loaded (a new replica), which a list of the values seen at load time would miss."""

QUANTILES = (0.5, 0.95, 0.99)

# Grafana units (https://grafana.com/docs/grafana/latest/panels-visualizations/configure-standard-options/)
SECONDS = "s"
REQUESTS_PER_S = "reqps"
PER_S = "ops"
RATIO = "percentunit"
COUNT = "short"

GRID_WIDTH = 24
PANEL_HEIGHT = 8


def datasource_variable() -> dash.DatasourceVariable:
    return dash.DatasourceVariable(DATASOURCE_VARIABLE).label("Prometheus").type("prometheus")


def query_variable(
    name: str, label: str, metric: str, label_name: str, *, after: str = ""
) -> dash.QueryVariable:
    """A multi-value variable filled from ``label_values(metric{after}, label_name)``, "All" = every value."""
    selector = f"{metric}{{{after}}}" if after else metric
    return (
        dash.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query({"query": f"label_values({selector}, {label_name})", "refId": f"{name}-values"})
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(ALL)
        .current(VariableOption(selected=True, text="All", value="$__all"))
    )


def matchers(*names: str, **fixed: str) -> str:
    """``namespace=~"$namespace", ...`` for the variables ``names``, plus exact matchers ``fixed``."""
    parts = [f'{n}=~"${n}"' for n in names] + [f'{k}="{v}"' for k, v in fixed.items()]
    return ", ".join(parts)


def rate(metric: str, selector: str, by: str) -> str:
    """Per-second rate of a counter, summed by the labels ``by``."""
    return f"sum by ({by}) (rate({metric}{{{selector}}}[$__rate_interval]))"


def events(metric: str, selector: str, by: str) -> str:
    """Events counted by a counter in each interval, summed by ``by``.

    A labelled counter is born at its first event with value 1, so ``increase()`` alone never
    sees that event; the series that did not exist one interval earlier count in full.
    """
    series = f"{metric}{{{selector}}}"
    born = f"({series} unless {series} offset $__rate_interval)"
    return f"sum by ({by}) (increase({series}[$__rate_interval]) or {born})"


def quantile(q: float, histogram: str, selector: str, by: str) -> str:
    """The ``q`` quantile of a histogram (its ``_bucket`` series), grouped by ``by``."""
    buckets = f"rate({histogram}_bucket{{{selector}}}[$__rate_interval])"
    return f"histogram_quantile({q}, sum by ({by}, le) ({buckets}))"


def mean(histogram: str, selector: str, by: str) -> str:
    """The mean of a histogram's observations over the interval, grouped by ``by``."""
    return (
        f"({rate(histogram + '_sum', selector, by)} / {rate(histogram + '_count', selector, by)})"
    )


def target(expr: str, legend: str, ref_id: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref_id).range()


def thresholds(*steps: tuple[float | None, str]) -> dash.ThresholdsConfig:
    return (
        dash.ThresholdsConfig()
        .mode(ThresholdsMode.ABSOLUTE)
        .steps([Threshold(value=value, color=color) for value, color in steps])
    )


def panel(
    title: str,
    description: str,
    queries: list[tuple[str, str]],
    *,
    unit: str,
    width: int = 12,
    minimum: float | None = 0,
    maximum: float | None = None,
    threshold_steps: tuple[tuple[float | None, str], ...] = (),
    stacked: bool = False,
) -> timeseries.Panel:
    """A time series panel of ``queries`` (expression, legend) with its unit and thresholds.

    Thresholds, when given, are drawn as dashed lines so the reader sees the limit the series
    is held against.
    """
    builder = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .height(PANEL_HEIGHT)
        .span(width)
        .line_width(1)
        .fill_opacity(10 if not stacked else 40)
        .show_points(common.VisibilityMode.NEVER)
        .legend(
            common_builders.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.LIST)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
        )
        .tooltip(common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI))
    )
    if minimum is not None:
        builder = builder.min(minimum)
    if maximum is not None:
        builder = builder.max(maximum)
    if stacked:
        builder = builder.stacking(
            common_builders.StackingConfig().mode(common.StackingMode.NORMAL)
        )
    if threshold_steps:
        builder = builder.thresholds(thresholds(*threshold_steps)).thresholds_style(
            common_builders.GraphThresholdsStyleConfig().mode(common.GraphTresholdsStyleMode.DASHED)
        )
    else:
        builder = builder.thresholds(thresholds((None, "green")))
    if any(" target" in legend for _, legend in queries):
        # targets are drawn dashed, so they read as a limit rather than as another series
        builder = builder.override_by_regexp(
            ".* target.*",
            [
                DynamicConfigValue(
                    id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]}
                ),
                DynamicConfigValue(id_val="custom.fillOpacity", value=0),
            ],
        )
    for i, (expr, legend) in enumerate(queries):
        builder = builder.with_target(target(expr, legend, chr(ord("A") + i)))
    return builder


def quantile_queries(histogram: str, selector: str, by: str, legend: str) -> list[tuple[str, str]]:
    """p50, p95 and p99 of a histogram, each with its own legend (``legend`` + " p95")."""
    return [
        (quantile(q, histogram, selector, by), f"{legend} p{round(q * 100)}") for q in QUANTILES
    ]


def dashboard(uid: str, title: str, description: str, tags: list[str]) -> dash.Dashboard:
    return (
        dash.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["conveyor", *tags])
        .editable()
        .time("now-1h", "now")
        .timezone("browser")
        .refresh("30s")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .with_variable(datasource_variable())
    )
