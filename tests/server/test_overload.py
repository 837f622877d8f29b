"""Overload and abandonment: 429 above the queue bound, 401 without the key, and clients
that hang up mid-request free their KV blocks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import openai
import pytest

from conveyor.bench.procs import ChildProcess

KEY = "s3cret-key"
LONG = {"prompt": "tell me a long story", "max_tokens": 400, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def guarded(start_server: Callable[..., ChildProcess]) -> ChildProcess:
    """Two running slots, two queue places, an API key."""
    return start_server(
        "--max-running-requests", "2", "--max-queued-requests", "2", "--api-key", KEY
    )


def wait_idle(url: str, deadline_s: float = 60.0, headers: dict[str, str] | None = None) -> dict:
    """Poll /load until nothing runs, waits or holds KV blocks (a condition, with a deadline)."""
    deadline = time.monotonic() + deadline_s
    with httpx.Client(base_url=url, timeout=5, headers=headers) as http:
        while True:
            load = http.get("/load").json()
            if load["running"] == 0 and load["waiting"] == 0 and load["kv_cache_usage"] == 0.0:
                return load
            if time.monotonic() > deadline:
                raise AssertionError(f"replica did not return to idle: {load}")
            time.sleep(0.05)


def test_api_key_required(guarded: ChildProcess) -> None:
    with httpx.Client(base_url=guarded.url, timeout=10) as http:
        body = {"prompt": "hi", "max_tokens": 1}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
        r = http.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        assert http.get("/v1/models").status_code == 401
        # A malformed body without the key is still a 401: authentication comes first.
        r = http.post("/v1/completions", content=b"{", headers={"content-type": "application/json"})
        assert r.status_code == 401
        # Probes and metrics stay open for the kubelet and Prometheus.
        assert http.get("/ready").status_code == 200
        assert http.get("/load").status_code == 200
        assert http.get("/metrics").status_code == 200
    with (
        openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="wrong", max_retries=0) as bad,
        pytest.raises(openai.AuthenticationError),
    ):
        bad.models.list()
    with openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=KEY, max_retries=0) as good:
        r = good.completions.create(model="conveyor-tiny", prompt="hi", max_tokens=2)
        assert r.usage is not None and r.usage.completion_tokens >= 1


async def test_queue_bound_gives_429_with_retry_after(guarded: ChildProcess) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    attempts = 10
    answered: list[int] = []
    all_answered = asyncio.Event()
    async with httpx.AsyncClient(
        base_url=guarded.url, timeout=60, headers=headers, limits=httpx.Limits(max_connections=20)
    ) as http:

        async def attempt() -> tuple[int, str | None, dict | None]:
            body = {**LONG, "max_tokens": 3000}
            async with http.stream("POST", "/v1/completions", json=body) as r:
                answered.append(r.status_code)
                if len(answered) == attempts:
                    all_answered.set()
                if r.status_code != 200:
                    await r.aread()
                    return r.status_code, r.headers.get("retry-after"), r.json()
                await (
                    all_answered.wait()
                )  # hold the admitted ones until every attempt has its answer
                return 200, None, None

        results = await asyncio.gather(*(attempt() for _ in range(attempts)))
    statuses = sorted(status for status, _, _ in results)
    assert statuses.count(200) == 4, statuses  # two running + two queued
    assert statuses.count(429) == attempts - 4, statuses
    for status, retry_after, body in results:
        if status == 429:
            assert retry_after is not None and int(retry_after) >= 1
            assert body is not None and body["error"]["code"] == "queue_full"
            assert body["error"]["type"] == "rate_limit_error"
    wait_idle(guarded.url, headers=headers)


def test_more_choices_than_the_replica_can_ever_admit_is_a_400(guarded: ChildProcess) -> None:
    """n above running slots + queue places was a 429 "retry after 1s" on an idle replica,
    which no retry can get past; it is a 400 that says how far to lower n."""
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=guarded.url, timeout=60, headers=headers) as http:
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 5})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "n" and "at most 4" in err["message"], err
        r = http.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 2, "n": 2})
        assert r.status_code == 400, r.text
        # What fits in the slots and the queue together is admitted.
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 4})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 4
    wait_idle(guarded.url, headers=headers)


async def test_disconnected_streams_are_aborted(server: ChildProcess) -> None:
    """200 streams cut after a few tokens: KV usage and the gauges return to zero."""
    async with httpx.AsyncClient(
        base_url=server.url, timeout=120, limits=httpx.Limits(max_connections=250)
    ) as http:

        async def cut_after_a_few_tokens(i: int) -> int:
            body = {**LONG, "prompt": f"stream number {i}", "max_tokens": 1000}
            seen = 0
            async with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        seen += 1
                        if seen == 3:
                            break
            return seen

        assert await asyncio.gather(*(cut_after_a_few_tokens(i) for i in range(200))) == [3] * 200
    wait_idle(server.url)
    with httpx.Client(base_url=server.url, timeout=10) as http:
        metrics = http.get("/metrics").text
    assert 'conveyor_num_requests_running{model="conveyor-tiny"} 0.0' in metrics
    assert 'conveyor_num_requests_waiting{model="conveyor-tiny"} 0.0' in metrics
    assert 'conveyor_kv_cache_usage_ratio{model="conveyor-tiny"} 0.0' in metrics
    aborted = next(
        line
        for line in metrics.splitlines()
        if line.startswith('conveyor_request_success_total{finish_reason="abort"')
    )
    assert float(aborted.rsplit(" ", 1)[1]) >= 200


def test_disconnected_non_streamed_request_is_aborted(server: ChildProcess) -> None:
    body = {"prompt": "a long answer", "max_tokens": 2000, "ignore_eos": True}
    with (
        httpx.Client(base_url=server.url, timeout=httpx.Timeout(30, read=0.5)) as http,
        pytest.raises(httpx.ReadTimeout),
    ):
        http.post("/v1/completions", json=body)
    wait_idle(server.url)
