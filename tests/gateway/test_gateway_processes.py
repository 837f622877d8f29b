"""A real gateway process in front of minimal streaming replicas (``bench.gateway.stub``) on loopback.

The stubs answer like runtime replicas without a model, so these tests exercise the
gateway itself (streaming, failures, discovery, auth) in seconds. The same behaviours
against real ``conveyor serve`` processes are in ``test_runtime_integration.py``.
"""

from __future__ import annotations

import asyncio
import os

import httpx
import openai
import pytest
from gateway_helpers import Processes, gateway, stub

from conveyor.bench.procs import free_port
from conveyor.bench.wait import wait_until


def pools(gw, key: str | None = None) -> dict:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.get(gw.url + "/debug/pools", headers=headers, timeout=5).json()


def wait_admitted(gw, model: str, count: int, key: str | None = None, timeout: float = 30) -> None:
    def ready() -> bool:
        if not gw.alive():
            raise AssertionError(f"gateway exited:\n{gw.logs()[-4000:]}")
        try:
            pool = pools(gw, key).get(model)
        except httpx.HTTPError:
            return False
        return pool is not None and sum(r["admitted"] for r in pool["replicas"]) == count

    wait_until(ready, timeout, f"{count} admitted replicas of {model}")


def start_gateway(processes: Processes, *args: str):
    gw = processes.start(gateway(*args))
    gw.wait_http("/health")
    return gw


async def test_streams_pass_through_chunk_by_chunk(processes: Processes) -> None:
    replica = processes.start(stub(tokens=40, token_interval_ms=50))
    replica.wait_http("/load")
    gw = start_gateway(processes, "--backend", replica.url)
    wait_admitted(gw, "stub", 1)

    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused") as client:
        stream = await client.completions.create(
            model="stub", prompt="hello", stream=True, max_tokens=40
        )
        chunks = []
        async for chunk in stream:
            chunks.append(chunk.choices[0].text)
            if len(chunks) == 1:
                # The first chunk is here while the replica is still generating: nothing buffered.
                load = httpx.get(replica.url + "/load", timeout=5).json()
                assert load["running"] == 1
        assert len(chunks) == 40
        assert chunks[0] == f"127.0.0.1:{replica.port} "

        chat = await client.chat.completions.create(
            model="stub", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=3
        )
        assert [c.choices[0].delta.content async for c in chat] == [
            f"127.0.0.1:{replica.port} "
        ] * 3

        plain = await client.completions.create(model="stub", prompt="hello", max_tokens=2)
        assert plain.usage is not None and plain.usage.completion_tokens == 2


async def test_models_are_routed_by_name_and_an_unknown_model_is_404(processes: Processes) -> None:
    a = processes.start(stub(model="model-a"))
    b = processes.start(stub(model="model-b"))
    for replica in (a, b):
        replica.wait_http("/load")
    gw = start_gateway(processes, "--backend", a.url, "--backend", f"model-b={b.url}")
    wait_admitted(gw, "model-a", 1)
    wait_admitted(gw, "model-b", 1)

    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused") as client:
        assert sorted(m.id for m in (await client.models.list()).data) == ["model-a", "model-b"]
        for model, replica in (("model-a", a), ("model-b", b)):
            out = await client.completions.create(model=model, prompt="x", max_tokens=1)
            assert out.choices[0].text == f"127.0.0.1:{replica.port}"
        with pytest.raises(openai.NotFoundError) as err:
            await client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
        assert "model-a, model-b" in str(err.value)

    response = httpx.post(gw.url + "/v1/completions", content=b"{not json", timeout=5)
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    response = httpx.post(gw.url + "/v1/completions", json={"prompt": "x"}, timeout=5)
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"


async def test_api_keys_and_body_limit(processes: Processes) -> None:
    replica = processes.start(stub())
    replica.wait_http("/load")
    gw = start_gateway(
        processes, "--backend", replica.url, "--api-key", "right", "--max-body-bytes", "2000"
    )
    wait_admitted(gw, "stub", 1, key="right")

    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="wrong") as client:
        with pytest.raises(openai.AuthenticationError):
            await client.completions.create(model="stub", prompt="x", max_tokens=1)
        with pytest.raises(openai.AuthenticationError):
            await client.models.list()
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="right") as client:
        out = await client.completions.create(model="stub", prompt="x", max_tokens=1)
        assert out.choices[0].text
        with pytest.raises(openai.APIStatusError) as err:
            await client.completions.create(model="stub", prompt="x" * 5000, max_tokens=1)
        assert err.value.status_code == 413
    assert "right" not in gw.logs() and "wrong" not in gw.logs()


async def test_no_ready_replica_is_503_and_full_queues_are_429(processes: Processes) -> None:
    # 5 waiting for one batch slot: one more would leave 5 queued, over the bound of 4
    full = processes.start(
        stub(model="busy", max_running_requests=1, max_queued_requests=4, report_waiting=5)
    )
    full.wait_http("/load")
    nowhere = f"http://127.0.0.1:{free_port()}"
    gw = start_gateway(
        processes,
        "--backend", f"ghost={nowhere}", "--backend", full.url, "--hold-timeout", "0.2",
    )  # fmt: skip
    wait_admitted(gw, "busy", 1)

    response = httpx.post(
        gw.url + "/v1/completions", json={"model": "ghost", "prompt": "x"}, timeout=5
    )
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert "no ready replica for model 'ghost'" in response.json()["error"]["message"]
    assert (
        'conveyor_gateway_pending_requests{model="ghost"} 0.0'
        in httpx.get(gw.url + "/metrics").text
    )

    response = httpx.post(
        gw.url + "/v1/completions", json={"model": "busy", "prompt": "x"}, timeout=5
    )
    assert response.status_code == 429
    assert response.headers["retry-after"] == "1"


async def test_a_client_that_goes_away_cancels_the_upstream_request(processes: Processes) -> None:
    replica = processes.start(stub(tokens=100000, token_interval_ms=20))
    replica.wait_http("/load")
    gw = start_gateway(processes, "--backend", replica.url)
    wait_admitted(gw, "stub", 1)

    async with httpx.AsyncClient(timeout=10) as client:
        for _ in range(5):
            body = {"model": "stub", "prompt": "x", "stream": True}
            async with client.stream("POST", gw.url + "/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for _chunk in response.aiter_raw():
                    break  # one chunk, then hang up
    wait_until(
        lambda: httpx.get(replica.url + "/load", timeout=5).json()["running"] == 0,
        30,
        "the replica to see every abandoned stream cancelled",
    )


async def test_a_killed_replica_loses_no_request_that_had_not_started_streaming(
    processes: Processes,
) -> None:
    replicas = [processes.start(stub(tokens=30, token_interval_ms=20)) for _ in range(3)]
    for replica in replicas:
        replica.wait_http("/load")
    gw = start_gateway(processes, *[arg for r in replicas for arg in ("--backend", r.url)])
    wait_admitted(gw, "stub", 3)
    victim = replicas[0]
    started_on_victim = asyncio.Event()

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, bool, BaseException | None]:
        received = 0
        try:
            stream = await client.completions.create(
                model="stub", prompt=f"user {i} " * 20, stream=True, max_tokens=30
            )
            async for chunk in stream:
                received += 1
                if chunk.choices[0].text.startswith(f"127.0.0.1:{victim.port}"):
                    started_on_victim.set()
            return received, True, None
        except openai.APIError as exc:
            return received, False, exc

    async with openai.AsyncOpenAI(
        base_url=gw.url + "/v1", api_key="unused", max_retries=0
    ) as client:
        first_wave = [asyncio.create_task(one(client, i)) for i in range(30)]
        async with asyncio.timeout(30):
            await started_on_victim.wait()
        victim.kill()
        second_wave = [asyncio.create_task(one(client, 100 + i)) for i in range(30)]
        results = await asyncio.gather(*first_wave, *second_wave)

    for received, ok, error in results:
        # A request either finished, or broke after its first chunk reached the client.
        assert ok or received > 0, f"request lost before streaming: {error!r}"
    assert all(ok for _, ok, _ in results[30:]), "requests sent after the kill must all succeed"
    assert sum(not ok for _, ok, _ in results[:30]) >= 1, "some streams were on the killed replica"
    metrics = httpx.get(gw.url + "/metrics", timeout=5).text
    assert f'conveyor_gateway_ejections_total{{backend="{victim.url}",model="stub"}}' in metrics


async def test_replicas_join_and_leave_through_the_backends_file(
    processes: Processes, tmp_path
) -> None:
    a, b = processes.start(stub(name="A")), processes.start(stub(name="B"))
    for replica in (a, b):
        replica.wait_http("/load")
    backends = tmp_path / "backends"

    def write(*urls: str) -> None:
        staged = tmp_path / "backends.new"
        staged.write_text("# replicas\n" + "".join(f"{u}\n" for u in urls))
        os.replace(staged, backends)  # atomic, as a ConfigMap update is

    write(a.url)
    gw = start_gateway(processes, "--backends-file", str(backends), "--routing", "round-robin")
    wait_admitted(gw, "stub", 1)

    def served_by(n: int) -> set[str]:
        return {
            httpx.post(gw.url + "/v1/completions", json={"model": "stub", "prompt": "x", "max_tokens": 1}, timeout=5).json()["choices"][0]["text"]
            for _ in range(n)
        }  # fmt: skip

    assert served_by(4) == {"A"}
    write(a.url, b.url)
    wait_admitted(gw, "stub", 2)
    assert served_by(4) == {"A", "B"}
    write(b.url)
    wait_until(
        lambda: [r["url"] for r in pools(gw)["stub"]["replicas"]] == [b.url], 30, "A to leave"
    )
    assert served_by(6) == {"B"}
    write()
    wait_until(lambda: "stub" not in pools(gw), 30, "the pool to go with its last replica")
    response = httpx.post(
        gw.url + "/v1/completions", json={"model": "stub", "prompt": "x"}, timeout=5
    )
    assert response.status_code == 404
