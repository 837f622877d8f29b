"""Fixtures of the gateway tests (helpers live in ``gateway_helpers``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from gateway_helpers import Processes


@pytest.fixture
def processes(request: pytest.FixtureRequest) -> Iterator[Processes]:
    owner = Processes()
    try:
        yield owner
    finally:
        owner.stop_all()
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            print(owner.logs())
        for p in owner.all:
            p.log_path.unlink(missing_ok=True)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
