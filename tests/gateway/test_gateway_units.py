"""Small pieces: prefix keys, /load parsing, ejection, the registry, auth, flags."""

from __future__ import annotations

import asyncio
import json

import pytest

from conveyor.contracts.engine_load import Limits
from conveyor.contracts.load import ReplicaLoad
from conveyor.gateway.auth import ApiKeyAuth, load_api_keys
from conveyor.gateway.cli import parse_settings
from conveyor.gateway.hash_ring import HashRing
from conveyor.gateway.pool import Registry
from conveyor.gateway.prefix_key import prefix_key, routing_text, stable_hash
from conveyor.gateway.replica import Replica
from conveyor.gateway.routing import make_policy
from conveyor.gateway.static_discovery import parse_backend, parse_backends

LOAD = {"running": 1, "waiting": 2, "kv_cache_usage": 0.5, "max_running_requests": 8,
        "max_queued_requests": 4, "ready": True, "extra": "ignored"}  # fmt: skip


def test_chat_key_is_the_conversations_opening() -> None:
    system = {"role": "system", "content": "be brief"}
    turn1 = [system, {"role": "user", "content": "hello"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}]
    path = "/v1/chat/completions"
    assert routing_text(path, {"messages": turn1}) == routing_text(path, {"messages": turn2})
    other = [system, {"role": "user", "content": [{"type": "text", "text": "bye"}]}]
    assert routing_text(path, {"messages": other}) != routing_text(path, {"messages": turn1})


def test_completion_key_is_leading_whole_blocks() -> None:
    assert routing_text("/v1/completions", {"prompt": ["a", "b"]}) == "a"
    assert routing_text("/v1/completions", {"prompt": [1, 2, 3]}) == "1,2,3"
    assert routing_text("/v1/completions", {"prompt": None}) == ""
    base = "x" * 40
    assert prefix_key(base + "abc", 8, 4) == prefix_key(base + "xyz", 8, 4)  # past 4 blocks
    assert prefix_key("abcdefgh1", 8, 4) == prefix_key("abcdefgh2", 8, 4)  # partial block ignored
    assert prefix_key("short", 8, 4) != prefix_key("shorT", 8, 4)  # under one block: all of it
    assert stable_hash(b"x") == stable_hash(b"x")


def test_a_cache_salt_keys_its_own_prefixes() -> None:
    """A replica shares cached blocks only within one ``cache_salt``: each salt's prompts are
    keyed apart, and an unsalted request keys as before."""
    from conveyor.gateway.prefix_key import RouteRequest

    body = {"model": "m", "prompt": "the same prompt " * 20}
    plain = RouteRequest("/v1/completions", body).key
    assert plain == prefix_key(routing_text("/v1/completions", body), 128, 32)
    a = RouteRequest("/v1/completions", {**body, "cache_salt": "a"}).key
    b = RouteRequest("/v1/completions", {**body, "cache_salt": "b"}).key
    assert len({plain, a, b}) == 3
    assert a == RouteRequest("/v1/completions", {**body, "cache_salt": "a"}).key
    assert RouteRequest("/v1/completions", {**body, "cache_salt": 5}).key == plain


def test_hash_ring_walks_each_member_once_and_moves_few_keys() -> None:
    ring = HashRing([f"r{i}" for i in range(5)], vnodes=50)
    assert sorted(ring.walk(123)) == [f"r{i}" for i in range(5)]
    smaller = HashRing([f"r{i}" for i in range(4)], vnodes=50)
    keys = [stable_hash(str(k).encode()) for k in range(2000)]
    moved = sum(
        next(ring.walk(k)) != next(smaller.walk(k)) and next(ring.walk(k)) != "r4" for k in keys
    )
    assert moved == 0  # only keys of the removed member move


def test_load_report_validation() -> None:
    assert ReplicaLoad.from_json(LOAD) == ReplicaLoad(1, 2, 0.5, 8, 4, True)
    assert ReplicaLoad.from_json({**LOAD, "max_queued_requests": None}).max_queued_requests is None
    with pytest.raises(ValueError, match="'running'"):
        ReplicaLoad.from_json({**LOAD, "running": "1"})
    with pytest.raises(ValueError, match="'ready'"):
        ReplicaLoad.from_json({**LOAD, "ready": 1})
    with pytest.raises(ValueError, match="object"):
        ReplicaLoad.from_json([])


def test_ejection_lasts_until_a_poll_sent_after_it_succeeds() -> None:
    replica = Replica("http://r:1")
    report = ReplicaLoad.from_json(LOAD)
    replica.record_poll(report, sent_at=1.0, in_flight_then=0)
    assert replica.admitted(1.5)
    assert replica.eject(now=2.0, duration=5.0)
    assert not replica.admitted(2.5)
    replica.record_poll(report, sent_at=1.9, in_flight_then=0)  # sent before the failure
    assert not replica.admitted(2.5)
    replica.record_poll(report, sent_at=2.1, in_flight_then=0)
    assert replica.admitted(2.5)
    replica.record_poll_failure()
    assert not replica.admitted(2.5)
    assert replica.queue_full(2.5, 1.0) is False


def test_queue_full_and_outstanding() -> None:
    replica = Replica("http://r:1")
    replica.record_poll(
        ReplicaLoad.from_json({**LOAD, "running": 8, "waiting": 4}), sent_at=1.0, in_flight_then=2
    )
    replica.in_flight = 5  # three sent since the poll
    assert replica.queue_full(1.5, 1.0)
    assert replica.outstanding(1.5, 1.0) == 8 + 4 + 3
    assert replica.outstanding(9.0, 1.0) == 5  # stale: only what the gateway knows
    assert not replica.queue_full(9.0, 1.0)


@pytest.mark.parametrize(
    ("running", "waiting", "max_queued", "full"),
    [
        (0, 0, 0, False),  # --max-queued-requests 0: an idle replica still runs one
        (7, 0, 0, False),
        (8, 0, 0, True),
        (1, 4, 4, False),  # waiting that free slots take at the next step: not queued
        (5, 7, 4, True),  # 3 free slots, 4 would wait, and one more is over the bound
        (5, 6, 4, False),
    ],
)
def test_queue_full_is_the_replicas_own_rule(
    running: int, waiting: int, max_queued: int, full: bool
) -> None:
    replica = Replica("http://r:1")
    doc = {**LOAD, "running": running, "waiting": waiting, "max_queued_requests": max_queued}
    replica.record_poll(ReplicaLoad.from_json(doc), sent_at=1.0, in_flight_then=0)
    assert replica.queue_full(1.5, 1.0) is full


def test_progress_is_a_report_with_new_engine_steps_or_any_report_without_them() -> None:
    replica = Replica("http://r:1")

    def heard(at: float, steps: int | None) -> float:
        replica.record_poll(ReplicaLoad.from_json({**LOAD, "steps": steps}), at, 0)
        return replica.progress_at

    assert heard(1.0, 10) == 1.0  # the first report
    assert heard(2.0, 12) == 2.0  # the engine stepped
    assert heard(3.0, 12) == 2.0  # answering, but its engine stands still: no progress
    assert heard(4.0, 0) == 4.0  # restarted
    assert heard(5.0, None) == 5.0  # an engine that does not count steps: answering is all
    assert ReplicaLoad.from_json({**LOAD, "steps": 7}).to_json()["steps"] == 7
    assert "steps" not in ReplicaLoad.from_json(LOAD).to_json()


def test_registry_unions_sources_and_keeps_empty_pools() -> None:
    changes = []
    registry = Registry(
        lambda name: make_policy(name or "round-robin", bounded_load_factor=1.25, ring_vnodes=10)
    )
    registry.listeners.append(
        lambda added, removed: changes.append(([r.url for r in added], [r.url for r in removed]))
    )
    registry.sync("a", {"m": {"http://1", "http://2"}})
    registry.sync("b", {"m": {"http://2", "http://3"}, "n": set()}, {"n": "least-load"})
    assert registry.served_models() == ["m", "n"]
    assert list(registry.pools["m"].replicas) == ["http://1", "http://2", "http://3"]
    assert registry.pools["n"].policy.name == "least-load"
    assert registry.pools["m"].policy.name == "round-robin"
    registry.sync("a", {})
    assert list(registry.pools["m"].replicas) == ["http://2", "http://3"]
    registry.forget("b")
    assert registry.served_models() == [] and registry.replicas == {}
    assert changes[-1] == ([], ["http://2", "http://3"])


def test_api_keys_are_checked_against_every_key() -> None:
    auth = ApiKeyAuth(("k1", "k2"))
    assert auth.allows(b"Bearer k2") and auth.allows(b"bearer k1")
    assert not auth.allows(b"Bearer k3") and not auth.allows(None) and not auth.allows(b"k1")
    assert ApiKeyAuth(()).allows(None)


def test_api_keys_from_flags_file_and_environment(tmp_path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# comment\nfile-key\n\n")
    keys = load_api_keys(["flag-key"], str(key_file), {"CONVEYOR_API_KEY": "env1, env2"})
    assert keys == ("flag-key", "file-key", "env1", "env2")


def test_backend_specs() -> None:
    assert parse_backend("http://h:1/") == (None, "http://h:1")
    assert parse_backend("tiny=http://h:1") == ("tiny", "http://h:1")
    assert parse_backends(["# x", "", "http://a:1  # trailing"]) == [(None, "http://a:1")]
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        parse_backend("h:1")


def test_flags_that_cannot_work_say_what_to_change() -> None:
    assert parse_settings(["--backend", "http://h:1"]).routing == "prefix-aware"
    with pytest.raises(ValueError, match="--backend URL"):
        parse_settings([])
    with pytest.raises(ValueError, match="--k8s-service"):
        parse_settings(["--k8s-namespace", "ns"])
    with pytest.raises(ValueError, match=r"at least 1\.0"):
        parse_settings(["--backend", "http://h:1", "--bounded-load-factor", "0.5"])
    with pytest.raises(ValueError, match="not a URL"):
        parse_settings(["--backend", "localhost:8000"])
    settings = parse_settings(["--backend", "http://h:1", "--api-key", "secret"])
    assert "secret" not in repr(settings)


def test_a_joining_replica_that_does_not_answer_load_is_logged_once(caplog) -> None:
    """Polls of a replica not yet admitted used to fail silently; the first failure is logged
    (once, not every 0.2 s), and the replica is admitted when it answers."""
    import asyncio
    import logging

    import aiohttp
    from aiohttp import web
    from loopback import serve

    from conveyor.bench.procs import free_port
    from conveyor.gateway.load_poller import LoadPoller
    from conveyor.gateway.metrics import GatewayMetrics
    from conveyor.gateway.pool import Registry
    from conveyor.gateway.round_robin import RoundRobin

    async def ready(request: web.Request) -> web.Response:
        return web.json_response(
            {"ready": True, "running": 0, "waiting": 0, "kv_cache_usage": 0.0,
             "max_running_requests": 4}
        )  # fmt: skip

    port = free_port()

    async def run() -> bool:
        url = f"http://127.0.0.1:{port}"
        registry = Registry(lambda _name: RoundRobin())
        registry.sync("test", {"m": {url}})
        async with aiohttp.ClientSession() as session:
            poller = LoadPoller(
                registry=registry, session=session, metrics=GatewayMetrics(),
                interval_s=0.0, timeout_s=1.0, backend_api_key=None,
            )  # fmt: skip
            replica = registry.replicas[url]
            for _ in range(3):  # nothing listens there yet: refused
                await poller._poll(replica)
            async with serve(ready, port):
                for _ in range(2):
                    await poller._poll(replica)
            return replica.admitted(asyncio.get_running_loop().time())

    with caplog.at_level(logging.INFO, logger="conveyor.gateway"):
        assert asyncio.run(run())
    said = [r.getMessage() for r in caplog.records]
    unanswered = [m for m in said if "does not answer /load yet" in m]
    assert len(unanswered) == 1 and "Cannot connect to host" in unanswered[0]
    assert any(f"replica http://127.0.0.1:{port} is ready" in m for m in said)


def test_a_labelled_series_is_looked_up_once_and_forgotten_with_its_replica() -> None:
    from prometheus_client import generate_latest

    from conveyor.gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    series = metrics.in_flight.labels("m", "http://a:1")
    assert metrics.in_flight.labels("m", "http://a:1") is series
    series.inc()
    metrics.forget_backend("http://a:1", {"m"})
    assert b'backend="http://a:1"' not in generate_latest(metrics.registry)
    # the replica comes back: its series is a new one that /metrics shows again
    metrics.in_flight.labels("m", "http://a:1").inc(2)
    text = generate_latest(metrics.registry).decode()
    assert 'conveyor_gateway_backend_in_flight{backend="http://a:1",model="m"} 2.0' in text


def _sse(kind: str, sequence: int, **fields: object) -> bytes:
    data = json.dumps({"type": kind, "sequence_number": sequence, **fields})
    return f"event: {kind}\ndata: {data}\n\n".encode()


def test_a_chat_stream_ends_with_done_or_an_error_chunk_and_done() -> None:
    from conveyor.gateway.sse import DONE, StreamEnd

    first = b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n'
    stream = StreamEnd(first)
    assert not stream.ended and not stream.sent(b'data: {"choices": []}\n\n')
    assert stream.error("gone").startswith(b"data: ") and stream.error("gone").endswith(DONE)
    assert not stream.sent(b'data: {"choi')  # broke off inside an event: that one is left
    assert stream.error("gone").startswith(b"\n\ndata: ")
    assert stream.sent(DONE)


def test_a_response_that_breaks_ends_with_error_and_failed_events() -> None:
    """A Responses stream has no ``[DONE]``: it ends as a replica ends one that fails, an
    ``error`` event and a ``response.failed`` numbered on from the highest event sent,
    whatever the chunks' boundaries."""
    from conveyor.gateway.sse import DONE, StreamEnd

    created = {"id": "resp_1", "object": "response", "status": "in_progress", "output": []}
    first = _sse("response.created", 0, response=created) + _sse(
        "response.in_progress", 1, response=created
    )
    stream = StreamEnd(first)
    assert not stream.ended
    assert b'"sequence_number":2' in stream.error("x").replace(b" ", b"")
    deltas = b"".join(_sse("response.output_text.delta", n, delta="a") for n in range(2, 42))
    for at in range(0, len(deltas), 7):  # chunks that cut events and numbers anywhere
        assert not stream.sent(deltas[at : at + 7])
    out = stream.error("replica gone")
    assert not out.endswith(DONE)
    events = [e for e in out.decode().split("\n\n") if e]
    assert [e.split("\n")[0] for e in events] == ["event: error", "event: response.failed"]
    error, failed = (json.loads(e.split("\n")[1].removeprefix("data: ")) for e in events)
    assert (error["sequence_number"], failed["sequence_number"]) == (42, 43)
    assert error["message"] == "replica gone"
    assert failed["response"]["id"] == "resp_1"
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["message"] == "replica gone"


def test_a_response_ends_once_its_last_event_is_whole() -> None:
    from conveyor.gateway.sse import StreamEnd

    stream = StreamEnd(_sse("response.created", 0, response={"id": "r"}))
    # the text "event: response.completed" generated by the model is no end
    assert not stream.sent(_sse("response.output_text.delta", 1, delta="event: response.completed"))
    done = _sse("response.completed", 2, response={"id": "r", "output": ["x" * 300]})
    assert not stream.sent(done[:30])  # its name came, its data not yet
    assert not stream.sent(done[30:100])
    assert stream.sent(done[100:])


def test_a_replica_has_the_limits_of_the_source_that_lists_it() -> None:
    """Two LLMServices serving one model name: each replica has its own LLMService's bounds,
    and they go with the source that gave them."""
    registry = Registry(
        lambda name: make_policy(name or "round-robin", bounded_load_factor=1.25, ring_vnodes=10)
    )
    small, large = Limits(max_running=4), Limits(max_running=64, max_queued=8)
    registry.sync("a", {"m": {"http://a:1"}}, limits={"m": small})
    registry.sync("b", {"m": {"http://b:1"}}, limits={"m": large})
    registry.sync("static", {"m": {"http://a:1", "http://s:1"}})  # knows no limits
    assert registry.limits_of("http://a:1") == small
    assert registry.limits_of("http://b:1") == large
    assert registry.limits_of("http://s:1") == Limits()
    registry.forget("a")
    assert registry.limits_of("http://a:1") == Limits()  # still listed, by static alone
    registry.sync("b", {"m": {"http://b:1"}})
    assert registry.limits_of("http://b:1") == Limits()


def test_the_silence_watch_passes_over_a_head_whose_timeout_already_fired() -> None:
    from conveyor.gateway.upstream_attempt import SilenceWatch, _HeadWait

    async def run() -> float:
        loop = asyncio.get_running_loop()
        watch = SilenceWatch(timeout_s=5.0)
        replica = Replica("http://r:1")
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0) as fired:
                watch.heads.add(_HeadWait(fired, replica, loop.time()))
                await asyncio.sleep(1)
        async with asyncio.timeout(1) as waiting:
            watch.heads.add(_HeadWait(waiting, replica, loop.time()))
            replica.progress_at = loop.time() + 100  # the replica works on
            watch.look(loop.time())  # no RuntimeError from the fired one
            when = waiting.when()
        assert when is not None
        return when - loop.time()

    assert asyncio.run(run()) > 100
