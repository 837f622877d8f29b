"""The dashboards' JSON: current with the code, and shaped the way Grafana users expect."""

from __future__ import annotations

import json

import pytest

from conveyor.observability import chart, dashboards, grafana


def test_the_chart_holds_what_the_code_generates() -> None:
    stale = chart.stale_files()
    assert not stale, (
        f"stale generated chart files {stale}: run `python -m conveyor.observability.chart` "
        "and commit the result"
    )


def test_the_chart_crds_equal_the_top_level_crds() -> None:
    for crd in chart.CRDS.glob("*.yaml"):
        assert (chart.CHART / "crds" / crd.name).read_text() == crd.read_text()
    assert {p.name for p in (chart.CHART / "crds").glob("*")} == {
        p.name for p in chart.CRDS.glob("*.yaml")
    }


@pytest.mark.parametrize("stem", sorted(dashboards.BUILDERS))
def test_dashboard_shape(stem: str) -> None:
    model = json.loads(dashboards.dashboard_json(stem))
    assert model["uid"].startswith("conveyor-") and model["title"].startswith("Conveyor / ")
    ids = [p["id"] for p in model["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    names = [v["name"] for v in model["templating"]["list"]]
    assert names[0] == "datasource"
    for item in dashboards.panels(model):
        assert item["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert item["fieldConfig"]["defaults"]["unit"], f"{item['title']} has no unit"
        assert item["description"], f"{item['title']} has no description"
        assert item["targets"], f"{item['title']} has no query"
    for query in grafana.panel_queries(model):
        assert query.legend_labels, f"{query.panel_title}/{query.ref_id}: legend names no label"
        # every variable used is defined, and every query filters by the dashboard's variables
        used = set(grafana._LEGEND_LABEL.findall(query.expr)) | {
            m for m in __import__("re").findall(r"\$([a-z_]+)", query.expr)
        }
        assert used <= {*names, "__rate_interval"}, f"{query.panel_title}: {used}"


def test_llmservice_dashboard_has_the_variables_and_the_ttft_target() -> None:
    model = json.loads(dashboards.dashboard_json("llmservice-overview"))
    assert [v["name"] for v in model["templating"]["list"]] == [
        "datasource",
        "namespace",
        "llmservice",
        "model",
        "pod",
    ]
    (ttft,) = [p for p in dashboards.panels(model) if p["title"] == "Time to first token"]
    legends = [t["legendFormat"] for t in ttft["targets"]]
    assert legends[-1] == "{{llmservice}} target (p95)"
    assert "conveyor_autoscaler_target" in ttft["targets"][-1]["expr"]
    assert ttft["fieldConfig"]["defaults"]["unit"] == "s"
    assert ttft["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] == "dashed"


def test_grafana_intervals() -> None:
    # one hour over 1000 points -> 3.6 s, rounded to 5 s; $__rate_interval = max(5+1, 4*1)
    assert grafana.interval_s(0, 3600, 1.0) == 5.0
    assert grafana.rate_interval_s(0, 3600, 1.0) == 6.0
    # a short range is bounded below by the scrape interval: 4 x 15 s
    assert grafana.rate_interval_s(0, 300, 15.0) == 60.0
    assert grafana.regex_escape("http://10.0.0.1:8000") == r"http://10\\.0\\.0\\.1:8000"
    query = grafana.PanelQuery(
        1, "t", "A", 'rate(x{pod=~"$pod"}[$__rate_interval])', "{{pod}}", "s"
    )
    assert query.resolved({"pod": ".*"}, 0, 3600, 1.0) == 'rate(x{pod=~".*"}[6s])'
