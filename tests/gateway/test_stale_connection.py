"""A pooled connection the replica closed as it was reused is retried once on the same
replica, which is not ejected for it; a second failure, or a refused connect, is a failure."""

from __future__ import annotations

import math
from typing import Any

import aiohttp
import pytest

from conveyor.gateway.metrics import GatewayMetrics
from conveyor.gateway.pool import Pool
from conveyor.gateway.replica import Replica
from conveyor.gateway.routing import make_policy
from conveyor.gateway.settings import GatewaySettings
from conveyor.gateway.upstream_attempt import Upstream, UpstreamRequest


class _Response:
    status = 200
    headers: dict[str, str] = {}
    raw_headers = ((b"content-type", b"application/json"),)
    content_type = "application/json"

    async def read(self) -> bytes:
        return b'{"ok": true}'

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Session:
    """Raises the given errors on successive posts, then answers."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.posts = 0

    async def post(self, url: Any, **kwargs: Any) -> _Response:
        self.posts += 1
        if self.errors:
            raise self.errors.pop(0)
        return _Response()


def _attempt(session: _Session) -> tuple[object, Replica, list[dict[str, Any]]]:
    import asyncio

    settings = GatewaySettings()
    upstream = Upstream(session=session, metrics=GatewayMetrics(), settings=settings)  # type: ignore[arg-type]
    pool = Pool("m", make_policy("round-robin", bounded_load_factor=1.25, ring_vnodes=10))
    replica = Replica("http://127.0.0.1:1")
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def run() -> object:
        request = UpstreamRequest("/v1/completions", b"{}", {}, False, 0.0)
        return await upstream.attempt(pool, replica, request, send)

    return asyncio.run(run()), replica, sent


@pytest.mark.parametrize(
    "stale",
    [
        aiohttp.ServerDisconnectedError(),
        aiohttp.ClientOSError(None, "Can not write request body for http://127.0.0.1:1/"),
    ],
)
def test_a_stale_pooled_connection_is_retried_without_ejecting(stale: BaseException) -> None:
    session = _Session(stale)
    failure, replica, sent = _attempt(session)
    assert failure is None
    assert session.posts == 2
    assert replica.ejected_until == -math.inf
    assert sent[0]["status"] == 200 and sent[1]["body"] == b'{"ok": true}'


def test_a_second_disconnect_is_a_failure_that_ejects() -> None:
    session = _Session(aiohttp.ServerDisconnectedError(), aiohttp.ServerDisconnectedError())
    failure, replica, sent = _attempt(session)
    assert failure is not None and "Server disconnected" in failure.message  # type: ignore[attr-defined]
    assert session.posts == 2
    assert replica.ejected_until > 0
    assert sent == []


def test_a_refused_connect_is_not_retried_on_the_same_replica() -> None:
    refused = aiohttp.ClientConnectorError(
        aiohttp.client_reqrep.ConnectionKey("127.0.0.1", 1, False, True, None, None, None),
        ConnectionRefusedError(111, "Connection refused"),
    )
    session = _Session(refused)
    failure, replica, _ = _attempt(session)
    assert failure is not None
    assert session.posts == 1
    assert replica.ejected_until > 0
