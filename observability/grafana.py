"""What Grafana does with a dashboard's JSON before it asks Prometheus, done without Grafana.

Grafana cannot be used here (its licence), so the panel check and ``conveyor dashboard
render`` resolve the variables (``label_values`` queries, chained in order, "All" as the
variable's ``allValue``), compute ``$__interval`` and ``$__rate_interval`` the way Grafana's
Prometheus datasource does, and substitute them into each panel's expression.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from conveyor.observability.dashboards import panels
from conveyor.observability.prometheus import PrometheusAPI

MAX_DATA_POINTS = 1000
"""Grafana's default for a time series panel about as wide as a screen (the real value is
the panel's width in pixels)."""

# Grafana's interval rounding (kbn.roundInterval): below the bound (ms) -> the interval (ms).
_ROUNDING = (
    (15, 10), (35, 20), (75, 50), (150, 100), (350, 200), (750, 500), (1_500, 1_000),
    (3_500, 2_000), (7_500, 5_000), (12_500, 10_000), (17_500, 15_000), (25_000, 20_000),
    (45_000, 30_000), (90_000, 60_000), (210_000, 120_000), (450_000, 300_000),
    (750_000, 600_000), (1_050_000, 900_000), (1_500_000, 1_200_000), (2_700_000, 1_800_000),
    (5_400_000, 3_600_000), (9_000_000, 7_200_000), (16_200_000, 10_800_000),
    (32_400_000, 21_600_000), (86_400_000, 43_200_000),
)  # fmt: skip

_LEGEND_LABEL = re.compile(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")
_LABEL_VALUES = re.compile(r"^label_values\((?:(.*),\s*)?([a-zA-Z_][a-zA-Z0-9_]*)\)$")


def round_interval(ms: float) -> float:
    """Grafana's rounding of a computed interval to a readable one (ms in, ms out)."""
    for bound, value in _ROUNDING:
        if ms < bound:
            return value
    return 86_400_000 * 7 if ms >= 604_800_000 else 86_400_000


def interval_s(start: float, end: float, scrape_interval_s: float) -> float:
    """``$__interval``: the time range over the panel's data points, at least the scrape interval."""
    computed = round_interval((end - start) * 1000 / MAX_DATA_POINTS) / 1000
    return max(computed, scrape_interval_s)


def rate_interval_s(start: float, end: float, scrape_interval_s: float) -> float:
    """``$__rate_interval``: max($__interval + scrape interval, 4 x scrape interval)."""
    return max(interval_s(start, end, scrape_interval_s) + scrape_interval_s, 4 * scrape_interval_s)


def _seconds(value: float) -> str:
    ms = round(value * 1000)
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def regex_escape(value: str) -> str:
    """A value as Grafana puts it into a Prometheus regex matcher (inside a PromQL string)."""
    return re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\\\1", value)


@dataclass(frozen=True)
class Variable:
    name: str
    query: str
    all_value: str | None


def variables(model: dict[str, Any]) -> list[Variable]:
    """The dashboard's query variables, in order (the datasource variable left out)."""
    found = []
    for item in model.get("templating", {}).get("list", []):
        if item.get("type") != "query":
            continue
        query = item["query"]["query"] if isinstance(item["query"], dict) else item["query"]
        found.append(Variable(item["name"], query, item.get("allValue")))
    return found


def substitute(expr: str, values: dict[str, str]) -> str:
    """Replace ``$name`` and ``${name}`` by their values (longest names first)."""
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", values[name]).replace("$" + name, values[name])
    return expr


def resolve_variables(
    model: dict[str, Any],
    api: PrometheusAPI,
    start: float,
    end: float,
    *,
    all_as: str = "all-value",
) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Each variable's substitution and the values ``label_values`` listed for it.

    ``all_as``: ``all-value`` puts the variable's allValue (what Grafana does for "All");
    ``each`` puts the alternation of every listed value, as when the user ticks them all.
    """
    chosen: dict[str, str] = {}
    listed: dict[str, list[str]] = {}
    for variable in variables(model):
        match = _LABEL_VALUES.match(variable.query.strip())
        if match is None:
            raise ValueError(f"variable {variable.name}: unsupported query {variable.query!r}")
        selector, label = match.group(1), match.group(2)
        selector = substitute(selector, chosen) if selector else f'{{{label}!=""}}'
        values = api.label_values(label, selector, start, end)
        listed[variable.name] = values
        if all_as == "all-value" and variable.all_value is not None:
            chosen[variable.name] = variable.all_value
        else:
            chosen[variable.name] = "(" + "|".join(regex_escape(v) for v in values) + ")"
    return chosen, listed


@dataclass(frozen=True)
class PanelQuery:
    panel_id: int
    panel_title: str
    ref_id: str
    expr: str
    legend: str
    unit: str

    @property
    def legend_labels(self) -> list[str]:
        return _LEGEND_LABEL.findall(self.legend)

    def resolved(
        self, values: dict[str, str], start: float, end: float, scrape_interval_s: float
    ) -> str:
        """The expression as Grafana sends it for the range ``start``..``end``."""
        builtins = {
            "__rate_interval": _seconds(rate_interval_s(start, end, scrape_interval_s)),
            "__interval": _seconds(interval_s(start, end, scrape_interval_s)),
            "__range": _seconds(end - start),
        }
        return substitute(self.expr, {**builtins, **values})


def panel_queries(model: dict[str, Any]) -> list[PanelQuery]:
    """Every query of every panel of a dashboard (hidden queries left out)."""
    found = []
    for item in panels(model):
        unit = item.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        for target in item.get("targets", []):
            if target.get("hide"):
                continue
            found.append(
                PanelQuery(
                    item["id"],
                    item["title"],
                    target["refId"],
                    target["expr"],
                    target.get("legendFormat", ""),
                    unit,
                )
            )
    return found


def legend(template: str, labels: dict[str, str]) -> str:
    """A series' name in the legend, as Grafana formats ``{{label}}`` templates."""
    return _LEGEND_LABEL.sub(lambda m: labels.get(m.group(1), ""), template).strip()
