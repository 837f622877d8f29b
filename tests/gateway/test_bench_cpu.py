"""``python -m conveyor.bench.gateway.cpu``, as its docstring runs it but small: the gateway's
CPU per request in front of stub replicas that answer as Conveyor replicas do."""

from __future__ import annotations

import json

import pytest

from conveyor.bench.gateway import cpu
from conveyor.bench.gateway.settings import BenchSettings


def test_the_workload_is_the_routing_parts_chats() -> None:
    s = BenchSettings()
    streamed = [json.loads(b) for b in cpu.chat_bodies(s, stream=True)]
    assert len(streamed) == s.users * s.turns
    assert streamed[0]["stream_options"] == {"include_usage": True}
    first, last = streamed[0]["messages"], streamed[s.turns - 1]["messages"]
    assert last[: len(first)] == first  # a conversation grows turn by turn
    assert len(last) == len(first) + 2 * (s.turns - 1)
    plain = json.loads(cpu.chat_bodies(s, stream=False)[0])
    assert "stream" not in plain and plain["messages"] == first


def test_the_bench_prints_cpu_per_request(capsys: pytest.CaptureFixture[str]) -> None:
    # Enough requests that the proxy's CPU spans many of /proc's 10 ms clock ticks: 24 of
    # them (about 1 ms each) once read as 0 ticks on a quick machine.
    argv = ["--requests", "240", "--rounds", "1", "--users", "8", "--token-interval-ms", "0"]
    assert cpu.main(argv) == 0
    out = capsys.readouterr().out
    assert "proxy CPU ms/req (user + system), median over 1 rounds of 240 requests" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("conveyor "))
    streamed, plain = (float(v) for v in row.split()[1:3])
    assert streamed > 0 and plain > 0
