"""The autoscaling loop on loopback: a real gateway, real runtime replicas (``conveyor serve``,
built-in model) and the operator's autoscaler timer, with only the Kubernetes API faked.

The test plays the kubelet: when the timer writes the scale subresource it starts a replica
and lists it in the runtime's EndpointSlices once it answers ``/ready``. The timer's clock is
the test's, advanced one interval per tick, so stabilization windows pass without sleeping.
The cluster version of these tests is ``e2e/test_autoscaling.py``.
"""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

import httpx
import openai
import pytest
from gateway_helpers import PYTHON, Process, Processes, gateway

from conveyor.bench.procs import free_port
from conveyor.bench.wait import wait_until
from conveyor.operator.autoscaler_observe import MIN_TTFT_OBSERVATIONS
from conveyor.operator.autoscaler_timer import AutoscalerTimer, HttpScraper
from conveyor.operator.metrics import OperatorMetrics

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None
    or importlib.util.find_spec("conveyor.runtime.server.cli") is None,
    reason="needs the runtime server (`conveyor serve`) and torch",
)

NS = "team"


class LoopbackKube:
    """The operator's Kube boundary for one LLMService whose gateway and replicas listen on
    loopback ports (one EndpointSlice per port); scale patches are recorded."""

    def __init__(self, gateway_port: int, replicas: int, **autoscaling: Any) -> None:
        self.llmservice = {
            "apiVersion": "conveyor.dev/v1alpha1",
            "kind": "LLMService",
            "metadata": {"name": "tiny", "namespace": NS, "uid": "u1"},
            "spec": {
                "model": {"builtin": "conveyor-tiny"},
                "replicas": replicas,
                "autoscaling": {"enabled": True, **autoscaling},
            },
        }
        self.gateway = [self._slice(gateway_port)]
        self.runtime: dict[int, dict] = {}
        self.scales: list[int] = []

    @staticmethod
    def _slice(port: int) -> dict:
        return {
            "ports": [{"name": "http", "port": port}],
            "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True}}],
        }

    def ready(self, port: int) -> None:
        self.runtime[port] = self._slice(port)

    def gone(self, port: int) -> None:
        self.runtime.pop(port, None)

    async def get(self, path: str) -> dict:
        assert path.endswith("/llmservices/tiny"), path
        return self.llmservice

    async def list(self, path: str, *, label_selector: str | None = None) -> list[dict]:
        if path.endswith("/pods"):
            return []  # the replicas are processes here: no pod says how long one took to start
        assert path.endswith("/endpointslices") and label_selector, (path, label_selector)
        service = label_selector.rpartition("=")[2]
        return self.gateway if service == "conveyor-gateway" else list(self.runtime.values())

    async def merge_patch(self, path: str, patch: dict) -> dict:
        if path.endswith("/scale"):
            self.scales.append(patch["spec"]["replicas"])
            self.llmservice["spec"]["replicas"] = patch["spec"]["replicas"]
        else:
            assert path.endswith("/status"), path
            self.llmservice["status"] = patch["status"]
        return self.llmservice


def wait_pending(gw: Process, count: int) -> None:
    """Until the gateway reports ``count`` requests held for the model."""
    line = f'conveyor_gateway_pending_requests{{model="tiny"}} {float(count)}'
    wait_until(lambda: line in httpx.get(gw.url + "/metrics", timeout=5).text, 30, line)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def runtime(port: int) -> Process:
    argv = [PYTHON, "-m", "conveyor.cli", "serve", "--model", "conveyor-tiny",
            "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
            "--num-threads", "1", "--max-total-tokens", "8192",
            "--max-running-requests", "2"]  # fmt: skip
    return Process(f"runtime-{port}", argv, port)


def start_gateway(processes: Processes, *args: str) -> Process:
    gw = processes.start(gateway(*args))
    gw.wait_http("/health")
    return gw


def make_timer(kube: LoopbackKube, clock: Clock, events: list[str]) -> AutoscalerTimer:
    return AutoscalerTimer(
        kube=kube,  # type: ignore[arg-type]
        scraper=HttpScraper(timeout_s=5),
        metrics=OperatorMetrics(),
        post_event=lambda obj, kind, reason, message: events.append(f"{reason}: {message}"),
        clock=clock,
    )


async def test_the_autoscaler_scales_from_zero_for_a_held_request(processes: Processes) -> None:
    """Gateway holds -> the timer sees the pending count and scales 0 -> 1 -> the replica
    starts -> the held request is answered -> the timer reads its real /load and TTFT."""
    port = free_port()
    gw = start_gateway(processes, "--backend", f"tiny=http://127.0.0.1:{port}")
    kube = LoopbackKube(gw.port, replicas=0, minReplicas=0, maxReplicas=2)
    events: list[str] = []
    timer = make_timer(kube, Clock(), events)
    try:
        decision = await timer.tick(NS, "tiny")
        assert decision is not None and decision.reason == "scaled-to-zero"
        async with openai.AsyncOpenAI(
            base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=300
        ) as client:
            held = asyncio.create_task(
                client.completions.create(model="tiny", prompt="wake up", max_tokens=4)
            )
            await asyncio.to_thread(wait_pending, gw, 1)
            decision = await timer.tick(NS, "tiny")
            assert decision is not None
            assert (decision.desired, decision.reason) == (1, "pending-requests")
            assert kube.scales == [1] and "from 0 to 1" in events[0]

            replica = processes.start(runtime(port))
            answer = await held  # released as soon as the replica said ready
            assert answer.choices and answer.choices[0].text is not None

            kube.ready(port)
            await timer.tick(NS, "tiny")  # the replica's TTFT histogram: a baseline
            for _ in range(MIN_TTFT_OBSERVATIONS):  # enough first tokens for a TTFT signal
                await client.completions.create(model="tiny", prompt="again", max_tokens=2)
        decision = await timer.tick(NS, "tiny")
        assert decision is not None and decision.desired == 1 and replica.alive()
        signals = kube.llmservice["status"]["autoscaler"]["signals"]
        assert signals["readyReplicas"] == 1
        assert signals["ttftP95Seconds"] > 0  # from the real runtime's histogram delta
    finally:
        await timer.scraper.close()  # type: ignore[attr-defined]


async def test_queued_load_adds_a_replica_and_idle_removes_it(processes: Processes) -> None:
    """Load queues on one replica -> the timer scales to 2 -> the new replica serves -> the
    queue per replica falls -> load stops -> after the window, back to 1; no request fails."""
    first, second = free_port(), free_port()
    replicas = {first: processes.start(runtime(first))}
    replicas[first].wait_http("/ready", timeout=180)
    gw = start_gateway(
        processes,
        "--routing", "least-load",
        "--backend", f"tiny=http://127.0.0.1:{first}",
        "--backend", f"tiny=http://127.0.0.1:{second}",
    )  # fmt: skip
    kube = LoopbackKube(
        gw.port, replicas=1, minReplicas=1, maxReplicas=2, targetQueueDepthPerReplica=2,
        scaleDownStabilizationSeconds=10,
    )  # fmt: skip
    kube.ready(first)
    clock, events = Clock(), []
    timer = make_timer(kube, clock, events)

    async def tick() -> Any:
        clock.now += 1.0
        decision = await timer.tick(NS, "tiny")
        assert decision is not None
        return decision

    stop = asyncio.Event()
    failures: list[str] = []
    answered = 0

    async def client_loop(client: openai.AsyncOpenAI, i: int) -> None:
        nonlocal answered
        while not stop.is_set():
            try:
                out = await client.completions.create(
                    model="tiny", prompt=f"load {i}", max_tokens=16
                )
                assert out.choices
                answered += 1
            except Exception as exc:  # every failure is recorded and fails the test
                failures.append(f"{type(exc).__name__}: {exc}")
                return  # and ends this client: once the test's client is closed (an assertion
                # failed), a loop that went on would fail at once, never yield, and hang the run

    try:
        async with openai.AsyncOpenAI(
            base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=300
        ) as client:
            load = [asyncio.create_task(client_loop(client, i)) for i in range(10)]
            # queue builds on the single replica: the timer asks for 2 (max) in one step, from
            # demand over capacity or, in a closed loop like this one, the queue target
            for _ in range(600):
                decision = await tick()
                if decision.direction == "up":
                    break
                await asyncio.sleep(0.1)  # let the load build; the tick is the condition
            assert decision.desired == 2
            assert decision.reason in ("demand", "panic", "queue-depth"), decision.reason
            assert kube.scales == [2]

            replicas[second] = processes.start(runtime(second))
            await asyncio.to_thread(replicas[second].wait_http, "/ready", 180)
            kube.ready(second)
            seen_two = False
            for _ in range(600):
                decision = await tick()
                signals = kube.llmservice["status"]["autoscaler"]["signals"]
                seen_two = seen_two or signals["readyReplicas"] == 2
                if seen_two and signals["queueDepthPerReplica"] <= 2:
                    break
                await asyncio.sleep(0.1)
            assert seen_two and signals["queueDepthPerReplica"] <= 2
            assert kube.scales == [2]  # no flapping while loaded

            stop.set()
            await asyncio.gather(*load)
        # Idle now: one step down once every hold has passed. A scale-up that the panic window
        # made (a loaded machine's burst) holds scale-downs for a demand window (60 s of the
        # test's clock), one from the queue target only for the scale-down window (10 s).
        decisions = []
        for _ in range(90):
            decisions.append(await tick())
            if decisions[-1].direction == "down":
                break
        decisions += [await tick() for _ in range(15)]  # and it stays down
        assert kube.scales == [2, 1], [(d.direction, d.reason, d.held_by) for d in decisions]
        assert [d.direction for d in decisions].count("down") == 1
        assert failures == [] and answered > 0
        assert [e.split(":")[0] for e in events] == ["ScaledUp", "ScaledDown"]
    finally:
        stop.set()
        await timer.scraper.close()  # type: ignore[attr-defined]
