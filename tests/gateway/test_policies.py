"""Routing policies: property tests of their invariants, and the cases that matter."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.contracts.load import ReplicaLoad
from conveyor.gateway.least_load import LeastLoad, load_score
from conveyor.gateway.pool import NoCandidate, Registry
from conveyor.gateway.prefix_aware import PrefixAware, load_bound
from conveyor.gateway.prefix_key import RouteRequest
from conveyor.gateway.replica import Replica
from conveyor.gateway.round_robin import RoundRobin
from conveyor.gateway.routing import LoadView, make_policy

VIEW = LoadView(now=100.0, stale_after=1.0)


def replicas(n: int) -> list[Replica]:
    return [Replica(f"http://10.0.0.{i}:8000") for i in range(n)]


def request(text: str) -> RouteRequest:
    return RouteRequest(
        "/v1/completions", {"model": "m", "prompt": text}, block_chars=8, max_blocks=4
    )


def report(running: int = 0, waiting: int = 0, kv: float = 0.0, max_running: int = 8) -> ReplicaLoad:
    return ReplicaLoad(running, waiting, kv, max_running, None, True)


@given(n=st.integers(1, 12), rounds=st.integers(1, 20))
def test_round_robin_spreads_evenly(n: int, rounds: int) -> None:
    pool = replicas(n)
    policy = RoundRobin()
    counts = dict.fromkeys((r.url for r in pool), 0)
    for i in range(n * rounds):
        counts[policy.choose(pool, request(str(i)), VIEW).replica.url] += 1
    assert set(counts.values()) == {rounds}


@settings(max_examples=200)
@given(
    n=st.integers(1, 8),
    factor=st.floats(1.0, 3.0),
    ops=st.lists(st.one_of(st.text(max_size=40), st.integers(0, 7)), max_size=200),
)
def test_bounded_load_never_exceeds_its_bound(n: int, factor: float, ops: list[str | int]) -> None:
    """A string routes a request (it stays in flight); an integer finishes one on that replica."""
    pool = replicas(n)
    policy = PrefixAware(bounded_load_factor=factor, vnodes=20)
    for op in ops:
        if isinstance(op, int):
            replica = pool[op % n]
            replica.in_flight = max(0, replica.in_flight - 1)
            continue
        total = sum(r.in_flight for r in pool)
        chosen = policy.choose(pool, request(op), VIEW).replica
        chosen.in_flight += 1
        assert chosen.in_flight <= load_bound(total, n, factor)
        assert chosen.in_flight <= math.ceil(factor * (total + 1) / n)


@settings(max_examples=100)
@given(
    policy_name=st.sampled_from(["round-robin", "least-load", "prefix-aware"]),
    ops=st.lists(st.one_of(st.text(max_size=20), st.integers(0, 5)), max_size=100),
)
def test_a_replica_that_disappears_gets_no_more_requests(
    policy_name: str, ops: list[str | int]
) -> None:
    """An integer removes that replica from discovery; a string routes a request."""
    urls = [f"http://10.0.0.{i}:8000" for i in range(6)]
    registry = Registry(
        lambda _: make_policy(policy_name, bounded_load_factor=1.25, ring_vnodes=20)
    )
    registry.sync("test", {"m": set(urls)})
    gone: set[str] = set()
    for op in ops:
        if isinstance(op, int):
            gone.add(urls[op])
            registry.sync("test", {"m": set(urls) - gone})
            continue
        pool = registry.pools["m"]
        candidates = list(pool.replicas.values())
        if not candidates:
            continue
        chosen = pool.policy.choose(candidates, request(op), VIEW).replica
        assert chosen.url not in gone
        assert chosen.url in registry.replicas


def test_prefix_aware_keeps_a_prefix_on_one_replica_and_gateways_agree() -> None:
    pool = replicas(4)
    first, second = PrefixAware(), PrefixAware()  # two gateway replicas, no shared state
    for member in (first, second):
        member.set_members(frozenset(r.url for r in pool))
    for user in range(20):
        text = f"user {user} opening message that is long enough"
        a = first.choose(pool, request(text), VIEW)
        b = second.choose(pool, request(text + " and a later turn"), VIEW)
        assert a.replica is b.replica
        assert a.reason == "affinity"


def test_prefix_aware_overflows_a_hot_prefix_to_the_next_replica() -> None:
    pool = replicas(4)
    policy = PrefixAware(bounded_load_factor=1.25)
    hot = request("the same system prompt for everyone")
    chosen = []
    for _ in range(40):
        decision = policy.choose(pool, hot, VIEW)
        decision.replica.in_flight += 1
        chosen.append(decision)
    assert chosen[0].reason == "affinity"
    assert any(d.reason == "overflow" for d in chosen)
    assert max(r.in_flight for r in pool) <= math.ceil(1.25 * 40 / 4)


def test_prefix_aware_counts_the_replicas_own_queue() -> None:
    """The replica the key maps to is already busy through other gateways: overflow."""
    pool = replicas(2)
    policy = PrefixAware(bounded_load_factor=1.25)
    req = request("some prompt")
    home = policy.choose(pool, req, VIEW).replica
    home.load, home.load_time = report(running=8, waiting=4), VIEW.now
    other = next(r for r in pool if r is not home)
    other.load, other.load_time = report(), VIEW.now
    decision = policy.choose(pool, req, VIEW)
    assert decision.replica is other
    assert decision.reason == "overflow"


def test_least_load_prefers_the_lowest_score_and_unknown_is_not_idle() -> None:
    idle_but_stale, busy, light = replicas(3)
    idle_but_stale.load, idle_but_stale.load_time = report(), VIEW.now - 10  # stale
    busy.load, busy.load_time = report(running=8, waiting=3, kv=0.9), VIEW.now
    light.load, light.load_time = report(running=2, kv=0.2), VIEW.now
    policy = LeastLoad()
    assert policy.choose([idle_but_stale, busy, light], request("x"), VIEW).replica is light
    assert load_score(light, VIEW) < load_score(busy, VIEW)
    # among known replicas the busy one still beats one whose load is unknown
    assert policy.choose([idle_but_stale, busy], request("x"), VIEW).replica is busy


def test_least_load_counts_what_the_gateway_sent_since_the_last_poll() -> None:
    a, b = replicas(2)
    for r in (a, b):
        r.load, r.load_time = report(), VIEW.now
    policy = LeastLoad()
    picks = []
    for _ in range(10):  # a burst between two polls
        chosen = policy.choose([a, b], request("x"), VIEW).replica
        chosen.in_flight += 1
        picks.append(chosen)
    assert picks.count(a) == picks.count(b) == 5


def test_pool_offers_admitted_replicas_with_room_then_panics_then_says_why_not() -> None:
    registry = Registry(lambda _name: RoundRobin())
    urls = [f"http://10.0.0.{i}:8000" for i in range(3)]
    registry.sync("static", {"m": set(urls)})
    pool = registry.pools["m"]
    a, b, c = (pool.replicas[url] for url in urls)
    route = request("hello")
    assert pool.choose(route, VIEW, set()) is NoCandidate.NONE_READY  # nobody polled yet
    for replica in (a, b, c):
        replica.record_poll(report(), sent_at=VIEW.now, in_flight_at_send=0)
    b.eject(VIEW.now, 5.0)
    c.record_poll(
        ReplicaLoad(0, 4, 0.0, 8, 4, True), sent_at=VIEW.now + 0.1, in_flight_at_send=0
    )  # queue full
    offered = {pool.choose(route, VIEW, set()).replica.url for _ in range(4)}
    assert offered == {a.url}
    # a tried, b ejected, c admitted but full: panic mode waits until no untried one is admitted
    assert pool.choose(route, VIEW, {a.url}) is NoCandidate.QUEUES_FULL
    a.eject(VIEW.now, 5.0)
    c.eject(VIEW.now, 5.0)
    assert pool.choose(route, VIEW, {a.url}).replica is b  # panic mode: ready, all ejected
    assert pool.choose(route, VIEW, {a.url, b.url}) is NoCandidate.QUEUES_FULL
    c.record_poll_failure()
    assert pool.choose(route, VIEW, {a.url, b.url}) is NoCandidate.NONE_READY
