"""The one process owner of every benchmark (and of the servers the tests start): servers,
gateways, stubs and operators.

``with ChildProcess("gateway", lambda port: [...]) as gateway: gateway.url``. ``start()``
returns once the child answers its ready path; ``stop()`` ends its whole process group
(SIGTERM, then SIGKILL). Its log is kept in a file, shown when it fails to come up, and
left on disk when the child dies by itself.

Ports never race: a child that reports the port it bound (``reports_port``: a line
``listening on http://HOST:PORT`` in its log, as ``conveyor serve`` and the gateway stub
print) is started on port 0; any other gets a free port and is started again on another
one if it finds the port taken in the meantime. A port the caller fixes (``port=``, a URL
handed out before the child starts) stays as it is.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType

import httpx

from conveyor.bench.wait import wait_until
from conveyor.cluster.cgroups import ClusterCgroup

LISTENING = re.compile(r"listening on http://(?P<host>[^:\s]+):(?P<port>\d+)")
"""The line a child that binds port 0 prints with the port it got."""
PORT_TAKEN = re.compile(r"address already in use|EADDRINUSE|Errno 98", re.IGNORECASE)
PORT_ATTEMPTS = 5
"""Starts on a fresh port before a child whose port keeps being taken is given up on."""


def start_all(children: list[ChildProcess]) -> None:
    """Start ``children`` together, then wait for each; all stopped if one fails."""
    try:
        for child in children:
            child.launch()
        for child in children:
            child.wait_ready()
    except BaseException:
        for child in children:
            child.stop()
        raise


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now; a child started on it may still lose it to another
    process, which ``ChildProcess`` notices and retries."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def python_module(module: str, *args: str) -> list[str]:
    """The command line of ``python -m MODULE ARGS`` with this interpreter."""
    return [sys.executable, "-m", module, *args]


class _PortTaken(Exception):
    pass


class ChildProcess:
    """One process a benchmark owns, on a loopback port; ``command(port)`` is its argv."""

    def __init__(
        self,
        name: str,
        command: Callable[[int], list[str]],
        *,
        ready_path: str | None = "/health",
        reports_port: bool = False,
        ready_timeout: float = 60.0,
        env: Mapping[str, str | None] | None = None,
        log_path: Path | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        cpu_limit: float | None = None,
    ) -> None:
        self.name = name
        self.command = command
        self.ready_path = ready_path
        """GET this until it answers 200; None: started is ready."""
        self.reports_port = reports_port
        self.ready_timeout = ready_timeout
        self.env = dict(env or {})
        """Added to this process's environment; a None value removes the variable."""
        self.keep_log = log_path is not None
        """A log path given by the caller is kept; a temporary one goes with a clean stop."""
        self.log_path = log_path
        self.host = host
        self.fixed_port = port
        """A port the caller chose (a URL handed out before the child starts): the child is not
        moved to another when it finds it taken. None: a free one, or 0 where it reports."""
        self.port = 0 if port is None else port
        """The port it listens on: known from the start when fixed, else once it started."""
        self.cpu_limit = cpu_limit
        """CPUs the child (and its children) may use, as a pod's ``limits.cpu``: a cgroup of its
        own with a CFS quota (root only). None: no limit."""
        self._cgroup: ClusterCgroup | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None
        """Seconds from the start to the first ready answer."""
        self._started = 0.0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} was not started"
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def logs(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` to the child itself (SIGTERM: a server drains, then exits)."""
        assert self.proc is not None, f"{self.name} was not started"
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        """The child's exit code once it exits; TimeoutExpired after ``timeout`` seconds."""
        assert self.proc is not None, f"{self.name} was not started"
        return self.proc.wait(timeout)

    def start(self) -> ChildProcess:
        """Start the child and wait until it is ready."""
        self.launch()
        self.wait_ready()
        return self

    def launch(self) -> None:
        """Start the child without waiting (``wait_ready`` next): children start together.
        RuntimeError while it runs: a second start would leave the first process unowned."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(
                f"{self.name} is already running (pid {self.proc.pid}); stop it before "
                "starting it again (a `with` block starts it already)"
            )
        if self.fixed_port is not None:
            self.port = self.fixed_port
        else:
            self.port = 0 if self.reports_port else free_port(self.host)
        if self.log_path is None:
            fd, path = tempfile.mkstemp(prefix=f"conveyor-bench-{self.name}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(path)
        self._started = time.monotonic()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self.command(self.port),
                stdout=log,
                stderr=subprocess.STDOUT,
                env={k: v for k, v in env.items() if v is not None},
                start_new_session=True,  # stop() ends the child's own children too
            )
        if self.cpu_limit is not None:
            self._limit_cpu(self.proc.pid, self.cpu_limit)

    def _limit_cpu(self, pid: int, cores: float) -> None:
        """Move the just-started child into a cgroup capped at ``cores`` CPUs (what it forks
        later stays there); a machine that refuses says so and the child runs unlimited."""
        cgroup = ClusterCgroup(f"bench-{self.name}-{pid}")
        try:
            cgroup.create()
            cgroup.limit_cpu(cores)
            for procs in cgroup.procs_files():
                procs.write_text(str(pid))
        except OSError as exc:
            print(f"{self.name}: cannot limit it to {cores:g} CPUs ({exc}); it runs unlimited",
                  file=sys.stderr)  # fmt: skip
        self._cgroup = cgroup

    def wait_ready(self) -> None:
        """Until the child answers; started again on a fresh port if it lost its port. A
        child that exits or never answers is stopped, and the error shows its log."""
        for _ in range(PORT_ATTEMPTS):
            try:
                self._wait_ready()
                return
            except _PortTaken:
                self._end()
                self.launch()
            except BaseException:
                self.stop()
                raise
        self.stop()
        raise RuntimeError(f"{self.name}: its port was taken {PORT_ATTEMPTS} times in a row")

    def _wait_ready(self) -> None:
        with httpx.Client(timeout=2.0) as http:

            def ready() -> bool:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    log = self.logs()
                    movable = not self.reports_port and self.fixed_port is None
                    if movable and PORT_TAKEN.search(log):
                        raise _PortTaken
                    raise RuntimeError(
                        f"{self.name} exited with {self.proc.returncode}:\n{log[-3000:]}"
                    )
                if self.port == 0:
                    found = LISTENING.search(self.logs())
                    if found is None:
                        return False
                    self.port = int(found.group("port"))
                if self.ready_path is None:
                    return True
                try:
                    return http.get(self.url + self.ready_path).status_code == 200
                except httpx.TransportError:
                    return False  # not listening yet

            try:
                wait_until(ready, self.ready_timeout, f"{self.name} to be ready")
            except TimeoutError as exc:
                raise TimeoutError(f"{exc}; its log:\n{self.logs()[-3000:]}") from None
        self.startup_s = time.monotonic() - self._started

    def _end(self, timeout: float = 30.0) -> int | None:
        """SIGTERM to the process group, SIGKILL after ``timeout``; the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._drop_cgroup()
        return self.proc.returncode

    def _drop_cgroup(self) -> None:
        if self._cgroup is not None:
            self._cgroup.remove()
            self._cgroup = None

    def kill(self) -> None:
        """SIGKILL to the process group: the child vanishes mid-request, as a crashed pod would."""
        if self.alive():
            assert self.proc is not None
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._drop_cgroup()

    def stop(self, timeout: float = 30.0) -> int | None:
        """End the child; its log stays when it had died by itself (and says where)."""
        died = self.proc is not None and self.proc.poll() not in (None, 0)
        code = self._end(timeout)
        if died:
            print(f"{self.name} had exited with {code}; its log: {self.log_path}", file=sys.stderr)
        elif self.log_path is not None and not self.keep_log:
            self.log_path.unlink(missing_ok=True)
        return code

    def __enter__(self) -> ChildProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def conveyor_serve(
    args: list[str],
    *,
    name: str = "conveyor",
    ready_timeout: float = 180.0,
    log_path: Path | None = None,
    cpu_limit: float | None = None,
    env: Mapping[str, str | None] | None = None,
) -> ChildProcess:
    """``conveyor serve ARGS`` on loopback, on the port it binds and reports; ready at /ready;
    ``cpu_limit``: CPUs it may use (``ChildProcess.cpu_limit``); ``env``: added to its
    environment (``ChildProcess.env``)."""
    return ChildProcess(
        name,
        lambda port: python_module(
            "conveyor", "serve", "--host", "127.0.0.1", "--port", str(port), *args
        ),
        ready_path="/ready",
        reports_port=True,
        ready_timeout=ready_timeout,
        log_path=log_path,
        cpu_limit=cpu_limit,
        env=env,
    )
