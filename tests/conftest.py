"""Session-wide test settings.

The machines that run the tests have two cores shared by the Go build, the
servers under test and pytest itself; torch's OpenMP pool spin-waits badly
when oversubscribed (measured: a 10x slower engine step), so in-process torch
work uses one thread. Servers started by tests pass ``--num-threads`` themselves.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config: object) -> None:
    from conveyor.cluster.testing import end_on_sigterm

    end_on_sigterm()  # a stopped run takes its clusters down
