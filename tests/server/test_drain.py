"""SIGTERM drains: /ready turns 503 at once, new requests get 503, in-flight requests
finish, then the process exits 0."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable

import httpx

from conveyor.bench.procs import ChildProcess


def test_sigterm_drains_then_exits_zero(start_server: Callable[..., ChildProcess]) -> None:
    server = start_server("--drain-timeout", "120")
    # Long enough (seconds on the tiny model) that the request is still in flight while the
    # checks below run: with 100 tokens it could finish, and the server exit, before them.
    max_tokens = 3000
    body = {
        "prompt": "in flight",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first_chunk = threading.Event()
    events: list[dict] = []
    done: list[bool] = []

    def stream() -> None:
        with (
            httpx.Client(base_url=server.url, timeout=120) as http,
            http.stream("POST", "/v1/completions", json=body) as r,
        ):
            assert r.status_code == 200
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done.append(True)
                elif line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    first_chunk.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first_chunk.wait(60)
    server.signal(signal.SIGTERM)
    with httpx.Client(base_url=server.url, timeout=10) as http:
        deadline = time.monotonic() + 10
        while (ready := http.get("/ready")).status_code == 200:
            assert time.monotonic() < deadline, "/ready still 200 after SIGTERM"
        assert ready.status_code == 503
        assert ready.json()["error"]["code"] == "draining"
        r = http.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
        assert r.status_code == 503
        assert r.headers["retry-after"]
        assert r.json()["error"]["code"] == "draining"
        assert http.get("/health").status_code == 200
    t.join(120)
    assert done == [True]
    assert events[-1]["usage"]["completion_tokens"] == max_tokens
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    assert server.wait(60) == 0
