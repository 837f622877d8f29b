"""All dashboards, as the JSON Grafana imports (what ``charts/conveyor/dashboards/`` holds)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders.dashboard import Dashboard
from grafana_foundation_sdk.cog.encoder import JSONEncoder

from conveyor.observability import autoscaler_dashboard, gateway_dashboard, llmservice_dashboard

BUILDERS: dict[str, Callable[[], Dashboard]] = {
    "llmservice-overview": llmservice_dashboard.build,
    "gateway": gateway_dashboard.build,
    "autoscaler": autoscaler_dashboard.build,
}
"""File stem (``<stem>.json``) -> the function that builds that dashboard."""


def dashboard_json(stem: str) -> str:
    """The dashboard ``stem`` as Grafana's JSON model (stable key order, one trailing newline)."""
    model = BUILDERS[stem]().build()
    for number, item in enumerate(model.panels or [], start=1):
        item.id_val = number  # stable ids: Grafana links and the render refer to panels by id
    return json.dumps(model, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def all_json() -> dict[str, str]:
    """``<stem>.json`` -> its JSON text, for every dashboard."""
    return {f"{stem}.json": dashboard_json(stem) for stem in BUILDERS}


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def panels(model: dict[str, Any]) -> list[dict[str, Any]]:
    """The panels that draw data (rows left out), including those inside collapsed rows."""
    found: list[dict[str, Any]] = []
    for item in model.get("panels", []):
        if item.get("type") == "row":
            found += item.get("panels", [])
        else:
            found.append(item)
    return found
