"""The load poller reads a vLLM replica through the engine adapter, at the same interval as a
Conveyor one: vLLM's /load is a document of its own (``{"server_load": n}``; SGLang has none,
404), so its /metrics is read, then and at every later poll."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
from aiohttp import web
from loopback import serve

from conveyor.contracts.engine_load import SGLANG, VLLM, Limits, load_from_metrics
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

    def engine(name: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            asked.append(f"{name}{request.path}")
            if name == "vllm":
                if request.path == "/metrics":
                    return web.Response(text=VLLM_TEXT)
                return web.json_response({"server_load": 0})  # vLLM's own /load
            if name == "sglang":
                if request.path == "/metrics":
                    return web.Response(text=SGLANG_TEXT)
                return web.json_response({"detail": "Not Found"}, status=404)
            if request.path == "/load":
                return web.json_response(CONVEYOR_LOAD)
            raise AssertionError(f"unexpected request {request.path}")

        return handler

    metrics = GatewayMetrics()

    async def run() -> str:
        async with contextlib.AsyncExitStack() as stack:
            urls = {n: await stack.enter_async_context(serve(engine(n)))
                    for n in ("vllm", "sglang", "conveyor")}  # fmt: skip
            registry = Registry(lambda _name: RoundRobin())
            registry.sync("test", {"m": set(urls.values())}, limits={"m": Limits(8, 5)})
            session = await stack.enter_async_context(aiohttp.ClientSession())
            poller = LoadPoller(
                registry=registry, session=session, metrics=metrics,
                interval_s=0.0, timeout_s=1.0, backend_api_key=None,
            )  # fmt: skip
            for _ in range(3):
                for replica in registry.replicas.values():
                    await poller._poll(replica)
            now = asyncio.get_running_loop().time()
            vllm = registry.replicas[urls["vllm"]]
            assert vllm.admitted(now)
            assert vllm.load == load_from_metrics(VLLM_TEXT, limits=Limits(8, 5))
            sglang = registry.replicas[urls["sglang"]].load
            assert sglang is not None and (sglang.running, sglang.waiting) == (3, 1)
            # the bounds the engines do not export are the pool's LLMService's ...
            assert (sglang.max_running_requests, sglang.max_queued_requests) == (8, 5)
            # ... and a Conveyor replica's are its own
            conveyor = registry.replicas[urls["conveyor"]].load
            assert conveyor is not None and conveyor.max_running_requests == 4
            assert conveyor.max_queued_requests is None
            return urls["vllm"]

    vllm_url = asyncio.run(run())
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
            {"model": "m", "backend": vllm_url, "signal": signal},
        )
        assert got == value, signal
    assert VLLM.running in VLLM_TEXT


def test_an_address_that_changes_engine_is_read_the_new_engines_way() -> None:
    """A pod IP reused by a Conveyor replica after a vLLM one: the poller, reading /metrics
    there, finds no engine's gauges and goes back to /load in the same poll."""
    engine = {"now": "vllm"}

    async def handler(request: web.Request) -> web.Response:
        if engine["now"] == "vllm":
            if request.path == "/metrics":
                return web.Response(text=VLLM_TEXT)
            return web.Response(status=404)
        if request.path == "/load":
            return web.json_response(CONVEYOR_LOAD)
        assert request.path == "/metrics"
        return web.Response(text="# TYPE conveyor_num_requests_running gauge\n")

    async def run() -> None:
        async with serve(handler) as url, aiohttp.ClientSession() as session:
            registry = Registry(lambda _name: RoundRobin())
            registry.sync("test", {"m": {url}})
            poller = LoadPoller(
                registry=registry, session=session, metrics=GatewayMetrics(),
                interval_s=0.0, timeout_s=1.0, backend_api_key=None,
            )  # fmt: skip
            replica = registry.replicas[url]
            await poller._poll(replica)
            assert replica.load == load_from_metrics(VLLM_TEXT)
            engine["now"] = "conveyor"
            await poller._poll(replica)
            assert replica.load is not None and replica.load.max_running_requests == 4

    asyncio.run(run())
