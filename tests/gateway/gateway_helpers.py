"""Helpers for the gateway tests: processes on loopback ports, each owned by the project's one
process owner (``conveyor.bench.procs.ChildProcess``)."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from conveyor.bench.procs import ChildProcess
from conveyor.gateway.auth import API_KEY_ENV

PYTHON = sys.executable


class Process(ChildProcess):
    """A child of a gateway test: ``start()`` does not wait (``wait_http`` waits for a path),
    $CONVEYOR_API_KEY is unset, and its log stays until the test's teardown shows or removes it.

    ``argv`` is its command line, or a function of the port it gets; ``port`` fixes the port
    (a URL handed out before the child starts), None takes a free one when it starts."""

    def __init__(
        self, name: str, argv: list[str] | Callable[[int], list[str]], port: int | None = None
    ) -> None:
        fd, log = tempfile.mkstemp(prefix=f"conveyor-{name}-", suffix=".log")
        os.close(fd)
        super().__init__(
            name,
            argv if callable(argv) else lambda _port: argv,
            ready_path=None,
            env={API_KEY_ENV: None},
            log_path=Path(log),
            port=port,
        )

    def wait_http(self, path: str, timeout: float = 60.0) -> None:
        """Until ``path`` answers 200; the child is stopped, and the error shows its log, if it
        exits first."""
        self.ready_path, self.ready_timeout = path, timeout
        self.wait_ready()


def stub(port: int | None = None, **options: object) -> Process:
    flags = [
        arg for key, value in options.items() for arg in ("--" + key.replace("_", "-"), str(value))
    ]
    return Process(
        "stub",
        lambda p: [PYTHON, "-m", "conveyor.bench.gateway.stub", "--port", str(p), *flags],
        port,
    )


def gateway(*args: str, port: int | None = None) -> Process:
    return Process(
        "gateway",
        lambda p: [PYTHON, "-m", "conveyor.cli", "gateway", "--host", "127.0.0.1", "--port", str(p),
                   "--load-poll-interval", "0.1", "--discovery-interval", "0.2", *args],
        port,
    )  # fmt: skip


class Processes:
    """Owner of every process a test starts: all stopped at teardown, logs shown on failure."""

    def __init__(self) -> None:
        self.all: list[Process] = []

    def start(self, process: Process) -> Process:
        self.all.append(process)
        process.start()
        return process

    def stop_all(self) -> None:
        for process in reversed(self.all):
            process.stop()

    def logs(self) -> str:
        return "\n".join(f"----- {p.name} {p.url} -----\n{p.logs()[-3000:]}" for p in self.all)
