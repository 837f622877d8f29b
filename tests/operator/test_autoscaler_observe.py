"""What the autoscaler's timer reads before it decides: the ready endpoints of EndpointSlices,
a replica's /load, the gateways' pending requests, the counters and the TTFT window of
/metrics, and the observation built from them. Pure functions, no timer."""

from __future__ import annotations

import pytest
from autoscaler_fakes import endpoint_slice, gateway_metrics, load, runtime_metrics, ttft_metrics
from prometheus_client import CollectorRegistry, Counter, generate_latest

from conveyor.operator.autoscaler_model import History, ReplicaSignals
from conveyor.operator.autoscaler_observe import (
    Endpoint,
    ReplicaScrape,
    ServiceState,
    build_observation,
    gateway_counts,
    parse_load,
    ready_endpoints,
)
from conveyor.runtime.metrics_names import REQUEST_SUCCESS


def test_ready_endpoints_skip_unready_and_terminating_and_use_the_named_port():
    slices = [
        endpoint_slice("tiny", 8000, ("p1", "198.18.0.5", True), ("p2", "198.18.0.6", False)),
        endpoint_slice("tiny", 8000, ("p3", "198.18.0.7", None), ("p1", "198.18.0.5", True)),
        {"metadata": {}, "ports": [{"name": "metrics", "port": 9}], "endpoints": []},
    ]
    slices[1]["endpoints"].append(
        {"addresses": ["198.18.0.8"], "conditions": {"ready": True, "terminating": True}}
    )
    assert ready_endpoints(slices, "http") == [
        Endpoint("p1", "http://198.18.0.5:8000"),
        Endpoint("p3", "http://198.18.0.7:8000"),
    ]


def test_load_and_pending_parsing():
    signals, ready = parse_load(load(waiting=3, running=2, kv=0.5))
    assert (signals, ready) == (ReplicaSignals(3, 2, 8, 0.5), True)
    assert parse_load(load(ready=False))[1] is False
    with pytest.raises(ValueError, match="waiting"):
        parse_load('{"running": 1}')
    assert gateway_counts(gateway_metrics(tiny=3, other=5), "tiny").held == 3
    assert gateway_counts(gateway_metrics(other=5), "tiny").held == 0


def test_ttft_p95_is_over_the_window_not_lifetime_totals():
    state = ServiceState(history=History())
    one = Endpoint("p1", "http://a:8000")
    ok = [ReplicaSignals(0, 1, 8, 0.1)]
    counts = {"fast": 0, "slow": 0}

    def observe(now: float, fast: int = 0, slow: int = 0):
        counts["fast"] += fast
        counts["slow"] += slow
        ttfts = [0.07] * counts["fast"] + [3.0] * counts["slow"]
        scrape = ReplicaScrape(one, ok[0], True, _buckets(ttft_metrics(*ttfts)))
        return build_observation(
            now=now, current_replicas=1, replicas=[scrape], pending=0, state=state, ttft_window=30
        )

    assert observe(0, fast=100).ttft_p95 is None  # first scrape: a baseline, not a window
    # 100 fast then 50 slow within the window: p95 among 150, not among the lifetime 250
    assert observe(10, fast=100).ttft_p95 == pytest.approx(0.0975, abs=0.01)
    obs = observe(20, slow=50)
    assert obs.ttft_p95 is not None and obs.ttft_p95 > 2.5
    # one slow first token among few is not a signal
    assert observe(60, slow=1).ttft_p95 is None
    # the slow ones age out of the window: only the fast ones since count
    assert observe(85, fast=40).ttft_p95 == pytest.approx(0.0975, abs=0.01)
    # nothing new over a whole window: no TTFT (not the lifetime p95)
    observe(120)
    assert observe(151).ttft_p95 is None
    # the replica restarted (counts went down): its new counts are its own window
    counts.update(fast=0, slow=0)
    assert observe(152, fast=12).ttft_p95 == pytest.approx(0.0975, abs=0.01)


def test_loading_or_silent_replicas_are_not_counted_as_ready():
    state = ServiceState()
    scrapes = [
        ReplicaScrape(Endpoint("p1", "u1"), ReplicaSignals(4, 8, 8, 0.3), True, None),
        ReplicaScrape(Endpoint("p2", "u2"), ReplicaSignals(0, 0, 8, 0.0), False, None),
        ReplicaScrape(Endpoint("p3", "u3"), None, False, None),
    ]
    obs = build_observation(now=0, current_replicas=3, replicas=scrapes, pending=2, state=state)
    assert obs.num_ready == 1 and obs.waiting == 4 and obs.pending_requests == 2


def _buckets(text: str):
    from conveyor.operator.signals import parse_histogram

    return parse_histogram(text)


def test_counters_are_read_from_the_runtime_and_gateway_metrics():
    from conveyor.gateway.metrics import GatewayMetrics
    from conveyor.operator.signals import parse_counters

    assert parse_counters(runtime_metrics(12, 1000)) == (12.0, 1000.0)
    assert parse_counters(ttft_metrics(0.1)) is None  # another engine: no demand from it
    registry = CollectorRegistry()  # a replica that finished nothing yet: declared, no sample
    Counter(REQUEST_SUCCESS.removesuffix("_total"), "done", ["model", "finish_reason"],
            registry=registry)  # fmt: skip
    assert parse_counters(generate_latest(registry).decode()) == (0.0, 0.0)
    gateway = GatewayMetrics()
    gateway.requests.labels("tiny", "", "429").inc(3)
    gateway.requests.labels("tiny", "http://a:8000", "503").inc(2)
    gateway.requests.labels("tiny", "http://a:8000", "200").inc(50)
    gateway.requests.labels("other", "", "429").inc(7)
    assert gateway_counts(generate_latest(gateway.registry).decode(), "tiny").rejected == 5.0


def runtime_pod(name: str, created: str, ready_at: str | None, **extra) -> dict:
    conditions = [] if ready_at is None else [
        {"type": "Ready", "status": "True", "lastTransitionTime": ready_at}]  # fmt: skip
    return {
        "metadata": {"name": name, "creationTimestamp": created, **extra.get("meta", {})},
        "status": {"conditions": conditions,
                   "containerStatuses": [{"restartCount": extra.get("restarts", 0)}]},
    }  # fmt: skip


def test_a_replicas_start_time_is_its_pods_creation_to_ready_over_pods_that_tell():
    from conveyor.operator.autoscaler_observe import start_seconds

    pods = [
        runtime_pod("a", "2026-12-06T01:00:00Z", "2026-12-06T01:00:12Z"),
        runtime_pod("b", "2026-12-06T01:05:00Z", "2026-12-06T01:05:10Z"),
        runtime_pod("c", "2026-12-06T01:05:00Z", "2026-12-06T01:05:14Z"),
        # a restart's readiness, one not ready yet, one going away: say nothing of a start
        runtime_pod("d", "2026-12-06T01:00:00Z", "2026-12-06T03:00:00Z", restarts=1),
        runtime_pod("e", "2026-12-06T01:00:00Z", None),
        runtime_pod("f", "2026-12-06T01:00:00Z", "2026-12-06T02:00:00Z",
                    meta={"deletionTimestamp": "2026-12-06T02:10:00Z"}),
    ]  # fmt: skip
    assert start_seconds(pods) == 12.0
    assert start_seconds(pods[3:]) is None
    assert start_seconds([]) is None


def test_requests_the_gateways_sent_beyond_what_replicas_count_are_backlog_and_arrivals():
    """A replica short of CPU takes requests in late: the gateways' in-flight count beyond the
    replicas' running and waiting is backlog on its way in, and its growth is arrivals."""
    from conveyor.gateway.metrics import GatewayMetrics

    gateway = GatewayMetrics()
    gateway.in_flight.labels("tiny", "http://a:8000").inc(9)
    gateway.in_flight.labels("tiny", "http://b:8000").inc(4)
    gateway.in_flight.labels("other", "http://a:8000").inc(5)
    text = generate_latest(gateway.registry).decode()
    assert gateway_counts(text, "tiny").in_flight == 13
    assert gateway_counts(gateway_metrics(tiny=2), "tiny").in_flight == 0  # an older gateway

    state = ServiceState(history=History())
    replica = ReplicaScrape(
        Endpoint("p1", "http://a:8000"), ReplicaSignals(1, 2, 8, 0.1), True, None, (40.0, 4000.0)
    )

    def observe(now: float, in_flight: int):
        return build_observation(
            now=now, current_replicas=1, replicas=[replica], pending=0, state=state,
            in_flight=in_flight, demand_window=60.0, panic_window=6.0,
        )  # fmt: skip

    first = observe(100.0, in_flight=3)  # all of it taken in: running 2, waiting 1
    assert first.unseen_requests == 0 and first.backlog == 1
    later = observe(102.0, in_flight=13)  # nothing finished, ten more on their way in
    assert later.unseen_requests == 10 and later.backlog == 11 and later.busy
    assert later.demand is not None
    assert later.demand.arrivals_panic.requests == pytest.approx(5.0)
    assert later.demand.backlog_growth == pytest.approx(5.0)
    # the last half of the panic window (3 s) reaches back to the scrape before it, too
    assert later.demand.arrivals_recent == later.demand.arrivals_panic
    assert later.demand.recent_growth == pytest.approx(5.0)
    third = observe(106.0, in_flight=13)  # nothing more came: 10 over 6 s, none over 4 s
    assert third.demand is not None and third.demand.recent_growth == pytest.approx(0.0)
    assert third.demand.arrivals_panic.requests == pytest.approx(10 / 6)


def test_requests_held_at_a_queueing_gateway_make_a_saturated_replica():
    """A gateway that queues (``--queue-at-gateway``) keeps one request waiting on each
    replica and holds the rest: a replica with none of its own waiting at a tick, while the
    gateway holds some, is saturated all the same, so its throughput is its capacity."""
    state = ServiceState(history=History())

    def observe(now: float, finished: float, waiting: int, pending: int):
        replica = ReplicaScrape(
            Endpoint("p1", "http://a:8000"),
            ReplicaSignals(waiting, 2, 2, 0.1),
            True,
            None,
            (finished, finished * 100),
        )
        return build_observation(
            now=now, current_replicas=1, replicas=[replica], pending=pending, state=state,
            in_flight=2 + waiting, demand_window=60.0, panic_window=6.0,
        )  # fmt: skip

    observe(100.0, 40.0, waiting=1, pending=5)
    observe(102.0, 48.0, waiting=0, pending=6)  # between a request's end and the next one
    last = observe(104.0, 56.0, waiting=1, pending=6)
    assert last.demand is not None and last.demand.busy is not None
    assert last.demand.busy.requests == pytest.approx(4.0)
    assert [c.queued for c in state.counters_seen["p1"]] == [True, True, True]
    assert last.queued == 7
