"""The autoscaler's timer: EndpointSlices, /load and /metrics in, scale, status, Events and
metrics out. Faked at the operator's own boundaries only (the Kube calls and the Scraper);
anything not prepared fails loudly (``autoscaler_fakes``)."""

from __future__ import annotations

import math

import httpx
import pytest
from autoscaler_fakes import (
    NS,
    World,
    endpoint_slice,
    gateway_metrics,
    llmservice,
    load,
    runtime_metrics,
    sample,
    ttft_metrics,
)

from conveyor.operator.autoscaler_model import Rates
from conveyor.operator.reconciler import llmservice_path


@pytest.fixture
def world() -> World:
    return World()


# ---- the tick ----------------------------------------------------------------------------


async def test_queue_builds_up_scales_in_one_step_with_status_event_and_metrics(world):
    w = world
    kube, scraper, metrics, events, clock, timer = (
        w.kube,
        w.scraper,
        w.metrics,
        w.events,
        w.clock,
        w.timer,
    )
    llmservice(kube, replicas=1)
    kube.slices = [
        endpoint_slice("tiny", 8000, ("tiny-a", "198.18.0.5", True)),
        endpoint_slice("conveyor-gateway", 8080, ("gw-a", "198.18.0.9", True)),
    ]
    scraper.pages = {
        "http://198.18.0.5:8000/load": load(waiting=7, running=8, kv=0.4),
        "http://198.18.0.5:8000/metrics": ttft_metrics(0.07),
        "http://198.18.0.9:8080/metrics": gateway_metrics(tiny=0),
    }
    decision = await timer.tick(NS, "tiny")
    assert decision is not None
    assert (decision.desired, decision.direction, decision.reason) == (4, "up", "queue-depth")
    assert kube.scales() == [4]
    status = kube.objects[llmservice_path(NS, "tiny")]["status"]["autoscaler"]
    assert status["desiredReplicas"] == 4 and status["reason"] == "queue-depth"
    assert status["signals"]["queueDepthPerReplica"] == 7.0
    assert status["signals"]["readyReplicas"] == 1 and "ttftP95Seconds" not in status["signals"]
    assert status["lastScaleTime"]
    assert [(k, r) for k, r, _ in events] == [("Normal", "ScaledUp")]
    assert "from 1 to 4" in events[0][2]
    assert sample(metrics, "conveyor_autoscaler_desired_replicas") == 4
    assert sample(metrics, "conveyor_autoscaler_ready_replicas") == 1
    assert sample(metrics, "conveyor_autoscaler_max_replicas") == 4
    assert sample(metrics, "conveyor_autoscaler_signal", signal="queue_depth_per_replica") == 7
    assert sample(metrics, "conveyor_autoscaler_target", signal="queue_depth_per_replica") == 2
    assert sample(metrics, "conveyor_autoscaler_target", signal="ttft_p95_seconds") == 1.0
    up = {"direction": "up", "reason": "queue-depth"}
    assert sample(metrics, "conveyor_autoscaler_decisions_total", **up) == 1

    # New replicas still loading (not in the ready endpoints): no further change, no event.
    clock.now += 2
    decision = await timer.tick(NS, "tiny")
    assert decision is not None and decision.direction == "none"
    assert kube.scales() == [4] and len(events) == 1


async def test_scale_down_after_the_window_and_a_silent_replica_does_not_freeze_it(world):
    w = world
    kube, scraper, events, clock, timer = w.kube, w.scraper, w.events, w.clock, w.timer
    llmservice(kube, replicas=3)
    kube.slices = [
        endpoint_slice(
            "tiny", 8000, ("a", "198.18.0.5", True), ("b", "198.18.0.6", True),
            ("c", "198.18.0.7", True),
        ),
        endpoint_slice("conveyor-gateway", 8080),
    ]  # fmt: skip
    for host in ("198.18.0.5", "198.18.0.6"):
        scraper.pages[f"http://{host}:8000/load"] = load()
        scraper.pages[f"http://{host}:8000/metrics"] = ttft_metrics()
    timeout = httpx.ConnectTimeout("no answer")
    scraper.pages["http://198.18.0.7:8000/load"] = timeout
    scraper.pages["http://198.18.0.7:8000/metrics"] = timeout
    decisions = []
    for _ in range(10):
        decisions.append(await timer.tick(NS, "tiny"))
        clock.now += 2
    assert kube.scales() == [1]  # after the 10 s window, not before; to min in one step (2 max)
    assert [d.direction for d in decisions].count("down") == 1
    assert decisions[0].direction == "none"
    assert events[-1][1] == "ScaledDown"


async def test_scale_from_zero_on_requests_held_by_any_gateway(world):
    w = world
    kube, scraper, clock, timer = w.kube, w.scraper, w.clock, w.timer
    llmservice(kube, replicas=0, minReplicas=0)
    kube.slices = [
        endpoint_slice("tiny", 8000),
        endpoint_slice(
            "conveyor-gateway", 8080, ("gw-a", "198.18.0.9", True), ("gw-b", "198.18.0.10", True)
        ),
    ]
    scraper.pages = {
        "http://198.18.0.9:8080/metrics": gateway_metrics(other=4),
        "http://198.18.0.10:8080/metrics": gateway_metrics(other=1),
    }
    decision = await timer.tick(NS, "tiny")
    assert decision is not None and (decision.desired, decision.reason) == (0, "scaled-to-zero")
    scraper.pages["http://198.18.0.10:8080/metrics"] = gateway_metrics(tiny=1)
    clock.now += 2
    decision = await timer.tick(NS, "tiny")
    assert decision is not None
    assert (decision.desired, decision.direction, decision.reason) == (1, "up", "pending-requests")
    assert kube.scales() == [1]
    status = kube.objects[llmservice_path(NS, "tiny")]["status"]["autoscaler"]
    assert status["signals"]["pendingRequests"] == 1


async def test_delete_and_disable_drop_the_state_and_series(world):
    w = world
    kube, metrics, timer = w.kube, w.metrics, w.timer
    llmservice(kube, replicas=1)
    kube.slices = [endpoint_slice("tiny", 8000), endpoint_slice("conveyor-gateway", 8080)]
    await timer.tick(NS, "tiny")
    assert timer.tracked == {(NS, "tiny")}
    assert sample(metrics, "conveyor_autoscaler_min_replicas") == 1
    kube.objects[llmservice_path(NS, "tiny")]["spec"]["autoscaling"]["enabled"] = False
    assert await timer.tick(NS, "tiny") is None
    assert timer.tracked == set()
    assert sample(metrics, "conveyor_autoscaler_min_replicas") is None
    assert sample(metrics, "conveyor_autoscaler_decisions_total", direction="none",
                  reason="no-ready-replica") is None  # fmt: skip
    del kube.objects[llmservice_path(NS, "tiny")]
    assert await timer.tick(NS, "tiny") is None


# ---- the kopf timer ----------------------------------------------------------------------


async def test_the_kopf_timer_runs_at_the_interval_setting_and_only_when_enabled(world):
    import kopf

    from conveyor.operator.handlers import register
    from conveyor.operator.settings import OperatorSettings

    registry = kopf.OperatorRegistry()
    register(
        registry,
        reconciler=object(),  # type: ignore[arg-type]  # not reached by the timer
        settings=OperatorSettings(autoscale_interval_s=3),
        autoscaler=world.timer,
    )
    timers = {h.id: h for h in registry._spawning.get_all_handlers()}
    assert timers["autoscale"].interval == 3
    llmservice(world.kube, replicas=1)
    world.kube.slices = [endpoint_slice("tiny", 8000), endpoint_slice("conveyor-gateway", 8080)]
    run = timers["autoscale"].fn
    spec = world.kube.objects[llmservice_path(NS, "tiny")]["spec"]
    await run(namespace=NS, name="tiny", spec=spec)
    assert world.timer.tracked == {(NS, "tiny")}
    await run(namespace=NS, name="tiny", spec={**spec, "autoscaling": {"enabled": False}})
    assert world.timer.tracked == set()  # turned off: state dropped, nothing scraped


# ---- demand and capacity -----------------------------------------------------------------


async def test_demand_capacity_and_utilization_in_status_and_metrics_and_remembered(world):
    w = world
    kube, scraper, metrics, clock, timer = w.kube, w.scraper, w.metrics, w.clock, w.timer
    llmservice(kube, replicas=1)
    kube.slices = [
        endpoint_slice("tiny", 8000, ("tiny-a", "198.18.0.5", True)),
        endpoint_slice("conveyor-gateway", 8080, ("gw-a", "198.18.0.9", True)),
    ]
    scraper.pages["http://198.18.0.9:8080/metrics"] = gateway_metrics(tiny=0)
    # One replica with a queue throughout, finishing 8 requests (800 tokens) a second.
    decisions = []
    for tick in range(6):
        scraper.pages["http://198.18.0.5:8000/load"] = load(waiting=1, running=8, kv=0.5)
        scraper.pages["http://198.18.0.5:8000/metrics"] = runtime_metrics(16 * tick, 1600 * tick)
        decisions.append(await timer.tick(NS, "tiny"))
        clock.now += 2
    first = decisions[0]
    assert first is not None and first.estimate is None  # no window yet: the next tick
    assert (first.direction, first.reason) == ("none", "measuring-demand")
    last = decisions[-1]
    assert last is not None and last.estimate is not None
    assert (last.desired, last.direction) == (1, "none")
    status = kube.objects[llmservice_path(NS, "tiny")]["status"]["autoscaler"]
    sig = status["signals"]
    assert sig["demandRequestsPerSecond"] == pytest.approx(8.0)
    assert sig["demandTokensPerSecond"] == pytest.approx(800.0)
    assert sig["utilization"] == pytest.approx(1.0) and sig["panic"] is False
    assert sig["replicasNeeded"] == pytest.approx(1.0 + 1 / (30 * 8), abs=1e-3)
    # a steady load: the panic window reads what the demand window does
    assert sig["burstRequestsPerSecond"] == pytest.approx(8.0)
    assert sig["burstReplicasNeeded"] == pytest.approx(sig["replicasNeeded"], abs=1e-3)
    capacity = status["capacity"]
    assert (capacity["requestsPerSecond"], capacity["tokensPerSecond"], capacity["source"]) == (
        8.0,
        800.0,
        "measured",
    )
    assert capacity["lastMeasuredTime"]

    def signal(name: str) -> float | None:
        return sample(metrics, "conveyor_autoscaler_signal", signal=name)

    assert signal("demand_requests_per_second") == pytest.approx(8.0)
    assert signal("capacity_requests_per_second") == pytest.approx(8.0)
    assert signal("capacity_tokens_per_second") == pytest.approx(800.0)
    assert signal("utilization") == pytest.approx(1.0)
    assert sample(metrics, "conveyor_autoscaler_target", signal="utilization") == 1.0

    # An operator restart: a new timer reads the capacity back from status.
    again = World(kube=kube, scraper=scraper, clock=clock)
    for tick in range(6, 8):
        scraper.pages["http://198.18.0.5:8000/metrics"] = runtime_metrics(16 * tick, 1600 * tick)
        decision = await again.timer.tick(NS, "tiny")
        clock.now += 2
    assert decision is not None and decision.estimate is not None
    assert decision.estimate.capacity_source == "status"
    assert decision.estimate.capacity == Rates(8.0, 800.0)


async def test_a_replica_without_counters_gives_no_demand(world):
    w = world
    llmservice(w.kube, replicas=1)
    w.kube.slices = [
        endpoint_slice("tiny", 8000, ("tiny-a", "198.18.0.5", True)),
        endpoint_slice("conveyor-gateway", 8080),
    ]
    w.scraper.pages["http://198.18.0.5:8000/load"] = load(waiting=1, running=1)
    w.scraper.pages["http://198.18.0.5:8000/metrics"] = ttft_metrics()
    for _ in range(4):
        decision = await w.timer.tick(NS, "tiny")
        w.clock.now += 2
    assert decision is not None and decision.estimate is None
    status = w.kube.objects[llmservice_path(NS, "tiny")]["status"]["autoscaler"]
    assert "demandRequestsPerSecond" not in status["signals"] and "capacity" not in status
    assert math.isnan(sample(w.metrics, "conveyor_autoscaler_signal", signal="utilization"))


def _one_ready_replica(w) -> None:
    llmservice(w.kube, replicas=1)
    w.kube.slices = [endpoint_slice("tiny", 8000, ("tiny-a", "198.18.0.5", True))]
    w.scraper.pages = {
        "http://198.18.0.5:8000/load": load(waiting=0, running=1),
        "http://198.18.0.5:8000/metrics": runtime_metrics(10, 1000),
    }


async def test_the_start_time_is_read_from_the_ready_pods_once(world):
    from conveyor.operator.names import runtime_selector

    w = world
    _one_ready_replica(w)
    labels = runtime_selector("tiny")
    w.kube.pods = [
        {"metadata": {"name": "tiny-a", "labels": labels,
                      "creationTimestamp": "2026-12-06T01:00:00Z"},
         "status": {"conditions": [{"type": "Ready", "status": "True",
                                    "lastTransitionTime": "2026-12-06T01:00:11Z"}]}},
        {"metadata": {"name": "other", "labels": {**labels, "conveyor.dev/llmservice": "x"},
                      "creationTimestamp": "2026-12-06T01:00:00Z"},
         "status": {"conditions": [{"type": "Ready", "status": "True",
                                    "lastTransitionTime": "2026-12-06T01:01:00Z"}]}},
    ]  # fmt: skip
    await w.timer.tick(NS, "tiny")
    state = w.timer._states[(NS, "tiny")]
    assert state.history.start_time == 11.0
    w.kube.pods = AssertionError("read once: the autoscaler's own starts refine it after")
    w.clock.now += 1
    await w.timer.tick(NS, "tiny")
    assert state.history.start_time == 11.0


async def test_a_forbidden_pods_list_is_not_fatal_and_not_retried_every_tick(world):
    from conveyor.operator.kube import ApiError

    w = world
    _one_ready_replica(w)
    w.kube.pods = ApiError("GET", "/api/v1/namespaces/team/pods", 403, "forbidden")
    assert await w.timer.tick(NS, "tiny") is not None
    state = w.timer._states[(NS, "tiny")]
    assert state.history.start_time is None  # not readable: learned on scaling instead
    w.kube.pods = AssertionError("not asked again")
    w.clock.now += 1
    assert await w.timer.tick(NS, "tiny") is not None
