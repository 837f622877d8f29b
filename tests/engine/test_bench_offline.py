"""``conveyor bench offline`` runs end to end and writes the JSON it promises (no timing asserted)."""

from __future__ import annotations

import json

from conveyor.bench.engine.offline import main

KEYS = {
    "mode",
    "output_throughput",
    "ttft_p50",
    "ttft_p95",
    "tpot_p50",
    "tpot_p95",
    "mean_running",
    "max_running",
    "preemptions",
}


def test_compare_writes_every_mode(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(
        [
            "--compare",
            "--model",
            "conveyor-tiny",
            "--num-requests",
            "12",
            "--prompt-len-min",
            "4",
            "--prompt-len-max",
            "24",
            "--output-len-mean",
            "6",
            "--output-len-max",
            "16",
            "--max-running-requests",
            "4",
            "--max-total-tokens",
            "2048",
            "--num-threads",
            "1",
            "--sweep",
            "1,2",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    modes = {m["mode"]: m for m in doc["modes"]}
    assert set(modes) == {"continuous", "static", "none", "hf-generate"}
    for m in modes.values():
        assert set(m) >= KEYS, f"{m['mode']} lacks {KEYS - set(m)}"
        assert m["num_requests"] == 12
    # The schedule, not the clock: continuous needs no more steps than static.
    assert modes["continuous"]["steps"] <= modes["static"]["steps"] <= modes["none"]["steps"]
    assert doc["ideal_static_ratio"] >= 1.0
    assert modes["continuous"]["max_running"] <= 4 and modes["none"]["max_running"] == 1
    printed = capsys.readouterr().out
    assert "ideal continuous/X throughput ratio" in printed and "decode step time" in printed


def test_compare_runs_on_the_real_model(tmp_path):
    """The built-in GGUF model, with transformers reading the same file as the HF baseline."""
    out = tmp_path / "bench.json"
    rc = main(
        ["--compare", "--skip-none", "--model", "smollm2-135m-instruct", "--num-requests", "4",
         "--prompt-len-min", "4", "--prompt-len-max", "16", "--output-len-mean", "3",
         "--output-len-max", "4", "--max-running-requests", "4", "--max-total-tokens", "1024",
         "--num-threads", "1", "--sweep", "", "--json", str(out)]
    )  # fmt: skip
    assert rc == 0
    modes = {m["mode"]: m for m in json.loads(out.read_text())["modes"]}
    assert set(modes) == {"continuous", "static", "hf-generate"}
    assert all(m["output_tokens"] > 0 for m in modes.values())
