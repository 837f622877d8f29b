"""The output items of a response built from chat's deltas, with no model: every event
stream is well formed and adds up to the items, whatever the mix of thinking, text and
function calls; a whole answer is the same items; the store keeps the newest within its
bytes."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from conveyor.runtime.server.response_items import EventWriter, OutputItems, said_items
from conveyor.runtime.server.response_store import ResponseStore, StoredResponse

EVENTS = TypeAdapter(ResponseStreamEvent)
LOGPROB = {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}


@st.composite
def outputs(draw) -> list[list[dict]]:
    """Engine outputs as chat's chunk choices: thoughts, text, and calls (a call's id first,
    then its arguments, one call at a time as ``ToolCallStream`` sends them)."""
    steps: list[list[dict]] = []
    calls = 0
    open_call: int | None = None
    for kind in draw(st.lists(st.sampled_from(["think", "text", "empty", "call", "args"]))):
        logprobs = {"content": [LOGPROB]} if draw(st.booleans()) else None
        if kind == "think":
            delta = {"reasoning_content": draw(st.text(min_size=1, max_size=3))}
            open_call = None
        elif kind == "text":
            delta = {"content": draw(st.text(min_size=1, max_size=3))}
            open_call = None
        elif kind == "empty":  # a token with no text yet; a call stays open across it
            delta = {}
        elif kind == "call":
            call = {"name": "f", "arguments": draw(st.text(max_size=2))}
            delta = {"tool_calls": [{"index": calls, "id": f"call_{calls}", "function": call}]}
            open_call, calls = calls, calls + 1
        elif open_call is not None:
            arguments = draw(st.text(min_size=1, max_size=3))
            delta = {"tool_calls": [{"index": open_call, "function": {"arguments": arguments}}]}
        else:
            continue
        steps.append([{"index": 0, "delta": delta, "logprobs": logprobs}])
    return steps


@given(steps=outputs(), cut_short=st.booleans())
def test_the_events_are_well_formed_and_add_up_to_the_items(
    steps: list[list[dict]], cut_short: bool
) -> None:
    out = EventWriter()
    streamed = OutputItems(out, want_logprobs=True)
    whole = OutputItems(want_logprobs=True)
    raw = []
    for parts in steps:
        raw += streamed.take(parts, 1)
        assert whole.take(parts, 1) == []  # no writer, no events
    raw += streamed.finish(cut_short)
    whole.finish(cut_short)
    events = [json.loads(e.split("\ndata: ", 1)[1]) for e in raw]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        assert EVENTS.validate_python(event).type == event["type"]
    items = streamed.done
    assert [i["type"] for i in items] == [i["type"] for i in whole.done]
    assert any(i["type"] in ("message", "function_call") for i in items)  # an answer, always
    opened: dict[int, dict] = {}
    texts: dict[int, str] = {}
    for e in events:
        at = e.get("output_index")
        if e["type"] == "response.output_item.added":
            assert at == len(opened) and at not in opened
            opened[at] = e["item"]
        elif e["type"] == "response.output_item.done":
            assert e["item"] == items[at] and e["item"]["id"] == opened[at]["id"]
        elif e["type"].endswith(".delta"):
            assert e["item_id"] == opened[at]["id"]
            texts[at] = texts.get(at, "") + e["delta"]
    assert len(opened) == len(items)
    for at, item in enumerate(items):
        said = {
            "message": lambda i: i["content"][0]["text"],
            "reasoning": lambda i: i["content"][0]["text"],
            "function_call": lambda i: i["arguments"],
        }[item["type"]](item)
        assert texts.get(at, "") == said
        if item["type"] == "function_call":
            last = at == len(items) - 1
            assert item["status"] == ("incomplete" if cut_short and last else "completed")
    # what a continuing response renders: the message and the calls, not the thinking
    assert len(said_items(items)) == sum(i["type"] != "reasoning" for i in items)


def test_a_thought_or_a_call_takes_no_message_logprobs() -> None:
    items = OutputItems(want_logprobs=True)
    lp = {"content": [LOGPROB]}
    items.take([{"delta": {"reasoning_content": "hm"}, "logprobs": lp}], 1)
    items.take([{"delta": {"content": "Hi"}, "logprobs": lp}], 1)
    items.take([{"delta": {}, "logprobs": lp}], 1)  # a character not whole yet: the text's
    call = {"index": 0, "id": "call_0", "function": {"name": "f", "arguments": "{"}}
    items.take([{"delta": {"tool_calls": [call]}, "logprobs": lp}], 1)
    items.finish(cut_short=False)
    assert [i["type"] for i in items.done] == ["reasoning", "message", "function_call"]
    assert len(items.done[1]["content"][0]["logprobs"]) == 2
    assert items.reasoning_tokens == 1


def test_the_store_keeps_the_newest_within_its_bytes() -> None:
    def stored(n: int) -> StoredResponse:
        return StoredResponse.of(
            {"id": n, "pad": "x" * 100}, [{"role": "user", "content": "q"}], [{"id": "msg_1"}]
        )

    size = stored(0).size
    store = ResponseStore(max_bytes=3 * size)
    for n in range(5):
        store.put(f"r{n}", stored(n))
    assert len(store) == 3 and store.used == 3 * size
    assert store.get("r1") is None and store.get("r4") is not None
    assert store.get("r4").messages() == [{"role": "user", "content": "q"}]
    assert store.delete("r4") and not store.delete("r4") and store.used == 2 * size
    huge = StoredResponse.of({"pad": "x" * 4 * size}, [], [])
    store.put("huge", huge)  # larger than the whole budget: not kept, nothing evicted
    assert store.get("huge") is None and len(store) == 2
    assert not ResponseStore(0).enabled
