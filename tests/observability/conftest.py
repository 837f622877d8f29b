"""Fixtures of the observability tests: the real helm, promtool and prometheus binaries.

They come from cluster/build-tools.sh's cache. When they are not built yet these tests skip
with a reason, unless CONVEYOR_BUILD_TOOLS=1 asks them to build (or wait for the build that
is running); the e2e phase, which runs after the build, runs the same checks on the chart.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conveyor.cluster.tools import Tools, build_tools, tools_directory


@pytest.fixture(scope="session")
def tools() -> Tools:
    found = Tools(tools_directory())
    if not found.missing(("helm", "promtool", "prometheus")):
        return found
    if os.environ.get("CONVEYOR_BUILD_TOOLS") == "1":
        return build_tools()
    pytest.skip(
        f"helm/promtool/prometheus are not built in {found.directory}: run cluster/build-tools.sh "
        "(about 15 min cold) or set CONVEYOR_BUILD_TOOLS=1"
    )


@pytest.fixture(scope="session")
def helm(tools: Tools) -> Path:
    return tools.path("helm")


@pytest.fixture(scope="session")
def promtool(tools: Tools) -> Path:
    return tools.path("promtool")


@pytest.fixture(scope="session")
def prometheus_binary(tools: Tools) -> Path:
    return tools.path("prometheus")
