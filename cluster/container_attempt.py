"""One attempt at running a container: its shim process, its files, its end.

Each start or restart of a container is a new attempt (``ContainerAttempt``); the pod
worker's ``ContainerRunner`` keeps a container going across its attempts (probes, restarts
with back-off). An attempt lives in ``<pod dir>/containers/<name>/<attempt>/``:
``spec.json`` (what the shim does), ``shim.json`` (the shim's pid and start time, so that a
restarted agent finds it and never mistakes a recycled pid for it), ``pid.json`` (the
container's process) and, once it ended, ``exit.json``. The agent waits for the shim through
a pidfd, so an attempt it adopted after its own restart is waited for like one it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conveyor.cluster.process import ProcessRecord, process_start_time

SHIM = Path(__file__).with_name("shim.py")


@dataclass(frozen=True)
class Exit:
    """How an attempt ended."""

    exit_code: int
    signal: int | None
    oom_killed: bool
    started_at: float
    finished_at: float

    @property
    def reason(self) -> str:
        if self.oom_killed:
            return "OOMKilled"
        return "Completed" if self.exit_code == 0 else "Error"


class ContainerAttempt:
    """One attempt's shim and the container process it keeps, started here or found again after
    the agent's restart."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir
        self.shim: ProcessRecord | None = None
        self._popen: subprocess.Popen[bytes] | None = None
        self.started_at: float | None = None

    @property
    def attempt(self) -> int:
        return int(self.dir.name)

    @classmethod
    def find(cls, run_dir: Path) -> ContainerAttempt | None:
        """The attempt recorded in ``run_dir`` (alive or ended), or ``None`` if it never started."""
        try:
            data = json.loads((run_dir / "shim.json").read_text())
        except FileNotFoundError:
            return None
        run = cls(run_dir)
        run.shim = ProcessRecord("shim", data["pid"], data["start_time"])
        run.started_at = data.get("started_at")
        return run

    async def start(self, spec: dict[str, Any], python: str = sys.executable) -> None:
        """Start the shim with ``spec`` and return once the container's process exists."""
        self.dir.mkdir(parents=True, exist_ok=True)
        spec = spec | {
            "pid_file": str(self.dir / "pid.json"),
            "exit_file": str(self.dir / "exit.json"),
        }
        (self.dir / "spec.json").write_text(json.dumps(spec))
        with (self.dir / "shim.log").open("ab") as log:
            self._popen = subprocess.Popen(
                [python, "-S", "-I", str(SHIM), str(self.dir / "spec.json")],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        pid = self._popen.pid
        start_time = process_start_time(pid) or 0
        self.started_at = time.time()
        self.shim = ProcessRecord("shim", pid, start_time)
        tmp = self.dir / "shim.json.tmp"
        tmp.write_text(
            json.dumps({"pid": pid, "start_time": start_time, "started_at": self.started_at})
        )
        tmp.replace(self.dir / "shim.json")
        # The shim writes pid.json right after its fork; it takes milliseconds.
        deadline = time.monotonic() + 30
        while not (self.dir / "pid.json").exists() and self.alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    def alive(self) -> bool:
        """True while the shim runs (it ends right after the container's process)."""
        if self._popen is not None:
            return self._popen.poll() is None
        return self.shim is not None and self.shim.alive()

    def pid(self) -> int | None:
        """The container's process, while it runs."""
        if not self.alive():
            return None
        try:
            return int(json.loads((self.dir / "pid.json").read_text())["pid"])
        except (FileNotFoundError, ValueError, KeyError):
            return None

    async def wait(self) -> Exit:
        """Wait until the attempt has ended and say how."""
        if self.shim is not None and self.alive():
            loop = asyncio.get_running_loop()
            try:
                fd = os.pidfd_open(self.shim.pid)
            except ProcessLookupError:
                fd = None
            if fd is not None:
                done: asyncio.Future[None] = loop.create_future()

                def wake() -> None:
                    if not done.done():
                        done.set_result(None)

                loop.add_reader(fd, wake)
                try:
                    if self.alive():
                        await done
                finally:
                    loop.remove_reader(fd)
                    os.close(fd)
        if self._popen is not None:
            await asyncio.to_thread(self._popen.wait)
        return self.exit()

    def exit(self) -> Exit:
        """The recorded end (an unrecorded one, a shim killed with its process, reads as SIGKILL)."""
        try:
            data = json.loads((self.dir / "exit.json").read_text())
        except (FileNotFoundError, ValueError):
            now = time.time()
            return Exit(137, signal.SIGKILL, False, self.started_at or now, now)
        return Exit(
            data["exit_code"],
            data.get("signal"),
            data["oom_killed"],
            data["started_at"],
            data["finished_at"],
        )

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the container's process (as a runtime signals a container's PID 1)."""
        pid = self.pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def kill_group(self) -> None:
        """SIGKILL the container's process group (the cgroup catches what left the group)."""
        pid = self.pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
