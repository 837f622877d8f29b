"""Every dashboard panel checked the way Grafana would use it, after a real run.

Real runtime replicas (``conveyor serve``, the built-in model) behind a real gateway on
loopback, scraped by a real Prometheus. The run injects what the quiet panels show: a
replica with a tiny KV cache (preemptions), streams cut by the client (aborts, 499), a burst
over the replicas' queue bound (429), a replica killed under load (retries, ejections). Then
each panel query, with its variables resolved from ``label_values`` and ``$__rate_interval``
substituted as Grafana does, is evaluated over the run's range and must return series with
the labels its legend uses.

This tier has no Kubernetes: Prometheus scrapes static targets carrying the labels that
Kubernetes discovery gives on a cluster (e2e/test_dashboards_cluster.py does the same with
discovery through the apiserver), and no operator, so the Autoscaler dashboard is checked
there, not here.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from conveyor.observability import dashboards, names, panel_check
from conveyor.observability.panel_check import AllowedEmpty
from conveyor.observability.prometheus import Prometheus, PrometheusSettings, StaticTarget
from conveyor.observability.render import render_dashboard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))
from gateway_helpers import PYTHON, Process, Processes

from conveyor.bench.procs import free_port
from conveyor.bench.wait import wait_until
from conveyor.gateway.metrics import BACKEND_IN_FLIGHT
from conveyor.runtime.metrics_names import (
    KV_CACHE_USAGE,
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("torch") is None,
        reason="needs the runtime server (`conveyor serve`) and torch",
    ),
]

MODEL = "conveyor-tiny"
NAMESPACE = "loopback"
LLMSERVICE = "tiny"
SCRAPE_S = 1.0
RENDER_DIR = Path(__file__).resolve().parents[2] / "build" / "dashboards"
"""Where the test leaves its renders (build/ is ignored by git), to be looked at."""

ALLOWED_EMPTY = (
    AllowedEmpty(
        "Time to first token",
        names.AS_TARGET,
        "the TTFT target comes from the operator's autoscaler, which this tier does not run "
        "(checked in e2e with the operator)",
        must_exist=False,
    ),
    AllowedEmpty(
        "Requests held for a replica",
        names.GW_PENDING,
        "requests are held only while a model has no ready replica (scale from zero); this run "
        "always has replicas (e2e/test_dashboards_cluster.py holds some)",
    ),
)
"""The panel queries that may draw nothing here, and why."""


NEEDS_OPERATOR = {"autoscaler.json": "its series come from the operator's autoscaler"}
"""Dashboards this tier cannot check, and why (e2e checks them with the operator running)."""


def runtime(port: int, *extra: str) -> Process:
    argv = [PYTHON, "-m", "conveyor.cli", "serve", "--model", MODEL, "--host", "127.0.0.1",
            "--port", str(port), "--num-threads", "1", *extra]  # fmt: skip
    return Process(f"runtime-{port}", argv, port)


def gateway(port: int, backends: list[str]) -> Process:
    argv = [PYTHON, "-m", "conveyor.cli", "gateway", "--host", "127.0.0.1", "--port", str(port),
            "--load-poll-interval", "0.1", "--routing", "least-load",
            *[a for b in backends for a in ("--backend", b)]]  # fmt: skip
    return Process(f"gateway-{port}", argv, port)


@pytest.fixture(scope="module")
def stack(prometheus_binary: Path) -> Iterator[dict]:
    owner = Processes()
    normal = (
        "--max-total-tokens",
        "4096",
        "--max-running-requests",
        "4",
        "--max-queued-requests",
        "3",
    )
    # Every replica has a queue bound, so a burst larger than all of them together gets 429s
    # whichever way the gateway spreads it.
    tiny_kv = (
        "--max-total-tokens", "256", "--max-model-len", "256", "--max-running-requests", "8",
        "--max-queued-requests", "3",
    )  # fmt: skip
    pods = {
        f"{LLMSERVICE}-0": runtime(free_port(), *normal),
        f"{LLMSERVICE}-1": runtime(free_port(), *normal),
        f"{LLMSERVICE}-tiny-kv": runtime(free_port(), *tiny_kv),
        f"{LLMSERVICE}-doomed": runtime(free_port(), *normal),
    }
    gw = gateway(free_port(), [p.url for p in pods.values()])
    targets = [
        StaticTarget(f"127.0.0.1:{p.port}", NAMESPACE, name, "runtime", LLMSERVICE)
        for name, p in pods.items()
    ] + [StaticTarget(f"127.0.0.1:{gw.port}", NAMESPACE, "conveyor-gateway-0", "gateway")]
    settings = PrometheusSettings(
        binary=prometheus_binary,
        scrape_interval_s=SCRAPE_S,
        evaluation_interval_s=SCRAPE_S,
        static_targets=tuple(targets),
    )
    try:
        with Prometheus(settings) as prom:
            for p in pods.values():
                owner.start(p)
            for p in pods.values():
                p.wait_http("/ready", timeout=300)
            owner.start(gw).wait_http("/health")
            yield {"pods": pods, "gateway": gw, "prometheus": prom, "owner": owner}
    finally:
        owner.stop_all()
        for p in owner.all:
            p.log_path.unlink(missing_ok=True)


async def _run_load(stack: dict) -> None:
    gw: Process = stack["gateway"]
    pods: dict[str, Process] = stack["pods"]

    def admitted() -> int:
        try:
            pools = httpx.get(gw.url + "/debug/pools", timeout=5).json()
        except httpx.HTTPError:
            return -1
        return sum(r["admitted"] for r in pools.get(MODEL, {}).get("replicas", []))

    wait_until(lambda: admitted() == len(pods), 60, "every replica admitted by the gateway")
    shared = "You are a helpful assistant of the conveyor belt factory. " * 3
    async with openai.AsyncOpenAI(
        base_url=gw.url + "/v1", api_key="unused", max_retries=0
    ) as client:

        async def one(i: int, stream: bool, max_tokens: int = 24) -> None:
            with contextlib.suppress(openai.APIError):
                if stream:
                    chunks = await client.chat.completions.create(
                        model=MODEL, stream=True, max_tokens=max_tokens,
                        messages=[{"role": "user", "content": f"{shared} question {i}"}],
                    )  # fmt: skip
                    async for _ in chunks:
                        pass
                else:
                    await client.completions.create(
                        model=MODEL, prompt=f"{shared} item {i}", max_tokens=max_tokens
                    )

        async def cut(i: int) -> None:
            # the client reads two chunks and goes away: an abort on the replica, 499 at the gateway
            stream = await client.completions.create(
                model=MODEL, prompt=f"story {i}", stream=True, max_tokens=100
            )
            received = 0
            async for _ in stream:
                received += 1
                if received == 2:
                    break
            await stream.close()

        # steady traffic with shared prefixes (prefix-cache hits), streamed and not
        for start in range(0, 32, 8):
            await asyncio.gather(*(one(i, stream=i % 2 == 0) for i in range(start, start + 8)))
        # A gauge is seen only if a scrape falls while it is up: on a busy machine every short
        # request of a phase can fall between two scrapes, so such a phase goes on in waves
        # until Prometheus has seen the gauge above zero (the panel's own condition).
        api = stack["prometheus"].api()

        async def until_seen(
            metrics: tuple[str, ...], wave: Callable[[int], Awaitable[object]]
        ) -> None:
            seen = [f'max_over_time({m}{{namespace="{NAMESPACE}"}}[5m]) > 0' for m in metrics]
            done = asyncio.Event()

            async def waves() -> None:
                n = 0
                while not done.is_set():
                    await wave(n)
                    n += 1

            load = asyncio.create_task(waves())
            try:
                await asyncio.to_thread(
                    wait_until, lambda: all(api.query(q) for q in seen), 120, f"{metrics} > 0"
                )
            finally:
                done.set()
                await load

        # requests in flight at the gateway and running on the replicas: longer generations
        gauges = (BACKEND_IN_FLIGHT, NUM_REQUESTS_RUNNING, KV_CACHE_USAGE)
        await until_seen(gauges, lambda n: asyncio.gather(
            *(one(400 + 8 * n + i, stream=True, max_tokens=200) for i in range(8))))  # fmt: skip
        await asyncio.gather(*(cut(i) for i in range(4)))
        # the tiny-KV replica alone gets long concurrent generations: preemptions
        async with openai.AsyncOpenAI(
            base_url=pods[f"{LLMSERVICE}-tiny-kv"].url + "/v1", api_key="unused", max_retries=0
        ) as direct:

            async def long(i: int) -> None:
                await direct.completions.create(model=MODEL, prompt=f"long {i} " * 4, max_tokens=60)

            await asyncio.gather(*(long(i) for i in range(6)))
        # a burst over the queue bounds: 429s, and requests waiting on the replicas
        await until_seen((NUM_REQUESTS_WAITING,), lambda n: asyncio.gather(
            *(one(100 + 96 * n + i, stream=False, max_tokens=48) for i in range(96))))  # fmt: skip
        # a replica killed under load: retries before the first byte, an ejection
        doomed = pods[f"{LLMSERVICE}-doomed"]
        killed = asyncio.Event()

        async def under_load() -> None:
            # Waves until the replica is killed and ejected: one wave can reach the doomed
            # replica and finish between two polls (a fresh-clone run saw none of 24 there).
            wave = 0
            while not killed.is_set():
                await asyncio.gather(
                    *(one(200 + 24 * wave + i, stream=True, max_tokens=32) for i in range(24))
                )
                wave += 1

        load = asyncio.create_task(under_load())
        async with httpx.AsyncClient() as poll:

            async def serving_and_admitted() -> bool:
                # Ejections count replicas the gateway had admitted: one whose /load poll timed
                # out under the burst above is unknown, not admitted, and its death uncounted.
                if (await poll.get(doomed.url + "/load")).json()["running"] == 0:
                    return False
                pools = (await poll.get(gw.url + "/debug/pools", timeout=5)).json()
                return any(
                    r["url"] == doomed.url and r["admitted"]
                    for pool in pools.values()
                    for r in pool["replicas"]
                )

            deadline = time.monotonic() + 60
            while not await serving_and_admitted():
                assert time.monotonic() < deadline, (
                    "no request reached the replica to kill while the gateway admitted it"
                )
            doomed.kill()

            async def ejected() -> bool:
                # counted when the gateway takes it out of routing, by a refused request or a
                # failed /load poll, whichever comes first; the panel needs it before the last
                # requests, so a scrape before the end of the range holds it
                pools = (await poll.get(gw.url + "/debug/pools", timeout=5)).json()
                return not any(
                    r["url"] == doomed.url and r["admitted"]
                    for pool in pools.values()
                    for r in pool["replicas"]
                )

            deadline = time.monotonic() + 60
            while not await ejected():
                assert time.monotonic() < deadline, "the gateway never ejected the killed replica"
            killed.set()
        await load
        await asyncio.gather(*(one(300 + i, stream=i % 2 == 0) for i in range(8)))


@pytest.fixture(scope="module")
def run(stack: dict) -> dict:
    start = time.time() - 5
    asyncio.run(_run_load(stack))
    end_of_load = time.time()
    prom: Prometheus = stack["prometheus"]
    # every live target scraped after the last request (the killed one is down), and one more
    # scrape interval: the range's last evaluation step (1 s here) falls after that scrape
    wait_until(
        lambda: panel_check.scraped_after(
            prom.api(), NAMESPACE, end_of_load + 2 * SCRAPE_S, at_least=len(stack["pods"])
        ),
        60,
        "a scrape after the load",
    )
    return {"start": start, "end": time.time(), "prometheus": prom}


def test_the_run_showed_the_injected_events(run: dict) -> None:
    api = run["prometheus"].api()
    codes = {
        s["metric"].get("code")
        for s in api.query_range(
            f"sum by (code) ({names.GW_REQUESTS})", run["start"], run["end"], SCRAPE_S
        )
    }
    assert {"200", "429", "499"} <= codes, codes
    for metric in (names.PREEMPTIONS, names.GW_RETRIES, names.GW_EJECTIONS):
        assert api.query(f"sum({metric}) > 0", run["end"]), f"the run shows no {metric}"


@pytest.mark.parametrize("name", ["llmservice-overview.json", "gateway.json"])
def test_every_panel_query_returns_labelled_series(run: dict, name: str) -> None:
    check = panel_check.check_dashboard(
        name,
        run["prometheus"].api(),
        run["start"],
        run["end"],
        scrape_interval_s=SCRAPE_S,
        allowed=ALLOWED_EMPTY,
    )
    print(f"\n[figures] {check.figures()}", file=sys.stderr)
    assert not check.failures, "\n".join(check.failures)


def test_autoscaler_dashboard_is_left_to_the_operator_tier() -> None:
    # listed, not forgotten: e2e/test_dashboards_cluster.py checks it with the operator
    assert set(NEEDS_OPERATOR) == set(dashboards.all_json()) - {
        "llmservice-overview.json",
        "gateway.json",
    }


def test_render_draws_every_panel(run: dict) -> None:
    api = run["prometheus"].api()
    for name in ("llmservice-overview.json", "gateway.json"):
        out = RENDER_DIR / name.replace(".json", ".png")
        rendered = render_dashboard(
            panel_check.committed(name),
            api,
            run["start"],
            run["end"],
            out,
            scrape_interval_s=SCRAPE_S,
        )
        assert out.stat().st_size > 10_000
        empty = panel_check.unexplained_empty(rendered, ALLOWED_EMPTY)
        assert not empty, f"{name}: no data in {empty}"
        print(f"\nrendered {out}")
