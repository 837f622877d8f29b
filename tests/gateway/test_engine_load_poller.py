"""The load poller reads a vLLM replica through the engine adapter, at the same interval as a
Conveyor one: vLLM's /load is a document of its own (``{"server_load": n}``; SGLang has none,
404), so its /metrics is read, then and at every later poll."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from conveyor.contracts.engine_load import SGLANG, VLLM, load_from_metrics
from conveyor.gateway.load_poller import LoadPoller
from conveyor.gateway.metrics import GatewayMetrics
from conveyor.gateway.pool import Registry
from conveyor.gateway.round_robin import RoundRobin

SGLANG_TEXT = "".join(
    f'# TYPE {name} gauge\n{name}{{model_name="m",tp_rank="0"}} {value}\n'
    for name, value in ((SGLANG.running, 3), (SGLANG.waiting, 1), (SGLANG.kv_cache_usage, 0.5))
)
"""SGLang's three load gauges under its own names (tests/unit/test_engine_load.py has its
fuller exposition, written from its metric definitions)."""
VLLM_TEXT = (
    Path(__file__).parent.parent / "unit" / "exposition" / "vllm-0.32.0-cpu.txt"
).read_text()
CONVEYOR_LOAD = {
    "running": 1, "waiting": 0, "kv_cache_usage": 0.1, "max_running_requests": 4,
    "max_queued_requests": None, "ready": True,
}  # fmt: skip


def test_vllm_replica_is_read_from_metrics_and_conveyor_from_load() -> None:
    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(f"{request.url.host}{request.url.path}")
        if request.url.host == "vllm":
            if request.url.path == "/metrics":
                return httpx.Response(200, text=VLLM_TEXT)
            return httpx.Response(200, json={"server_load": 0})  # vLLM's own /load
        if request.url.host == "sglang":
            if request.url.path == "/metrics":
                return httpx.Response(200, text=SGLANG_TEXT)
            return httpx.Response(404, json={"detail": "Not Found"})
        if request.url.path == "/load":
            return httpx.Response(200, json=CONVEYOR_LOAD)
        raise AssertionError(f"unexpected request {request.url}")

    metrics = GatewayMetrics()

    async def run() -> None:
        registry = Registry(lambda _name: RoundRobin())
        registry.sync("test", {"m": {"http://vllm", "http://sglang", "http://conveyor"}})
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            poller = LoadPoller(
                registry=registry, client=client, metrics=metrics,
                interval_s=0.0, timeout_s=1.0, backend_api_key=None,
            )  # fmt: skip
            for _ in range(3):
                for replica in registry.replicas.values():
                    await poller._poll(replica)
            now = asyncio.get_running_loop().time()
            vllm = registry.replicas["http://vllm"]
            assert vllm.admitted(now) and vllm.load == load_from_metrics(VLLM_TEXT)
            sglang = registry.replicas["http://sglang"].load
            assert sglang is not None and (sglang.running, sglang.waiting) == (3, 1)
            assert registry.replicas["http://conveyor"].load is not None
            assert registry.replicas["http://conveyor"].load.max_running_requests == 4

    asyncio.run(run())
    # one look at /load finds out, then /metrics only; the Conveyor replica only ever /load
    assert [a for a in asked if a.startswith("vllm")] == ["vllm/load"] + ["vllm/metrics"] * 3
    assert [a for a in asked if a.startswith("sglang")] == ["sglang/load"] + ["sglang/metrics"] * 3
    assert set(a for a in asked if a.startswith("conveyor")) == {"conveyor/load"}
    # the gateway's own gauges say what vLLM's say
    expected = load_from_metrics(VLLM_TEXT)
    for signal, value in (
        ("running", expected.running),
        ("waiting", expected.waiting),
        ("kv_cache_usage", expected.kv_cache_usage),
    ):
        got = metrics.registry.get_sample_value(
            "conveyor_gateway_backend_load",
            {"model": "m", "backend": "http://vllm", "signal": signal},
        )
        assert got == value, signal
    assert VLLM.running in VLLM_TEXT


def test_an_address_that_changes_engine_is_read_the_new_engines_way() -> None:
    """A pod IP reused by a Conveyor replica after a vLLM one: the poller, reading /metrics
    there, finds no engine's gauges and goes back to /load in the same poll."""
    engine = {"now": "vllm"}

    def handler(request: httpx.Request) -> httpx.Response:
        if engine["now"] == "vllm":
            if request.url.path == "/metrics":
                return httpx.Response(200, text=VLLM_TEXT)
            return httpx.Response(404)
        if request.url.path == "/load":
            return httpx.Response(200, json=CONVEYOR_LOAD)
        assert request.url.path == "/metrics"
        return httpx.Response(200, text="# TYPE conveyor_num_requests_running gauge\n")

    async def run() -> None:
        registry = Registry(lambda _name: RoundRobin())
        registry.sync("test", {"m": {"http://pod"}})
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            poller = LoadPoller(
                registry=registry, client=client, metrics=GatewayMetrics(),
                interval_s=0.0, timeout_s=1.0, backend_api_key=None,
            )  # fmt: skip
            replica = registry.replicas["http://pod"]
            await poller._poll(replica)
            assert replica.load == load_from_metrics(VLLM_TEXT)
            engine["now"] = "conveyor"
            await poller._poll(replica)
            assert replica.load is not None and replica.load.max_running_requests == 4

    asyncio.run(run())
