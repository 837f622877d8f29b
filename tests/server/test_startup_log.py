"""The start-up line: once the model is loaded, one INFO line says how long the replica took
from exec and where the time went (what `kubectl logs` shows for a slow scale-up)."""

from __future__ import annotations

import re

from conveyor.bench.procs import ChildProcess
from conveyor.runtime.server.app import STARTUP_STEPS, startup_line

LINE = re.compile(r"ready in (\d+\.\d) s \(CPU (\d+\.\d) s\): (.*)")


def test_a_real_server_logs_where_its_start_up_went(server: ChildProcess) -> None:
    lines = [m for line in server.logs().splitlines() if (m := LINE.search(line))]
    assert len(lines) == 1, server.logs()
    total, cpu, steps = float(lines[0][1]), float(lines[0][2]), lines[0][3].split(", ")
    assert cpu > 0
    seconds = {}
    for step in steps:
        label, value, unit = step.rsplit(" ", 2)
        assert unit == "s"
        seconds[label] = float(value)
    assert list(seconds) == [label for _, label in STARTUP_STEPS]
    assert all(s >= 0 for s in seconds.values())
    # The steps are the parts of the whole: they add up to at most it (each rounded to 0.1 s).
    assert sum(seconds.values()) <= total + 0.05 * len(seconds)


def test_the_line_names_only_the_steps_measured() -> None:
    line = startup_line(3.04, {"engine imports": 1.0, "weights": 0.5})
    assert line == "ready in 3.0 s: engine imports (torch) 1.0 s, weights 0.5 s"
    assert startup_line(None, {}) == "ready"
    assert startup_line(3.04, {"weights": 0.5}, cpu=2.26) == (
        "ready in 3.0 s (CPU 2.3 s): weights 0.5 s"
    )
