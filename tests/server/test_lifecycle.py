"""While the model loads, and after the engine fails: probes and requests say so.

In-process, with an engine factory that blocks and then fails: the factory is the
server's own boundary, and nothing past it is faked.
"""

from __future__ import annotations

import threading
import time

from fastapi.testclient import TestClient

from conveyor.runtime.server.app import build_app
from conveyor.runtime.server.settings import ServerSettings


def test_loading_then_engine_failure() -> None:
    release = threading.Event()

    def engine_factory():
        release.wait(30)
        raise RuntimeError("out of memory while loading weights")

    settings = ServerSettings(max_queued_requests=3)
    app = build_app(settings, engine_factory=engine_factory)
    name = settings.model_name  # the default model's: the engine never loads here
    with TestClient(app) as http:
        assert http.get("/health").status_code == 200
        ready = http.get("/ready")
        assert ready.status_code == 503 and ready.json()["error"]["code"] == "loading"
        r = http.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "loading"
        assert http.get("/v1/models").json()["data"][0]["id"] == name
        load = http.get("/load").json()
        assert load == {
            **load,
            "running": 0,
            "waiting": 0,
            "kv_cache_usage": 0.0,
            "ready": False,
            "max_queued_requests": 3,
        }
        assert f'conveyor_num_requests_running{{model="{name}"}} 0.0' in http.get("/metrics").text

        release.set()
        deadline = time.monotonic() + 30
        while http.get("/health").status_code == 200:
            assert time.monotonic() < deadline, "/health still 200 after the engine failed"
        health = http.get("/health")
        assert health.status_code == 503 and "out of memory" in health.json()["error"]["message"]
        assert http.get("/ready").json()["error"]["code"] == "engine_failed"
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503 and "out of memory" in r.json()["error"]["message"]


def test_settings_reject_bad_values() -> None:
    import pytest

    for kwargs, says in [
        ({"port": 70000}, "port"),
        ({"max_queued_requests": -1}, "max_queued_requests"),
        ({"drain_timeout": -1.0}, "drain_timeout"),
        ({"api_key": ""}, "api_key"),
    ]:
        with pytest.raises(ValueError, match=says):
            ServerSettings(**kwargs)
