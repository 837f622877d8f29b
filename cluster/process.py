"""One child process of the cluster: started with its log file, stopped with SIGTERM then SIGKILL.

A process may be stopped by another Python process than the one that started it
(``conveyor cluster down`` after ``conveyor cluster up`` returned), so it is known by its pid
together with its start time: a recycled pid is never mistaken for it.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


def process_start_time(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot, or ``None`` if it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # a zombie has ended; only its exit status is left
        return None
    return int(fields[19])


def group_members(pgid: int) -> list[int]:
    """Processes (zombies excluded) in the process group ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file (empty when it does not exist)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 256 * lines))
            data = f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


PROXY_VARIABLES = (
    "http_proxy",
    "https_proxy",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "all_proxy",
    "ALL_PROXY",
    "KUBECONFIG",
)
"""Left out of the components' environment: what they reach is on this machine, and each is
told its own kubeconfig."""


def component_env() -> dict[str, str]:
    """The environment of the cluster's components: this one without ``PROXY_VARIABLES``, with
    ``/usr/sbin`` and ``/sbin`` on ``PATH`` (``ip``, ``nft``)."""
    env = {k: v for k, v in os.environ.items() if k not in PROXY_VARIABLES}
    path = env.get("PATH", "/usr/bin:/bin")
    for d in ("/usr/sbin", "/sbin"):
        if d not in path.split(":"):
            path = f"{path}:{d}"
    env["PATH"] = path
    return env


@dataclass(frozen=True)
class ProcessRecord:
    """What is written down about a running process so that any later process can stop it."""

    name: str
    pid: int
    start_time: int

    def alive(self) -> bool:
        """True while this very process (not a later one with its pid) runs."""
        return process_start_time(self.pid) == self.start_time


class ManagedProcess:
    """A component of the cluster: its command line, its log file, its life."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        *,
        env: dict[str, str] | None = None,
        cgroup_procs: tuple[Path, ...] = (),
    ) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.env = env
        self.cgroup_procs = cgroup_procs
        self._popen: subprocess.Popen[bytes] | None = None
        self.record: ProcessRecord | None = None

    @classmethod
    def adopt(cls, record: ProcessRecord, log_path: Path) -> ManagedProcess:
        """A handle on a process started by another Python process (for ``stop``)."""
        proc = cls(record.name, [], log_path)
        proc.record = record
        return proc

    def start(self) -> ProcessRecord:
        """Start the process in its own session (so that its whole group can be signalled)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = self.argv
        if self.cgroup_procs:
            # Join the cgroups before exec, so that nothing the process starts escapes them.
            joins = " ".join(f"echo $$ > {shlex.quote(str(p))};" for p in self.cgroup_procs)
            argv = ["/bin/sh", "-c", f'{joins} exec "$@"', self.name, *argv]
        with self.log_path.open("ab") as log:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
            log.write(f"==== {stamp} starting {self.name}: {shlex.join(self.argv)}\n".encode())
            log.flush()
            self._popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        start_time = process_start_time(self._popen.pid)
        if start_time is None:
            self._popen.wait()
            raise RuntimeError(
                f"{self.name} exited at once (code {self._popen.returncode}); "
                f"log {self.log_path}:\n{tail(self.log_path)}"
            )
        self.record = ProcessRecord(self.name, self._popen.pid, start_time)
        return self.record

    def alive(self) -> bool:
        """True while the process runs."""
        if self._popen is not None:
            return self._popen.poll() is None
        return self.record is not None and self.record.alive()

    def command_line(self) -> list[str]:
        """The running process's command line, as the kernel has it (for one adopted by pid)."""
        if self.record is None or not self.alive():
            raise RuntimeError(f"{self.name} does not run: its command line is unknown")
        raw = Path(f"/proc/{self.record.pid}/cmdline").read_bytes()
        argv = [part.decode() for part in raw.split(b"\0") if part]
        if not argv:
            raise RuntimeError(f"{self.name} (pid {self.record.pid}) shows no command line")
        return argv

    def exit_code(self) -> int | None:
        """The exit status of a process this object started, once it has ended."""
        return None if self._popen is None else self._popen.poll()

    def stop(self, grace_s: float) -> None:
        """SIGTERM to the process group, SIGKILL after ``grace_s``; returns once it is gone."""
        if self.record is None or not self.alive():
            self._reap()
            return
        pgid = self.record.pid
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while (self.alive() or group_members(pgid)) and time.monotonic() < deadline:
            self._reap(0.05)
        self.kill()

    def kill(self) -> None:
        """SIGKILL to the process group at once (what a crash looks like); returns once it is gone."""
        if self.record is None:
            return
        pgid = self.record.pid
        if self.alive() or group_members(pgid):
            self._signal(signal.SIGKILL)
            deadline = time.monotonic() + 10
            while (self.alive() or group_members(pgid)) and time.monotonic() < deadline:
                self._reap(0.05)
        self._reap()
        if self.alive() or group_members(pgid):
            raise RuntimeError(f"{self.name} (process group {pgid}) survived SIGKILL")

    def _signal(self, sig: signal.Signals) -> None:
        assert self.record is not None
        # The process leads its own session and group (start_new_session), so the group id is
        # its pid; children that left the group are found through the cluster's cgroup.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.record.pid, sig)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.record.pid, sig)

    def _reap(self, timeout_s: float = 1.0) -> None:
        """Collect the exit status of our own child (waiting at most ``timeout_s``)."""
        if self._popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(timeout=timeout_s)
        else:
            time.sleep(timeout_s if self.alive() else 0)

    def tail(self, lines: int = 40) -> str:
        """The end of this process's log."""
        return tail(self.log_path, lines)
