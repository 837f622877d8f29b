"""``conveyor bench serve-compare``'s runs: every mode under every policy, each labelled by
what varies, and the ratios taken to the first run."""

from __future__ import annotations

from conveyor.bench.serve.compare import _ratios, variants


def test_variants_label_only_what_varies():
    assert [label for label, _ in variants(["continuous", "static"], ["fcfs"])] == [
        "continuous",
        "static",
    ]
    assert variants(["continuous"], ["fcfs", "lpm"]) == [
        ("fcfs", ["--scheduler", "continuous", "--scheduling-policy", "fcfs"]),
        ("lpm", ["--scheduler", "continuous", "--scheduling-policy", "lpm"]),
    ]
    assert [label for label, _ in variants(["continuous", "none"], ["fcfs", "lpm"])] == [
        "continuous/fcfs",
        "continuous/lpm",
        "none/fcfs",
        "none/lpm",
    ]


def test_ratios_are_to_the_first_run():
    runs = {
        "fcfs": {"output_throughput": 50.0, "ttft_p50": 2.0},
        "lpm": {"output_throughput": 150.0, "ttft_p50": 0.5},
    }
    assert _ratios(runs) == {
        "fcfs": {"output_throughput": 1.0, "ttft_p50": 1.0},
        "lpm": {"output_throughput": 3.0, "ttft_p50": 0.25},
    }
