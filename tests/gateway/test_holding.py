"""Scale from zero at the gateway: a request for a model with no ready replica is held.

Held requests are counted in ``conveyor_gateway_pending_requests{model}`` (what the operator's
autoscaler scrapes to scale from zero), released to a replica as soon as one says ready, and
answered with 503 and Retry-After only after ``--hold-timeout``. Real gateway processes, with
the stub replicas of ``conveyor.bench.gateway.stub`` started on a port the gateway already knows.
"""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import openai
import pytest
from gateway_helpers import Processes, gateway, stub
from prometheus_client.parser import text_string_to_metric_families

from conveyor.bench.procs import free_port
from conveyor.bench.wait import wait_until

PENDING = "conveyor_gateway_pending_requests"


def pending(gw, model: str) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        if family.name == PENDING:
            for sample in family.samples:
                if sample.labels.get("model") == model:
                    return sample.value
    return 0.0


def wait_pending(gw, model: str, count: int) -> None:
    def check() -> bool:
        if not gw.alive():
            raise AssertionError(f"gateway exited:\n{gw.logs()[-4000:]}")
        return pending(gw, model) == count

    wait_until(check, 30, f"{count} requests held for {model}")


def start_gateway(processes: Processes, *args: str):
    gw = processes.start(gateway(*args))
    gw.wait_http("/health")
    return gw


async def test_held_requests_are_released_when_a_replica_becomes_ready(
    processes: Processes,
) -> None:
    port = free_port()
    gw = start_gateway(processes, "--backend", f"tiny=http://127.0.0.1:{port}")
    async with openai.AsyncOpenAI(
        base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=60
    ) as client:
        plain = [
            asyncio.create_task(client.completions.create(model="tiny", prompt="x", max_tokens=2))
            for _ in range(3)
        ]
        streamed = asyncio.create_task(
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True
            )
        )
        await asyncio.to_thread(wait_pending, gw, "tiny", 4)
        assert not any(t.done() for t in (*plain, streamed))  # held, not refused

        replica = processes.start(stub(port=port, model="tiny", tokens=3))
        answers = await asyncio.gather(*plain)
        assert [a.choices[0].text for a in answers] == [f"127.0.0.1:{port} 127.0.0.1:{port}"] * 3
        chunks = [c.choices[0].delta.content async for c in await streamed]
        assert chunks == [f"127.0.0.1:{port} "] * 3
    assert pending(gw, "tiny") == 0
    assert replica.alive()


async def test_a_request_held_too_long_is_503_with_retry_after(processes: Processes) -> None:
    gw = start_gateway(
        processes, "--backend", f"tiny=http://127.0.0.1:{free_port()}", "--hold-timeout", "1"
    )
    async with httpx.AsyncClient(timeout=30) as client:
        request = asyncio.create_task(
            client.post(gw.url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
        )
        await asyncio.to_thread(wait_pending, gw, "tiny", 1)
        response = await request
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert "after waiting 1 s" in response.json()["error"]["message"]
    assert pending(gw, "tiny") == 0


def held_connection(gw, prompt: str) -> socket.socket:
    """A connection that sent one completion request for ``tiny`` and reads nothing: closing it
    is its client leaving. (A cancelled httpx request does not always close its connection at
    once: one run in about ten left the gateway holding for the whole wait.)"""
    body = json.dumps({"model": "tiny", "prompt": prompt}).encode()
    host, port = gw.url.removeprefix("http://").rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=30)
    conn.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    return conn


def test_a_client_that_gives_up_while_held_is_no_longer_pending(processes: Processes) -> None:
    gw = start_gateway(processes, "--backend", f"tiny=http://127.0.0.1:{free_port()}")
    conn = held_connection(gw, "x")
    wait_pending(gw, "tiny", 1)
    conn.close()  # the client leaves: the gateway stops holding its request
    wait_pending(gw, "tiny", 0)


def test_requests_over_the_hold_bound_are_refused_at_once(processes: Processes) -> None:
    gw = start_gateway(
        processes, "--backend", f"tiny=http://127.0.0.1:{free_port()}", "--max-held-requests", "2"
    )
    held = [held_connection(gw, "x") for _ in range(2)]
    wait_pending(gw, "tiny", 2)
    over = httpx.post(gw.url + "/v1/completions", json={"model": "tiny", "prompt": "y"}, timeout=30)
    assert over.status_code == 503
    assert over.headers["retry-after"] == "1"
    assert "2 requests already waiting" in over.json()["error"]["message"]
    assert pending(gw, "tiny") == 2  # the bound refused the third, not the first two
    for conn in held:
        conn.settimeout(0)
        with pytest.raises(BlockingIOError):
            conn.recv(1)  # no answer yet: still held
        conn.close()
    wait_pending(gw, "tiny", 0)
