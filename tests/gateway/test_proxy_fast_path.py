"""The proxy's fast path: proxied paths reach the proxy without FastAPI's stack, the other
routes still answer through it, a replica gone silent mid-stream ends the stream with an
error event once ``--upstream-timeout`` passes (the silence watch that replaced aiohttp's
per-chunk read timer), and ``--workers`` processes share the port and their metrics."""

from __future__ import annotations

import json

import httpx
from gateway_helpers import Processes, gateway, stub

from conveyor.bench.wait import wait_until
from conveyor.gateway.settings import GatewaySettings, settings_from_json, settings_to_json


def _admitted(gw, count: int) -> None:
    def ready() -> bool:
        try:
            pools = httpx.get(gw.url + "/debug/pools", timeout=5).json()
        except httpx.HTTPError:
            return False
        return sum(r["admitted"] for p in pools.values() for r in p["replicas"]) == count

    wait_until(ready, 30, f"{count} admitted replicas")


def test_a_silent_replica_ends_the_stream_with_an_error_event(processes: Processes) -> None:
    # one chunk at once, the next a minute later: silence well past the gateway's timeout
    replica = processes.start(stub(tokens=3, token_interval_ms=60000))
    replica.wait_http("/load")
    gw = processes.start(gateway("--backend", replica.url, "--upstream-timeout", "0.5"))
    gw.wait_http("/health")
    _admitted(gw, 1)

    body = {"model": "stub", "prompt": "x", "stream": True, "max_tokens": 3}
    with httpx.stream("POST", gw.url + "/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        text = "".join(response.iter_text())
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e.strip()]
    assert json.loads(events[0])["choices"][0]["text"] == f"127.0.0.1:{replica.port} "
    error = json.loads(events[1])["error"]
    assert "sent nothing for 0.5s (--upstream-timeout)" in error["message"]
    assert events[2] == "[DONE]"
    metrics = httpx.get(gw.url + "/metrics", timeout=5).text
    assert (
        f'conveyor_gateway_ejections_total{{backend="{replica.url}",model="stub"}} 1.0' in metrics
    )


def test_a_stream_ends_with_its_done_event_and_counts_once(processes: Processes) -> None:
    # replica-like: a role-only opening chunk, a load header, and a usage chunk before [DONE]
    replica = processes.start(stub(tokens=3, token_interval_ms=20, replica_like="true"))
    replica.wait_http("/load")
    gw = processes.start(gateway("--backend", replica.url))
    gw.wait_http("/health")
    _admitted(gw, 1)

    body = {"model": "stub", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_tokens": 3, "stream_options": {"include_usage": True}}  # fmt: skip
    for _ in range(3):
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            assert "x-conveyor-load" not in r.headers  # the replica's load stays in the gateway
            text = "".join(r.iter_text())
        events = [e.removeprefix("data: ") for e in text.split("\n\n") if e.strip()]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 3
        words = [c["delta"].get("content") for e in events[:-2] for c in json.loads(e)["choices"]]
        assert "".join(w for w in words if w) == f"127.0.0.1:{replica.port} " * 3
    metrics = httpx.get(gw.url + "/metrics", timeout=5).text
    assert (
        f'conveyor_gateway_requests_total{{backend="{replica.url}",code="200",model="stub"}} 3.0'
        in metrics
    )
    assert 'code="499"' not in metrics  # the response's end is not the client going away
    assert 'conveyor_gateway_request_duration_seconds_count{model="stub"} 3.0' in metrics
    assert (
        f'conveyor_gateway_backend_in_flight{{backend="{replica.url}",model="stub"}} 0.0' in metrics
    )


def test_proxied_and_other_routes_both_answer(processes: Processes) -> None:
    replica = processes.start(stub())
    replica.wait_http("/load")
    gw = processes.start(gateway("--backend", replica.url, "--api-key", "k"))
    gw.wait_http("/health")
    auth = {"authorization": "Bearer k"}

    def admitted() -> bool:
        pools = httpx.get(gw.url + "/debug/pools", headers=auth, timeout=5).json()
        return any(r["admitted"] for p in pools.values() for r in p["replicas"])

    wait_until(admitted, 30, "the replica to be admitted")
    body = {"model": "stub", "prompt": "x", "max_tokens": 2}
    refused = httpx.post(gw.url + "/v1/completions", json=body, timeout=10)
    assert refused.status_code == 401  # auth is the proxy's own, not a middleware's
    ok = httpx.post(gw.url + "/v1/completions", json=body, headers=auth, timeout=10)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert ok.headers["x-conveyor-backend"] == replica.url
    # not proxied: FastAPI's routes, and its 405 for a GET on a proxied path
    assert (
        httpx.get(gw.url + "/v1/models", headers=auth, timeout=10).json()["data"][0]["id"] == "stub"
    )
    assert httpx.get(gw.url + "/v1/completions", timeout=10).status_code == 405
    assert "conveyor_gateway_requests_total" in httpx.get(gw.url + "/metrics", timeout=10).text


def test_settings_reach_workers_unchanged() -> None:
    settings = GatewaySettings(backends=("m=http://a:1",), api_keys=("k",), workers=3)
    assert settings_from_json(settings_to_json(settings)) == settings


def test_workers_share_the_port_and_sum_their_metrics(processes: Processes) -> None:
    replica = processes.start(stub())
    replica.wait_http("/load")
    # the model named: each worker has the pool at once and holds a request until it has
    # polled the replica, rather than answering 404 before it discovered the model
    gw = processes.start(gateway("--backend", f"stub={replica.url}", "--workers", "2"))
    gw.wait_http("/health")
    body = {"model": "stub", "prompt": "x", "max_tokens": 1}
    for _ in range(20):  # a new connection each: the kernel hands them to either worker
        assert httpx.post(gw.url + "/v1/completions", json=body, timeout=30).status_code == 200
    line = (
        f'conveyor_gateway_requests_total{{backend="{replica.url}",code="200",model="stub"}} 20.0'
    )
    for _ in range(3):  # whichever worker answers the scrape, it counts every worker's
        assert line in httpx.get(gw.url + "/metrics", timeout=10).text.splitlines()
