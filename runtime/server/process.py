"""A ``conveyor serve`` child process: the one owner of a replica that a test, a benchmark
or the gateway's tests start. ``with ServerProcess([...]) as server: server.url``.

It binds port 0 unless told otherwise and reads the port it got from its log, so
replicas started together never race for a port. Its log is kept in a file and shown
when it fails to come up.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import httpx

_LISTENING = re.compile(r"listening on http://(?P<host>[^:\s]+):(?P<port>\d+)")


class ServerProcess:
    """``conveyor serve ARGS`` on loopback; ``start()`` returns once ``/ready`` is 200."""

    def __init__(
        self,
        args: list[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        ready_timeout: float = 180.0,
        env: dict[str, str] | None = None,
        log_dir: str | None = None,
    ) -> None:
        self.args = list(args)
        self.host = host
        self.port = port
        self.ready_timeout = ready_timeout
        self.env = env
        self.log_dir = log_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None
        self._log: io.BufferedWriter | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServerProcess:
        cmd = [
            sys.executable,
            "-m",
            "conveyor",
            "serve",
            "--host",
            self.host,
            "--port",
            str(self.port),
            *self.args,
        ]
        fd, path = tempfile.mkstemp(prefix="conveyor-serve-", suffix=".log", dir=self.log_dir)
        os.close(fd)
        self.log_path = Path(path)
        self._log = self.log_path.open("wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {})}
        # cwd outside the checkout: the repository root must never be on sys.path.
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=tempfile.gettempdir()
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        assert self.proc is not None and self.log_path is not None
        deadline = time.monotonic() + self.ready_timeout
        with httpx.Client(timeout=2.0) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"conveyor serve exited with {self.proc.returncode}:\n{self.logs()}"
                    )
                if self.port == 0:
                    m = _LISTENING.search(self.logs())
                    if m:
                        self.port = int(m.group("port"))
                if self.port:
                    try:
                        if http.get(f"{self.url}/ready").status_code == 200:
                            return
                    except httpx.TransportError:
                        pass
                time.sleep(0.05)
        raise TimeoutError(
            f"conveyor serve was not ready within {self.ready_timeout:.0f}s:\n{self.logs()}"
        )

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def signal(self, sig: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (a drain), then SIGKILL after ``timeout``; the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
