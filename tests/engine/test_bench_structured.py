"""``conveyor bench structured`` runs end to end and writes its figures (no timing asserted)."""

from __future__ import annotations

import json

from conveyor.bench.engine.structured import main


def test_writes_compile_times_and_a_step_time_per_fraction(tmp_path, capsys):
    out = tmp_path / "structured.json"
    argv = ["--model", "conveyor-tiny", "--max-total-tokens", "2048", "--num-threads", "1"]
    assert main([*argv, "--batch", "4", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["compile"]) == {"compiler_setup_ms", "cold_ms", "cached_us"}
    assert [r["constrained_percent"] for r in doc["steps"]] == [0, 50, 100]
    assert all(r["step_ms"] > 0 for r in doc["steps"])
    assert "constrained" in capsys.readouterr().out
