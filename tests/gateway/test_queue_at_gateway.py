"""Queueing at the gateway (``--queue-at-gateway``): while every ready replica has its batch
full and ``--replica-queue`` requests waiting, requests are held at the gateway by priority,
then in arrival order, and a replica that comes up takes the first of them at once.

The first tests drive ``Holding`` on a hand-made pool (the order and the bounds); the last runs
real gateway and stub processes.
"""

from __future__ import annotations

import asyncio
import functools

import httpx
import openai
import pytest
from gateway_helpers import Processes, gateway, stub
from prometheus_client.parser import text_string_to_metric_families
from test_holding import pending, wait_pending

from conveyor.bench.procs import free_port
from conveyor.bench.wait import wait_until
from conveyor.contracts.load import ReplicaLoad
from conveyor.gateway.holding import Holding
from conveyor.gateway.metrics import BACKEND_LOAD, GatewayMetrics
from conveyor.gateway.pool import Registry
from conveyor.gateway.prefix_key import RouteRequest
from conveyor.gateway.replica import Replica
from conveyor.gateway.routing import make_policy
from conveyor.gateway.settings import GatewaySettings

MODEL = "tiny"


def load(running: int, waiting: int, max_queued: int | None = None) -> ReplicaLoad:
    return ReplicaLoad(running, waiting, 0.0, 1, max_queued, True)


def one_replica(**settings: object) -> tuple[Holding, Registry, Replica]:
    """A registry whose pool has one replica with a batch of 1, and the gateway's Holding."""
    registry = Registry(
        lambda _: make_policy("least-load", bounded_load_factor=1.25, ring_vnodes=8)
    )
    registry.sync("test", {MODEL: {"http://r1"}})
    s = GatewaySettings(queue_at_gateway=True, load_poll_interval_s=0.05, **settings)  # type: ignore[arg-type]
    holding = Holding(registry=registry, metrics=GatewayMetrics(), settings=s)
    return holding, registry, registry.replicas["http://r1"]


def report(replica: Replica, running: int, waiting: int, max_queued: int | None = None) -> None:
    """The replica's /load poll answered now; the gateway's in-flight count is what it has sent."""
    now = asyncio.get_running_loop().time()
    replica.record_poll(load(running, waiting, max_queued), now, replica.in_flight)


async def test_held_requests_go_in_arrival_order_as_room_frees() -> None:
    holding, registry, replica = one_replica()
    pool = registry.pools[MODEL]
    report(replica, running=1, waiting=1)  # batch full and one waiting: no room
    gone: list[int] = []

    async def request(i: int) -> None:
        assert await holding.until_room(pool, asyncio.get_running_loop().time()) is None
        replica.in_flight += 1  # what Upstream.attempt does before its first wait
        gone.append(i)

    tasks = []
    for i in range(4):
        tasks.append(asyncio.create_task(request(i)))
        await asyncio.sleep(0)  # each reaches the queue before the next arrives
    assert len(pool.queue) == 4 and pool.held == 4 and not gone

    report(replica, running=0, waiting=0)  # both finished: room for a batch of 1 and 1 waiting
    Holding.room_freed(pool)
    await asyncio.wait_for(_until(lambda: len(gone) == 2), 5)
    assert gone == [0, 1]  # the oldest two, and no more than there is room for
    await asyncio.sleep(0.2)  # a few load-poll intervals with no room: nobody else goes
    assert gone == [0, 1] and len(pool.queue) == 2

    replica.in_flight = 0
    report(replica, running=0, waiting=0)
    Holding.room_freed(pool)
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert gone == [0, 1, 2, 3] and pool.held == 0 and not pool.queue


async def test_held_requests_go_by_priority_then_arrival() -> None:
    """vLLM's ``priority`` (lower first) orders the held requests, as a replica started with
    --scheduling-policy priority orders its own queue; equal priorities keep arrival order."""
    holding, registry, replica = one_replica()
    pool = registry.pools[MODEL]
    report(replica, running=1, waiting=1)
    gone: list[str] = []

    async def request(name: str, priority: int) -> None:
        now = asyncio.get_running_loop().time()
        assert await holding.until_room(pool, now, priority) is None
        replica.in_flight += 1
        gone.append(name)

    tasks = []
    for name, priority in (("a", 5), ("b", 0), ("c", 5), ("d", -1), ("e", 0)):
        tasks.append(asyncio.create_task(request(name, priority)))
        await asyncio.sleep(0)
    assert [p for p, _, _ in pool.queue] == [-1, 0, 0, 5, 5]
    for sent in range(1, 6):  # room for one at a time
        replica.in_flight = 0
        report(replica, running=1, waiting=0)
        Holding.room_freed(pool)
        await asyncio.wait_for(_until(functools.partial(lambda n: len(gone) == n, sent)), 5)
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert gone == ["d", "b", "e", "a", "c"] and not pool.queue
    assert not registry._wake  # no event of a request gone is kept to be woken


@pytest.mark.parametrize(
    ("value", "read"),
    [(3, 3), (-2, -2), (True, 1), (5.0, 5), (" 7 ", 7), ("x", 0), (1.5, 0), (None, 0), ([1], 0)],
)
def test_priority_is_read_as_the_replica_reads_it(value: object, read: int) -> None:
    body = {"model": MODEL, "prompt": "p"} if value is None else {"priority": value}
    assert RouteRequest("/v1/completions", body).priority == read


def test_a_pool_with_an_sglang_replica_holds_by_arrival_alone() -> None:
    """SGLang's default ignores ``priority`` (and runs higher values first where it reads
    it): the gateway's lower-first order would let a request jump a queue its replica keeps."""
    _, registry, replica = one_replica()
    pool = registry.pools[MODEL]
    replica.record_poll(load(0, 0), 0.0, 0)
    assert pool.orders_by_priority()
    sglang = ReplicaLoad(0, 0, 0.0, 1, None, True, engine="sglang")
    replica.record_poll(sglang, 0.0, 0)
    assert not pool.orders_by_priority()


async def test_no_more_are_held_than_the_replicas_would_queue() -> None:
    holding, registry, replica = one_replica()
    pool = registry.pools[MODEL]
    report(replica, running=1, waiting=1, max_queued=2)
    now = asyncio.get_running_loop().time()
    held = [asyncio.create_task(holding.until_room(pool, now)) for _ in range(2)]
    await asyncio.sleep(0)
    refused = await holding.until_room(pool, now)
    assert refused is not None and refused.status == 429 and refused.code == "queue_full"
    for task in held:
        task.cancel()
    await asyncio.gather(*held, return_exceptions=True)
    assert pool.held == 0 and not pool.queue  # a client that left gives its place up


async def test_a_full_queue_makes_room_for_a_lower_priority_value() -> None:
    """Full, the queue takes a request that comes before its last (a lower ``priority``):
    the last gives way with a 429; one that would come last is refused itself."""
    holding, registry, replica = one_replica()
    pool = registry.pools[MODEL]
    report(replica, running=1, waiting=1, max_queued=2)
    now = asyncio.get_running_loop().time()
    held = {p: asyncio.create_task(holding.until_room(pool, now, p)) for p in (0, 5)}
    await asyncio.sleep(0)
    refused = await holding.until_room(pool, now, 5)  # would come after both: refused
    assert refused is not None and refused.status == 429
    urgent = asyncio.create_task(holding.until_room(pool, now, -1))
    bumped = await asyncio.wait_for(held[5], 5)
    assert bumped is not None and bumped.status == 429 and "gave way" in bumped.message
    assert [p for p, _, _ in pool.queue] == [-1, 0] and pool.held == 2
    replica.in_flight = 0
    report(replica, running=1, waiting=0, max_queued=2)
    Holding.room_freed(pool)
    assert await asyncio.wait_for(urgent, 5) is None  # the lowest value goes first
    held[0].cancel()
    await asyncio.gather(held[0], return_exceptions=True)
    assert pool.held == 0 and not pool.queue and not pool.bumped


async def test_a_request_held_past_the_hold_timeout_gets_a_503() -> None:
    holding, registry, replica = one_replica(hold_timeout_s=0.1)
    pool = registry.pools[MODEL]
    report(replica, running=1, waiting=1)
    failure = await holding.until_room(pool, asyncio.get_running_loop().time())
    assert failure is not None and failure.status == 503
    assert pool.held == 0


async def test_without_the_flag_nothing_is_held() -> None:
    registry = Registry(
        lambda _: make_policy("least-load", bounded_load_factor=1.25, ring_vnodes=8)
    )
    registry.sync("test", {MODEL: {"http://r1"}})
    holding = Holding(registry=registry, metrics=GatewayMetrics(), settings=GatewaySettings())
    report(registry.replicas["http://r1"], running=1, waiting=5)
    assert await holding.until_room(registry.pools[MODEL], 0.0) is None


def wait_gateway_sees_running(gw, port: int, count: int) -> None:
    """Until the gateway's last load report of the replica at ``port`` says ``count`` running."""

    def check() -> bool:
        text = httpx.get(gw.url + "/metrics", timeout=5).text
        for family in text_string_to_metric_families(text):
            if family.name == BACKEND_LOAD:
                for sample in family.samples:
                    labels = sample.labels
                    if labels.get("backend", "").endswith(f":{port}") and (
                        labels.get("signal") == "running"
                    ):
                        return sample.value == count
        return False

    wait_until(check, 30, f"the gateway to see {count} running at port {port}")


def wait_running(port: int, count: int) -> None:
    def check() -> bool:
        return httpx.get(f"http://127.0.0.1:{port}/load", timeout=5).json()["running"] == count

    wait_until(check, 30, f"{count} requests running on the stub at port {port}")


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("replica_like", [False, True], ids=["polled", "load-in-headers"])
async def test_a_replica_that_comes_up_takes_the_held_requests(
    processes: Processes, replica_like: bool
) -> None:
    """One replica with a batch of 1 holds two long streams (one running, one waiting); three
    more are held at the gateway, not sent to it. A second replica comes up and answers all
    three, while the first is still busy: without queueing at the gateway they would have
    waited on the first. Replicas that say their load in each answer's header (as Conveyor's
    runtime does) and those only polled alike."""
    busy_port, new_port = free_port(), free_port()
    like = {"replica_like": replica_like}
    processes.start(stub(port=busy_port, model=MODEL, name="busy", max_running_requests=1, **like))
    gw = processes.start(gateway(
        "--backend", f"{MODEL}=http://127.0.0.1:{busy_port}",
        "--backend", f"{MODEL}=http://127.0.0.1:{new_port}",
        "--queue-at-gateway", "--replica-queue", "1",
    ))  # fmt: skip
    gw.wait_http("/health")
    async with openai.AsyncOpenAI(
        base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120
    ) as client:

        async def answered_by(prompt: str, tokens: int) -> str:
            stream = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=tokens, stream=True
            )
            return "".join([c.choices[0].text async for c in stream]).split()[0]

        long = []
        for i in range(2):  # one after the other: each one's load header is in before the next
            long.append(asyncio.create_task(answered_by("pace 1000", 120)))
            await asyncio.to_thread(wait_running, busy_port, i + 1)
        # A report the gateway took while the second was on its way said one: wait for one
        # that says two (the poll after it, or the second's header).
        await asyncio.to_thread(wait_gateway_sees_running, gw, busy_port, 2)
        short = []
        for i in range(3):
            short.append(asyncio.create_task(answered_by("pace 1", 3)))
            await asyncio.to_thread(wait_pending, gw, MODEL, i + 1)
        assert not any(t.done() for t in (*long, *short))

        processes.start(
            stub(port=new_port, model=MODEL, name="new", max_running_requests=1, **like)
        )
        assert await asyncio.wait_for(asyncio.gather(*short), 60) == ["new"] * 3
        assert not any(t.done() for t in long)  # the busy replica was still busy throughout
        for task in long:
            task.cancel()
        await asyncio.gather(*long, return_exceptions=True)
    assert pending(gw, MODEL) == 0


async def test_a_held_request_that_leaves_lets_the_next_one_look() -> None:
    """The oldest held request's client goes away: the next one becomes the oldest and goes
    as soon as there is room, not at its own hold timeout."""
    holding, registry, replica = one_replica()
    pool = registry.pools[MODEL]
    report(replica, running=1, waiting=1)
    now = asyncio.get_running_loop().time()
    first = asyncio.create_task(holding.until_room(pool, now))
    second = asyncio.create_task(holding.until_room(pool, now))
    await asyncio.sleep(0)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    assert len(pool.queue) == 1 and pool.held == 1
    report(replica, running=0, waiting=0)
    Holding.room_freed(pool)
    assert await asyncio.wait_for(second, 5) is None
    assert pool.held == 0 and not pool.queue


async def test_a_replica_over_its_own_queue_bound_has_no_room() -> None:
    """A --replica-queue above a replica's own queue bound does not send it requests it would
    refuse with a 429: they stay held."""
    holding, registry, replica = one_replica(replica_queue=4)
    pool = registry.pools[MODEL]
    report(replica, running=1, waiting=2, max_queued=2)  # at its bound, under batch + 4
    assert pool.saturated(holding.view())
