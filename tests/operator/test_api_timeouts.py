"""The operator against an apiserver that stops answering (frozen, or partitioned away): no call
waits on its socket forever, and the leader steps down by its renew deadline even when the
renewal itself hangs (a standby may take the Lease from then on).

A small aiohttp app on loopback plays the apiserver and never answers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from conveyor.operator.cli import kopf_operator_settings
from conveyor.operator.kube import Kube
from conveyor.operator.leader import LeaderElector
from conveyor.operator.settings import OperatorSettings


@pytest.fixture
async def silent_kube() -> AsyncIterator[tuple[Kube, list[str]]]:
    """A Kube with a 0.3 s timeout, on an apiserver that takes every request and answers none."""
    from kubernetes_asyncio import client

    seen: list[str] = []

    async def hang(request: web.Request) -> web.StreamResponse:
        seen.append(f"{request.method} {request.path}")
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", hang)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    configuration = client.Configuration(host=f"http://127.0.0.1:{runner.addresses[0][1]}")
    kube = Kube(client.ApiClient(configuration), timeout_s=0.3)
    try:
        yield kube, seen
    finally:
        await kube.close()
        await runner.cleanup()


async def test_a_call_that_gets_no_answer_times_out(silent_kube: tuple[Kube, list[str]]) -> None:
    kube, seen = silent_kube
    async with asyncio.timeout(10):  # the test's own bound: far above the client's 0.3 s
        with pytest.raises(TimeoutError):
            await kube.get("/apis/apps/v1/namespaces/ns/deployments/chat")
    # (on a busy machine the client may give up before the request is even read)
    assert seen in ([], ["GET /apis/apps/v1/namespaces/ns/deployments/chat"])


async def test_the_leader_steps_down_when_renewals_hang(
    silent_kube: tuple[Kube, list[str]], caplog: pytest.LogCaptureFixture
) -> None:
    """Each renewal is bounded by the time left to the renew deadline, not by the client's own
    timeout (here 60 s, longer than the whole Lease): hold() returns by the deadline."""
    kube, seen = silent_kube
    kube.timeout_s = 60.0
    elector = LeaderElector(
        kube=kube,
        namespace="ns",
        name="conveyor-operator",
        identity="op-a",
        duration_s=0.6,
        renew_interval_s=0.1,
        retry_interval_s=0.05,
    )
    caplog.set_level(logging.WARNING, logger="conveyor.operator")
    async with asyncio.timeout(10):
        await elector.hold()
    assert all(
        s == "GET /apis/coordination.k8s.io/v1/namespaces/ns/leases/conveyor-operator" for s in seen
    )
    assert "renewal got no answer" in caplog.text
    assert "stepping down" in caplog.text


def test_kopf_watches_and_requests_are_bounded() -> None:
    """Every kopf timeout is finite; the client outwaits the server's own end of a watch (so a
    healthy watch ends cleanly) and notices a silent one sooner (bookmarks come each minute)."""
    watching = kopf_operator_settings(OperatorSettings()).watching
    networking = kopf_operator_settings(OperatorSettings()).networking
    assert watching.server_timeout and watching.client_timeout
    assert watching.client_timeout > watching.server_timeout
    assert watching.connect_timeout and networking.connect_timeout and networking.request_timeout
    assert 60 < watching.inactivity_timeout < watching.server_timeout
