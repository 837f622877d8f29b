"""Tools the benchmarks measure against or drive, each pinned in its own cached virtual environment.

The Rust routers in front of the gateway's replicas (``gateway/routers.py``) and the benchmark
clients of the peer bench (``peers/clients.py``) are PyPI distributions with a command. Each
is installed, pinned, into ``$CONVEYOR_CACHE/peers/<name>-<version>`` (``~/.cache/conveyor``
by default), from wheels only where asked (a missing wheel fails instead of compiling), with
the lowest Python the tool supports found on this machine, and is complete only once a stamp
file naming the pin is written, so an interrupted install is redone rather than half used.
Installing is a benchmark step, never a test step.
"""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

STAMP = ".conveyor-complete"


class ToolInstallError(RuntimeError):
    """A tool could not be installed; the message says which step failed and why."""


@dataclass(frozen=True)
class PinnedTool:
    """A PyPI distribution, pinned, and the command it installs."""

    name: str
    """Its PyPI distribution, and how the benchmarks name it."""
    version: str
    """The pinned release."""
    command: str
    """The executable it puts in the environment's ``bin``."""
    min_python: tuple[int, int] = (3, 11)
    """The oldest Python its wheels support."""
    wheels_only: bool = True
    """Refuse source distributions (no compiler is run for a benchmark tool)."""

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


def cache_root() -> Path:
    root = os.environ.get("CONVEYOR_CACHE") or os.path.join(Path.home(), ".cache", "conveyor")
    return Path(root) / "peers"


def env_dir(tool: PinnedTool, root: Path | None = None) -> Path:
    return (root or cache_root()) / f"{tool.name}-{tool.version}"


def executable(tool: PinnedTool, venv: Path) -> Path:
    return venv / "bin" / tool.command


def is_installed(tool: PinnedTool, venv: Path) -> bool:
    stamp = venv / STAMP
    return (
        stamp.is_file()
        and stamp.read_text().strip() == tool.requirement
        and executable(tool, venv).is_file()
    )


def find_python(tool: PinnedTool) -> str:
    """An interpreter new enough for ``tool``: this one, else ``python3.X`` on PATH, else
    pyenv's; ToolInstallError saying what to install when there is none."""
    if sys.version_info[:2] >= tool.min_python:
        return sys.executable
    candidates = [f"python{tool.min_python[0]}.{minor}" for minor in range(tool.min_python[1], 20)]
    for name in candidates:
        if (found := shutil.which(name)) and _runs(found, tool.min_python):
            return found  # (pyenv's shims are on PATH for every version, but run only some)
    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    for version in sorted(pyenv.glob("3.*"), key=_version_key):
        if _version_key(version)[:2] >= tool.min_python and (version / "bin/python").is_file():
            return str(version / "bin/python")
    wanted = ".".join(map(str, tool.min_python))
    raise ToolInstallError(
        f"{tool.requirement} needs Python >= {wanted}, and this machine has none on PATH "
        f"(looked for {', '.join(candidates[:3])}, ...) or under {pyenv}: install one "
        f"(e.g. apt install python{wanted}) and run again"
    )


def _runs(python: str, at_least: tuple[int, int]) -> bool:
    """Whether ``python`` starts and is at least that version."""
    check = f"import sys; sys.exit(sys.version_info[:2] < {at_least!r})"
    try:
        return (
            subprocess.run([python, "-c", check], capture_output=True, timeout=30).returncode == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


def _version_key(path: Path) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in path.name.split("."))
    except ValueError:
        return (0,)


def install_commands(tool: PinnedTool, venv: Path, python: str | None = None) -> list[list[str]]:
    """The commands that build ``venv``: a fresh virtual environment, then the pinned tool."""
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    binary = ["--only-binary", ":all:"] if tool.wheels_only else []
    return [
        [python or find_python(tool), "-m", "venv", "--clear", str(venv)],
        [*pip, "install", *binary, "--progress-bar", "off", tool.requirement],
    ]


def ensure(
    tool: PinnedTool, progress: Callable[[str], None] = print, root: Path | None = None
) -> Path:
    """The tool's virtual environment, installed first if it is not complete (idempotent)."""
    venv = env_dir(tool, root)
    if is_installed(tool, venv):
        progress(f"{tool.requirement} already installed: {venv}")
        return venv
    started = time.monotonic()
    venv.parent.mkdir(parents=True, exist_ok=True)
    (venv / STAMP).unlink(missing_ok=True)
    progress(f"installing {tool.requirement} into {venv}")
    for cmd in install_commands(tool, venv):
        _run(cmd, progress)
    if not executable(tool, venv).is_file():
        raise ToolInstallError(
            f"{tool.requirement} installed, but {executable(tool, venv)} is missing; "
            "the wheel's entry points changed: update its pin in conveyor/bench"
        )
    (venv / STAMP).write_text(tool.requirement + "\n")
    progress(f"{tool.requirement} ready in {time.monotonic() - started:.0f}s")
    return venv


def _run(cmd: list[str], progress: Callable[[str], None]) -> None:
    """Run ``cmd``, passing pip's step lines on as progress; its last lines on failure."""
    tail: collections.deque[str] = collections.deque(maxlen=8)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            tail.append(line)
            if line.startswith(("Collecting", "Downloading", "Installing", "Successfully")):
                progress("  " + line.strip())
    if proc.returncode != 0:
        said = "\n".join(tail)
        raise ToolInstallError(
            f"`{' '.join(cmd)}` failed (exit {proc.returncode}); is PyPI reachable?\n{said}"
        )
