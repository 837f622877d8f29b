"""The proxy's fast path: proxied paths reach the proxy without FastAPI's stack, the other
routes still answer through it, a replica gone silent mid-stream ends the stream with an
error event once ``--upstream-timeout`` passes (the silence watch that replaced aiohttp's
per-chunk read timer), while a whole answer longer than that is waited for as long as the
replica answers its load polls and a client slow to read is not the replica's silence; and
``--workers`` processes share the port and their metrics."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import Iterator

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


def _behind_gateway(processes: Processes, *gateway_args: str, **stub_options: object):
    """A stub replica and a gateway in front of it that has admitted it."""
    replica = processes.start(stub(**stub_options))
    replica.wait_http("/load")
    gw = processes.start(gateway("--backend", replica.url, *gateway_args))
    gw.wait_http("/health")
    _admitted(gw, 1)
    return replica, gw


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


def test_a_whole_answer_longer_than_the_timeout_is_not_cut_while_the_replica_answers_polls(
    processes: Processes,
) -> None:
    # 11 tokens at 300 ms: the head of the answer comes after 3 s, six timeouts of silence on
    # the request's connection, while the replica answers every load poll
    replica, gw = _behind_gateway(processes, "--upstream-timeout", "0.5")

    body = {"model": "stub", "prompt": "pace 300", "max_tokens": 11}
    r = httpx.post(gw.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 11
    metrics = httpx.get(gw.url + "/metrics", timeout=5).text
    assert "conveyor_gateway_ejections_total{" not in metrics.replace("# ", "")
    assert (
        f'conveyor_gateway_requests_total{{backend="{replica.url}",code="200",model="stub"}} 1.0'
        in metrics
    )


def test_a_replica_that_answers_nothing_fails_a_whole_answer_after_the_timeout(
    processes: Processes,
) -> None:
    replica, gw = _behind_gateway(processes, "--upstream-timeout", "0.5")

    body = {"model": "stub", "prompt": "pace 1000", "max_tokens": 30}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, gw.url + "/v1/completions", json=body, timeout=60)

        def sent() -> bool:
            metrics = httpx.get(gw.url + "/metrics", timeout=5).text
            return f'in_flight{{backend="{replica.url}",model="stub"}} 1.0' in metrics

        wait_until(sent, 30, "the request on the replica")
        os.kill(replica.pid, signal.SIGSTOP)  # hung: neither the answer nor a poll comes
        try:
            r = answer.result(timeout=30)
        finally:
            os.kill(replica.pid, signal.SIGCONT)
    assert r.status_code == 502, r.text
    assert "showed no work on the request for 0.5s" in r.json()["error"]["message"]


def test_a_client_slow_to_read_is_not_the_replicas_silence(processes: Processes) -> None:
    _, gw = _behind_gateway(processes, "--upstream-timeout", "0.5")

    with _big_stream(gw) as client:
        received = client.recv(1024)
        time.sleep(2.0)  # the slow client under test: four timeouts without reading
        while chunk := client.recv(65536):
            received += chunk
    head, chunked = received.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    text = _dechunk(chunked).decode()
    assert '"error"' not in text and text.endswith("data: [DONE]\n\n")
    assert text.count('"text": ') == 40000
    metrics = httpx.get(gw.url + "/metrics", timeout=5).text
    assert "conveyor_gateway_ejections_total{" not in metrics.replace("# ", "")


def test_a_client_that_reads_nothing_is_dropped_after_its_stall_timeout(
    processes: Processes,
) -> None:
    replica, gw = _behind_gateway(processes, "--client-stall-timeout", "1")
    with _big_stream(gw) as client:
        assert client.recv(1024).startswith(b"HTTP/1.1 200")

        def dropped() -> bool:  # while this client reads nothing more
            metrics = httpx.get(gw.url + "/metrics", timeout=5).text
            return 'code="499",model="stub"} 1.0' in metrics

        wait_until(dropped, 30, "the stalled client's request to be dropped")
        received = b""
        while chunk := client.recv(65536):  # what was buffered, then the gateway's close
            received += chunk
    assert b"data: [DONE]" not in received
    metrics = httpx.get(gw.url + "/metrics", timeout=5).text
    assert f'in_flight{{backend="{replica.url}",model="stub"}} 0.0' in metrics
    assert "conveyor_gateway_ejections_total{" not in metrics.replace("# ", "")


@contextlib.contextmanager
def _big_stream(gw) -> Iterator[socket.socket]:
    """A raw client that asked ``gw`` for 40,000 chunks at once (about 6 MB: more than the
    socket buffers hold, so the gateway's writes wait while it does not read), read nothing."""
    body = json.dumps({"model": "stub", "prompt": "x", "stream": True, "max_tokens": 40000})
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}"
    ).encode()
    with socket.socket() as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.settimeout(30)
        client.connect(("127.0.0.1", gw.port))
        client.sendall(request)
        yield client


def _dechunk(raw: bytes) -> bytes:
    """An HTTP/1.1 chunked body's bytes."""
    out = b""
    while True:
        size_line, raw = raw.split(b"\r\n", 1)
        size = int(size_line, 16)
        if size == 0:
            return out
        out, raw = out + raw[:size], raw[size + 2 :]


def test_a_request_naming_no_model_goes_to_the_one_served_and_a_zero_queue_takes_it(
    processes: Processes,
) -> None:
    # --max-queued-requests 0 is "no queue", not "refuse all": the idle replica runs it
    _, gw = _behind_gateway(processes, max_running_requests=1, max_queued_requests=0)
    for body in ({"prompt": "x", "max_tokens": 2}, {"model": "", "prompt": "x", "max_tokens": 2}):
        r = httpx.post(gw.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
