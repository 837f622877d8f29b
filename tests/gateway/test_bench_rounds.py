"""``conveyor bench gateway``'s routing rounds without replicas: the order runs take in each
round, the median and range over rounds, the per-round ratio, and how a turn that missed
its conversation's cache is told from the stream's usage event."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest

from conveyor.bench.gateway import rounds
from conveyor.bench.gateway.routing import parse_policies
from conveyor.bench.gateway.settings import BenchSettings
from conveyor.bench.gateway.workload import Turn, _usage, missed_turns, moved_turns


def test_policies_option() -> None:
    assert parse_policies("prefix-aware, least-load") == ["prefix-aware", "least-load"]
    with pytest.raises(ValueError, match=r"--policies takes .*prefix-aware"):
        parse_policies("prefix-aware,cache_aware")
    with pytest.raises(ValueError):
        parse_policies(" , ")


@dataclass(frozen=True)
class _Run:
    proxy: str
    policy: str

    @property
    def label(self) -> str:
        return f"{self.proxy} {self.policy}"


def test_each_round_runs_every_proxy_once_in_a_rotated_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    order: list[str] = []

    def one_run(run: _Run, s: BenchSettings, urls: list[str], salt: str) -> rounds.Figures:
        order.append(run.label)
        assert salt.startswith(run.label) or salt == "warm-up"  # fresh text per run and round
        return {"ttft_p50": float(len(order)), "req_s": 1.0, "wall": 1.0, "load": 0.5}

    monkeypatch.setattr(rounds, "one_run", one_run)
    runs = [_Run("conveyor", "prefix-aware"), _Run("a", "x"), _Run("b", "y")]
    figures, per_round = rounds.interleaved(BenchSettings(rounds=3), runs, [])  # type: ignore[arg-type]
    assert order == ["conveyor prefix-aware",  # the warm-up, not counted
                     "conveyor prefix-aware", "a x", "b y", "a x", "b y", "conveyor prefix-aware",
                     "b y", "conveyor prefix-aware", "a x"]  # fmt: skip
    assert [f["ttft_p50"] for f in per_round["a x"]] == [3.0, 5.0, 10.0]
    assert [f["ttft_p50"] for f in per_round["conveyor prefix-aware"]] == [2.0, 7.0, 9.0]
    assert figures["a x"]["ttft_p50"] == 5.0
    assert (figures["a x"]["ttft_p50_lo"], figures["a x"]["ttft_p50_hi"]) == (3.0, 10.0)


def test_ratio_is_taken_against_the_best_peer_of_the_same_round() -> None:
    per_round = {
        "mine": [{"t": 2.0}, {"t": 6.0}],
        "p": [{"t": 4.0}, {"t": 3.0}],
        "q": [{"t": 1.0}, {"t": 12.0}],
    }
    assert rounds.ratio_per_round(per_round, "mine", ["p", "q"], "t", lower=True) == [2.0, 2.0]
    assert rounds.ratio_per_round(per_round, "mine", ["p", "q"], "t", lower=False) == [0.5, 0.5]


def _stream(*events: dict[str, object]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + (
        b"data: [DONE]\n\n"
    )


def test_usage_comes_from_the_streams_last_usage_event() -> None:
    usage = {"prompt_tokens": 900, "completion_tokens": 8, "total_tokens": 908,
             "prompt_tokens_details": {"cached_tokens": 640}}  # fmt: skip
    stream = _stream(
        {"choices": [{"delta": {"role": "assistant"}}], "usage": None},
        {"choices": [{"delta": {"content": "hi"}}], "usage": None},
        {"choices": [], "usage": usage},
    )
    assert _usage(stream) == (900, 640)
    assert _usage(_stream({"choices": [{"delta": {"content": "hi"}}]})) == (None, None)


def _turn(user: int, turn: int, prompt: int, cached: int | None, backend: str | None) -> Turn:
    return Turn(user, turn, 0.1, 0.2, prompt, cached, backend)


def test_a_turn_that_found_little_of_its_conversation_cached_missed() -> None:
    turns = [
        _turn(0, 0, 1000, 200, "a"), _turn(0, 1, 1100, 1000, "a"), _turn(0, 2, 1200, 200, "b"),
        _turn(1, 0, 1000, 0, "b"), _turn(1, 1, 1100, None, "b"),
    ]  # fmt: skip
    assert missed_turns(turns) == (1, 2)  # user 0's third turn; user 1's second is unknown
    assert moved_turns(turns) == 1
    assert moved_turns([_turn(0, 0, 1000, 0, None)]) is None


def test_cpu_seconds_and_load_average_read_this_machine() -> None:
    assert rounds.cpu_seconds(os.getpid()) > 0
    assert rounds.load_average() >= 0


def test_added_latency_is_taken_against_direct_within_each_round() -> None:
    from conveyor.bench.gateway.overhead import Probes, _added_per_round

    per_round = {
        "direct": [Probes(ttft=[0.001, 0.002, 0.003]), Probes(ttft=[0.010, 0.010, 0.010])],
        "conveyor": [Probes(ttft=[0.002, 0.003, 0.004]), Probes(ttft=[0.012, 0.012, 0.012])],
    }
    added = _added_per_round(per_round, "conveyor", "ttft", 50)
    assert added == pytest.approx([0.001, 0.002])
