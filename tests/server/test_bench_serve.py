"""``conveyor bench serve`` against a real server: it completes, prints, writes JSON and a plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conveyor.bench.procs import ChildProcess
from conveyor.bench.serve import command as bench
from conveyor.bench.serve import workload
from conveyor.bench.stats import percentile


@pytest.mark.parametrize(
    "load", [["--concurrency", "4"], ["--request-rate", "50", "--endpoint", "chat"]]
)
def test_bench_serve(
    server: ChildProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str], load: list[str]
) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = bench.main(
        [
            "--url",
            server.url,
            "--num-requests",
            "6",
            "--input-len-min",
            "4",
            "--input-len-max",
            "16",
            "--output-len-mean",
            "3",
            "--output-len-max",
            "6",
            "--shared-prefix-len",
            "16",
            "--warmup",
            "1",
            "--no-progress",
            "--json",
            str(out),
            "--plot",
            str(png),
            *load,
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "TTFT mean/p50/p95/p99" in printed
    summary = json.loads(out.read_text())
    assert summary["completed"] == 6 and summary["errors"] == {}
    assert summary["output_tokens"] == sum(
        r.max_tokens
        for r in workload.build_workload(
            workload.WorkloadSettings(
                num_requests=6,
                input_len_min=4,
                input_len_max=16,
                output_len_mean=3,
                output_len_max=6,
                shared_prefix_len=16,
            ),
            "completions",
        )
    )
    for key in ("ttft_p50", "ttft_p99", "tpot_p50", "itl_p95", "e2e_p99", "output_throughput"):
        assert summary[key] is not None and summary[key] > 0, key
    assert summary["server"]["engine_steps"] > 0
    assert png.stat().st_size > 0


def test_percentile_matches_linear_interpolation() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)


def test_workload_is_reproducible_and_bounded() -> None:
    w = workload.WorkloadSettings(
        num_requests=50,
        input_len_min=5,
        input_len_max=9,
        output_len_mean=10,
        output_len_max=20,
        shared_prefix_len=4,
        num_prefix_groups=2,
        seed=3,
    )
    a, b = workload.build_workload(w, "completions"), workload.build_workload(w, "completions")
    assert a == b
    assert all(9 <= r.prompt_len <= 13 and 1 <= r.max_tokens <= 20 for r in a)
    assert a[0].prompt[:4] == a[2].prompt[:4] != a[1].prompt[:4]
