"""``conveyor bench startup``: it reads the server's own start-up line and ``-X importtime``'s
lines, and runs a git revision's code from a tree laid out as the installed package."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conveyor.bench.startup import import_times, parse_ready_line, revision_code
from conveyor.runtime.server.app import STARTUP_STEPS, startup_line


def test_the_start_up_line_is_read_back_step_by_step() -> None:
    timings = {key: 0.1 * (i + 1) for i, (key, _) in enumerate(STARTUP_STEPS)}
    log = f"2026-12-03 INFO conveyor.runtime.server: {startup_line(9.14, timings, 2.26)}\n"
    start = parse_ready_line(log)
    assert start is not None
    assert (start.server_s, start.cpu_s) == (9.1, 2.3)
    assert list(start.steps.values()) == [round(t, 1) for t in timings.values()]
    assert list(start.steps)[:2] == ["process", "torch"]
    assert parse_ready_line("INFO resolving model 'conveyor-tiny'\n") is None
    assert parse_ready_line(startup_line(1.0, {"weights": 0.5})).cpu_s is None  # type: ignore[union-attr]


def test_import_times_add_up_each_package_wherever_it_was_imported() -> None:
    log = "\n".join(
        [
            "import time: self [us] | cumulative | imported package",
            "import time:       300 |        300 |     torch._C",
            "import time:      1000 |       1300 |   torch",
            "INFO something else",
            "import time:       200 |        200 |       transformers.utils",
            "import time:       500 |       2000 | transformers",
        ]
    )
    assert import_times(log) == {"torch": 1300 / 1e6, "transformers": 700 / 1e6}


def test_a_revisions_code_is_imported_from_its_own_tree() -> None:
    with revision_code("HEAD") as code:
        assert code.pythonpath is not None
        out = subprocess.run(
            [sys.executable, "-c", "import conveyor.runtime.server.app as m; print(m.__file__)"],
            env={**os.environ, **code.env()},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert Path(out).resolve().is_relative_to(Path(code.pythonpath).resolve())
