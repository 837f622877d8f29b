"""The Responses API through the gateway, in units: a response that continues a stored one
goes to the replica that stores it, whatever the policy; its opening events are not its
first token; its opening is what prefix-aware routing keys on."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conveyor.contracts.load import ReplicaLoad
from conveyor.contracts.response_id import new_response_id, replica_tag, tag_of
from conveyor.gateway import sse
from conveyor.gateway.pool import NoCandidate, Registry
from conveyor.gateway.prefix_aware import PrefixAware
from conveyor.gateway.prefix_key import RouteRequest, routing_text
from conveyor.gateway.round_robin import RoundRobin
from conveyor.gateway.routing import LoadView

VIEW = LoadView(now=100.0, stale_after=1.0)
URLS = [f"http://10.0.0.{i}:8000" for i in range(4)]


@given(url=st.text(min_size=1, max_size=60), junk=st.text(max_size=20))
def test_an_id_carries_the_tag_it_was_given_and_nothing_else_reads_as_one(
    url: str, junk: str
) -> None:
    tag = replica_tag(url)
    assert tag_of(new_response_id(tag)) == tag
    other = new_response_id(junk)  # not a tag: the id gets a random one, well formed
    assert tag_of(other) is not None and other.startswith("resp_")
    assert tag_of(junk) is None
    assert tag_of(f"resp_{tag}") is None  # too short to be one of ours


def pool_of(policy_name: str):
    registry = Registry(lambda _name: RoundRobin() if policy_name == "rr" else PrefixAware())
    registry.sync("static", {"m": set(URLS)})
    pool = registry.pools["m"]
    for replica in pool.replicas.values():
        replica.record_poll(
            ReplicaLoad(0, 0, 0.0, 8, None, True), sent_at=VIEW.now, in_flight_then=0
        )
    return pool


def continuing(previous: str, text: str = "and then?") -> RouteRequest:
    body = {"model": "m", "input": text, "previous_response_id": previous}
    return RouteRequest("/v1/responses", body)


@pytest.mark.parametrize("policy", ["rr", "prefix"])
def test_a_continued_response_goes_to_the_replica_that_stores_it(policy: str) -> None:
    pool = pool_of(policy)
    for url in URLS:
        holder = pool.replicas[url]
        previous = new_response_id(holder.tag)
        for turn in range(5):
            decision = pool.choose(continuing(previous, f"turn {turn}"), VIEW, set())
            assert decision.replica is holder and decision.reason == "response_affinity"


def test_a_holder_that_cannot_take_it_now_is_waited_for_and_one_gone_is_not() -> None:
    """Another replica would answer 404 for a response it does not store: while the holder
    is in the pool but full, ejected or already tried, the request gets a retryable answer
    (429, or the last attempt's failure); once the holder has left, any replica says 404."""
    pool = pool_of("rr")
    holder = pool.replicas[URLS[0]]
    previous = new_response_id(holder.tag)
    holder.record_poll(ReplicaLoad(8, 2, 0.0, 8, 2, True), sent_at=VIEW.now, in_flight_then=0)
    assert pool.choose(continuing(previous), VIEW, set()) is NoCandidate.QUEUES_FULL
    holder.record_poll(ReplicaLoad(0, 0, 0.0, 8, None, True), sent_at=VIEW.now, in_flight_then=0)
    assert pool.choose(continuing(previous), VIEW, {holder.url}) is NoCandidate.NONE_READY
    holder.eject(VIEW.now, 5.0)
    assert pool.choose(continuing(previous), VIEW, set()) is NoCandidate.NONE_READY
    pool.set_replicas([r for r in pool.replicas.values() if r is not holder])
    assert pool.choose(continuing(previous), VIEW, set()).reason == "round_robin"


def test_a_response_is_keyed_by_its_instructions_and_first_user_message() -> None:
    first = {"instructions": "Be brief.", "input": "What is KV cache?"}
    later = {
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "What is KV cache?"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "A cache."}]},
            {"role": "user", "content": "And paging?"},
        ],
    }
    assert routing_text("/v1/responses", first) == "system\nBe brief.\nuser\nWhat is KV cache?\n"
    assert routing_text("/v1/responses", later) == routing_text("/v1/responses", first)
    assert routing_text("/v1/responses", {"input": 7}) == ""  # the replica answers the 400
    assert RouteRequest("/v1/responses", first).response_tag is None


def test_a_responses_stream_opening_events_are_not_its_first_token() -> None:
    created = b'event: response.created\ndata: {"type":"response.created"}\n\n'
    progress = b'event: response.in_progress\ndata: {"type":"response.in_progress"}\n\n'
    delta = b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta"}\n\n'
    assert not sse.has_token(created + progress)
    assert sse.has_token(created + progress + delta)
