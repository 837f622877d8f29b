"""Helpers for the gateway tests: processes on loopback ports, each with one owner."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(
    condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.05
) -> None:
    """Poll ``condition`` until it holds; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class Process:
    """One child process with its log kept in a file; ``stop()`` ends it and its children."""

    def __init__(self, name: str, argv: list[str], port: int) -> None:
        self.name = name
        self.argv = argv
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(tempfile.mkstemp(prefix=f"conveyor-{name}-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Process:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("CONVEYOR_API_KEY", None)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env=env,
                start_new_session=True,
            )
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_http(self, path: str, timeout: float = 60.0) -> None:
        def ok() -> bool:
            if not self.alive():
                raise AssertionError(f"{self.name} exited early:\n{self.log()[-4000:]}")
            try:
                return httpx.get(self.url + path, timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ok, timeout, f"{self.name} {path} to answer 200")

    def kill(self) -> None:
        """SIGKILL: the replica vanishes mid-request, as a crashed pod would."""
        if self.alive():
            assert self.proc is not None
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if not self.alive():
            return
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> Process:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stub(port: int | None = None, **options: object) -> Process:
    port = port or free_port()
    argv = [PYTHON, "-m", "conveyor.bench.gateway.stub", "--port", str(port)]
    for key, value in options.items():
        argv += ["--" + key.replace("_", "-"), str(value)]
    return Process(f"stub-{port}", argv, port)


def gateway(*args: str, port: int | None = None) -> Process:
    port = port or free_port()
    argv = [PYTHON, "-m", "conveyor.cli", "gateway", "--host", "127.0.0.1", "--port", str(port),
            "--load-poll-interval", "0.1", "--discovery-interval", "0.2", *args]  # fmt: skip
    return Process(f"gateway-{port}", argv, port)


class Processes:
    """Owner of every process a test starts: all stopped at teardown, logs shown on failure."""

    def __init__(self) -> None:
        self.all: list[Process] = []

    def start(self, process: Process) -> Process:
        self.all.append(process)
        return process.start()

    def stop_all(self) -> None:
        for process in reversed(self.all):
            process.stop()

    def logs(self) -> str:
        return "\n".join(f"----- {p.name} -----\n{p.log()[-3000:]}" for p in self.all)
