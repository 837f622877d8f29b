"""Routing policies: property tests of their invariants, and the cases that matter."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.contracts.load import ReplicaLoad
from conveyor.gateway.hash_ring import HashRing
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


def report(
    running: int = 0, waiting: int = 0, kv: float = 0.0, max_running: int = 8
) -> ReplicaLoad:
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
        later = first.choose(pool, request(text + " and a later turn"), VIEW)
        assert a.replica is b.replica is later.replica
        assert (a.reason, b.reason, later.reason) == ("placement", "placement", "affinity")


def test_prefix_aware_overflows_a_hot_prefix_to_the_next_replica() -> None:
    pool = replicas(4)
    policy = PrefixAware(bounded_load_factor=1.25)
    hot = request("the same system prompt for everyone")
    chosen = []
    for _ in range(40):
        decision = policy.choose(pool, hot, VIEW)
        decision.replica.in_flight += 1
        chosen.append(decision)
    assert chosen[0].reason == "placement"
    assert any(d.reason == "overflow" for d in chosen)
    assert max(r.in_flight for r in pool) <= math.ceil(1.25 * 40 / 4)


def chat(opening: str, turns: int) -> RouteRequest:
    """A chat request: keyed by its opening, whatever the turns after it say."""
    messages = [{"role": "system", "content": "shared"}, {"role": "user", "content": opening}]
    messages += [{"role": "user", "content": f"turn {t}"} for t in range(turns)]
    return RouteRequest("/v1/chat/completions", {"model": "m", "messages": messages})


def conversations(
    policy: PrefixAware, pool: list[Replica], users: range, turns: int
) -> dict[int, list[str]]:
    """``users`` open their conversations in one burst, then take turns one after another
    (closed loop: a user's next turn is sent when its last one finished). The replica of
    each request, by user."""
    seen: dict[int, list[str]] = {user: [] for user in users}
    open_on: dict[int, Replica] = {}
    for turn in range(turns):
        for user in users:
            if user in open_on:
                open_on[user].in_flight -= 1
            chosen = policy.choose(pool, chat(f"user {user}: a document", turn), VIEW).replica
            chosen.in_flight += 1
            open_on[user] = chosen
            seen[user].append(chosen.url)
    for replica in open_on.values():
        replica.in_flight -= 1
    return seen


def test_prefix_aware_spreads_conversations_evenly_and_keeps_each_on_one_replica() -> None:
    """32 conversations over 4 replicas: hashing alone puts about 11 on one and 5 on another;
    placing each new one at most at the mean load spreads a burst exactly."""
    pool = replicas(4)
    seen = conversations(PrefixAware(), pool, range(32), turns=5)
    assert all(len(set(urls)) == 1 for urls in seen.values())
    counts = [sum(urls.count(r.url) for urls in seen.values()) for r in pool]
    assert max(counts) / min(counts) <= 1.5, counts


def test_a_joining_replica_takes_only_the_conversations_its_ring_arc_owns() -> None:
    """A replica joining takes the keys whose ring point falls on it (its fair share at
    once), once it is admitted, and only once; every other conversation stays where its
    cache is."""
    pool = replicas(4)
    old, new = pool[:3], pool[3]
    policy = PrefixAware()
    policy.set_members(frozenset(r.url for r in old))
    before = conversations(policy, old, range(24), turns=2)
    for replica in old:  # the 24 conversations stay open, each on its replica
        replica.in_flight = sum(urls[-1] == replica.url for urls in before.values())
    policy.set_members(frozenset(r.url for r in pool))
    ring = HashRing([r.url for r in pool], policy.vnodes)
    moved = 0
    for turn, candidates in ((2, old), (3, pool), (4, pool)):  # the new one not admitted yet
        for user, urls in before.items():
            home = next(r for r in old if r.url == urls[-1])
            request = chat(f"user {user}: a document", turn)
            owner = new if ring.first(request.key) == new.url and candidates is pool else home
            was = new if owner is new and turn == 4 else home
            was.in_flight -= 1  # this turn finished; the user sends the next
            decision = policy.choose(candidates, request, VIEW)
            decision.replica.in_flight += 1
            moving = owner is new and turn == 3
            assert (decision.replica, decision.reason) == (
                owner,
                "rebalance" if moving else "affinity",
            )
            moved += moving
    assert 0 < moved < 12


def test_prefix_aware_a_home_out_of_reach_for_now_stays_the_home() -> None:
    pool = replicas(3)
    policy = PrefixAware()
    home = policy.choose(pool, chat("user", 0), VIEW).replica
    others = [r for r in pool if r is not home]
    elsewhere = policy.choose(others, chat("user", 1), VIEW)  # home ejected or queue full
    assert elsewhere.reason == "overflow"
    back = policy.choose(pool, chat("user", 2), VIEW)
    assert (back.replica, back.reason) == (home, "affinity")


def test_prefix_aware_forgets_the_least_recent_homes_past_its_table() -> None:
    pool = replicas(4)
    policy = PrefixAware(max_homes=3)
    for user in range(5):
        policy.choose(pool, chat(f"user {user}", 0), VIEW)
    policy.choose(pool, chat("user 2", 1), VIEW)  # used again: kept over 3 and 4
    policy.choose(pool, chat("user 5", 0), VIEW)
    assert policy.choose(pool, chat("user 2", 2), VIEW).reason == "affinity"
    assert policy.choose(pool, chat("user 3", 1), VIEW).reason == "placement"


def test_prefix_aware_keeps_a_home_with_a_free_batch_slot_over_the_bound() -> None:
    """At low load the bound is a request or two: a home that runs the request at once
    keeps it; one that queues does not."""
    pool = replicas(4)
    for r in pool:
        r.load, r.load_time = report(), VIEW.now
    policy = PrefixAware()
    home = policy.choose(pool, chat("user", 0), VIEW).replica
    home.load = report(running=3)  # 4 over 3 replicas idle: the bound is 2
    assert policy.choose(pool, chat("user", 1), VIEW).replica is home
    home.load = report(running=3, waiting=1)
    decision = policy.choose(pool, chat("user", 2), VIEW)
    assert decision.replica is not home
    assert decision.reason == "overflow"


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
        replica.record_poll(report(), sent_at=VIEW.now, in_flight_then=0)
    b.eject(VIEW.now, 5.0)
    c.record_poll(
        ReplicaLoad(8, 4, 0.0, 8, 4, True), sent_at=VIEW.now + 0.1, in_flight_then=0
    )  # batch and queue full
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
