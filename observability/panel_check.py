"""Every panel of a dashboard checked the way Grafana would use it, against a real Prometheus.

After a real run, each panel query, with its variables resolved from ``label_values`` (both
as the variable's "All" value and as the alternation of every listed value, as when a user
ticks them all) and ``$__rate_interval`` substituted as Grafana does
(``conveyor.observability.grafana``), is evaluated over the run's range. It must return
series carrying the labels its legend uses, and not be zero all along: a panel that draws
nothing, or only a flat zero, did not show what it is for. A query that may stay empty is
listed by the test with the reason (:class:`AllowedEmpty`), and its metric must at least be
exported.

Used by the loopback tier (tests/observability/test_panels_loopback.py, static targets) and
the cluster tier (e2e/test_dashboards_cluster.py, Kubernetes discovery and the operator).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from conveyor.observability import dashboards, grafana
from conveyor.observability.chart import CHART
from conveyor.observability.prometheus import PrometheusAPI
from conveyor.observability.render import RenderedPanel

VARIABLE_MODES = ("all-value", "each")
"""How each variable is substituted: Grafana's "All" (the allValue), then every listed value."""


@dataclass(frozen=True)
class AllowedEmpty:
    """A panel query that may draw nothing (or only zeros) in a run, and why."""

    panel_title: str
    metric: str
    """The metric of the query (a query of the panel whose expression names it)."""
    reason: str
    must_exist: bool = True
    """Whether the metric must still be exported (HELP and TYPE scraped); False only where
    nothing in the run exports it at all (say, the operator's metrics without an operator)."""

    def covers(self, query: grafana.PanelQuery) -> bool:
        return query.panel_title == self.panel_title and self.metric in query.expr


@dataclass
class DashboardCheck:
    """What checking one dashboard found."""

    name: str
    panels: int
    queries: int
    """Panel queries of the dashboard."""
    evaluations: int = 0
    """Queries evaluated (each query once per variable mode)."""
    failures: list[str] = field(default_factory=list)
    allowed_empty: list[str] = field(default_factory=list)
    """Queries that drew nothing and were allowed to (with the reason)."""

    def figures(self) -> str:
        return (
            f"{self.name}: {self.panels} panels, {self.queries} queries, "
            f"{self.evaluations} evaluations ({len(VARIABLE_MODES)} variable modes), "
            f"{len(self.allowed_empty)} allowed empty"
        )


def committed(name: str) -> dict[str, Any]:
    """The dashboard's JSON as the chart ships it (what Grafana imports)."""
    return json.loads((CHART / "dashboards" / name).read_text())


def shows(value: str) -> bool:
    """Whether a sample draws something: a finite value other than zero."""
    number = float(value)
    return math.isfinite(number) and number != 0


def _allowance(query: grafana.PanelQuery, allowed: Sequence[AllowedEmpty]) -> AllowedEmpty | None:
    return next((a for a in allowed if a.covers(query)), None)


def check_dashboard(
    name: str,
    api: PrometheusAPI,
    start: float,
    end: float,
    *,
    scrape_interval_s: float,
    allowed: Sequence[AllowedEmpty] = (),
    model: dict[str, Any] | None = None,
) -> DashboardCheck:
    """Evaluate every query of dashboard ``name`` over ``start``..``end``; what failed, and why."""
    model = committed(name) if model is None else model
    queries = grafana.panel_queries(model)
    result = DashboardCheck(name, len(dashboards.panels(model)), len(queries))
    step = grafana.interval_s(start, end, scrape_interval_s)
    exported: dict[str, bool] = {}
    for mode in VARIABLE_MODES:
        values, listed = grafana.resolve_variables(model, api, start, end, all_as=mode)
        if mode == VARIABLE_MODES[0]:
            for variable, found in listed.items():
                if not found:
                    result.failures.append(f"{name}: variable ${variable} lists no value")
        for query in queries:
            expr = query.resolved(values, start, end, scrape_interval_s)
            series = api.query_range(expr, start, end, step)
            result.evaluations += 1
            labelled = [
                s for s in series if all(s["metric"].get(label) for label in query.legend_labels)
            ]
            drawn = any(shows(v) for s in labelled for _, v in s["values"])
            if drawn:
                continue
            where = f"{name} panel {query.panel_title!r} query {query.ref_id} ({mode})"
            allowance = _allowance(query, allowed)
            if allowance is not None:
                if allowance.must_exist:
                    if allowance.metric not in exported:
                        exported[allowance.metric] = bool(api.metadata(allowance.metric))
                    if not exported[allowance.metric]:
                        result.failures.append(
                            f"{where}: allowed to be empty, but {allowance.metric} is not even "
                            "exported"
                        )
                        continue
                result.allowed_empty.append(f"{where}: {allowance.reason}")
                continue
            if labelled:
                result.failures.append(
                    f"{where} is zero all along: the run did not show what it draws: {expr}"
                )
            else:
                result.failures.append(
                    f"{where} returned {len(series)} series, none with labels "
                    f"{query.legend_labels}: {expr}"
                )
    return result


def unexplained_empty(
    rendered: Iterable[RenderedPanel], allowed: Sequence[AllowedEmpty]
) -> set[str]:
    """Titles of rendered panels that drew nothing and are not allowed to."""
    titles = {a.panel_title for a in allowed}
    return {p.title for p in rendered if not p.series and p.title not in titles}


def scraped_after(api: PrometheusAPI, namespace: str, moment: float, *, at_least: int) -> bool:
    """Whether at least ``at_least`` targets of ``namespace`` are up and every target that is
    up was scraped after ``moment`` (so what happened before ``moment`` is in the TSDB)."""
    samples = api.query(f'timestamp(up{{namespace="{namespace}"}} == 1)')
    return len(samples) >= at_least and all(float(s["value"][1]) > moment for s in samples)
