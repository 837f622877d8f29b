"""The Rust routers the gateway is measured against, each in its own cached virtual environment.

``vllm-router`` and ``sglang-router`` are the load balancers users put in front of vLLM or
SGLang instead of a gateway like Conveyor's: Rust binaries shipped as PyPI wheels (a Python
launcher around a compiled extension). Both front any OpenAI-compatible worker that answers
``/health``, so they stand in front of the same stub and runtime replicas as the gateway.

Each router is installed, pinned, into ``$CONVEYOR_CACHE/peers/<name>-<version>``
(``~/.cache/conveyor`` by default), wheels only (no Rust toolchain is needed or used), and
is complete only once a stamp file is written, so an interrupted install is redone rather
than half used. Installing is a benchmark step (``conveyor bench gateway --peers ...``),
never a test step.

    python -m conveyor.bench.gateway.routers install vllm-router sglang-router
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

STAMP = ".conveyor-complete"


class RouterInstallError(RuntimeError):
    """A router could not be installed; the message says which step failed and why."""


@dataclass(frozen=True)
class RustRouter:
    """One router: its PyPI distribution, pinned, and how its command line is spelled."""

    name: str
    """How ``--peers`` names it; also its PyPI distribution and its command."""
    version: str
    """The pinned release."""
    subcommand: tuple[str, ...] = ()
    """Words after the command that start a router in front of existing workers."""
    policies: dict[str, str] = field(default_factory=dict)
    """The bench's policy label -> the router's ``--policy`` value."""
    log_level: str = "warning"
    """Its quietest useful ``--log-level`` (the two spell ``warn`` differently)."""
    add_worker_path: str = "/add_worker"
    """Where a worker is added at run time: ``POST PATH?url=URL`` (vllm-router answers once
    it is added), or with ``add_worker_in_body`` ``POST PATH {"url": URL}`` (sglang-router
    queues the job and answers 202)."""
    add_worker_in_body: bool = False

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


VLLM_ROUTER = RustRouter(
    "vllm-router",
    "0.1.17",
    policies={
        "cache_aware": "cache_aware",
        "consistent_hash": "consistent_hash",
        "round_robin": "round_robin",
    },
)
SGLANG_ROUTER = RustRouter(
    "sglang-router",
    "0.3.2",
    subcommand=("launch",),
    policies={"cache_aware": "cache_aware", "round_robin": "round_robin"},
    log_level="warn",
    add_worker_path="/workers",
    add_worker_in_body=True,
)
ROUTERS: dict[str, RustRouter] = {r.name: r for r in (VLLM_ROUTER, SGLANG_ROUTER)}


def parse_peers(spec: str) -> list[RustRouter]:
    """``--peers vllm-router,sglang-router`` -> the routers; ValueError naming the known ones."""
    names = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in ROUTERS]
    if unknown:
        raise ValueError(
            f"unknown peer {', '.join(map(repr, unknown))}; --peers takes a comma-separated "
            f"list of {', '.join(ROUTERS)}"
        )
    return [ROUTERS[name] for name in dict.fromkeys(names)]


def cache_root() -> Path:
    root = os.environ.get("CONVEYOR_CACHE") or os.path.join(Path.home(), ".cache", "conveyor")
    return Path(root) / "peers"


def env_dir(router: RustRouter, root: Path | None = None) -> Path:
    return (root or cache_root()) / f"{router.name}-{router.version}"


def executable(router: RustRouter, venv: Path) -> Path:
    return venv / "bin" / router.name


def is_installed(router: RustRouter, venv: Path) -> bool:
    stamp = venv / STAMP
    return (
        stamp.is_file()
        and stamp.read_text().strip() == router.requirement
        and executable(router, venv).is_file()
    )


def install_commands(
    router: RustRouter, venv: Path, python: str = sys.executable
) -> list[list[str]]:
    """The commands that build ``venv``: a fresh virtual environment, then the pinned wheel
    (wheels only: a missing wheel for this platform fails instead of compiling Rust)."""
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    return [
        [python, "-m", "venv", "--clear", str(venv)],
        [*pip, "install", "--only-binary", ":all:", "--progress-bar", "off", router.requirement],
    ]


def ensure(
    router: RustRouter, progress: Callable[[str], None] = print, root: Path | None = None
) -> Path:
    """The router's virtual environment, installed first if it is not complete (idempotent)."""
    venv = env_dir(router, root)
    if is_installed(router, venv):
        progress(f"{router.requirement} already installed: {venv}")
        return venv
    started = time.monotonic()
    venv.parent.mkdir(parents=True, exist_ok=True)
    (venv / STAMP).unlink(missing_ok=True)
    progress(f"installing {router.requirement} into {venv}")
    for cmd in install_commands(router, venv):
        _run(cmd, progress)
    if not executable(router, venv).is_file():
        raise RouterInstallError(
            f"{router.requirement} installed, but {executable(router, venv)} is missing; "
            "the wheel's entry points changed: update conveyor/bench/gateway/routers.py"
        )
    (venv / STAMP).write_text(router.requirement + "\n")
    progress(f"{router.requirement} ready in {time.monotonic() - started:.0f}s")
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
        raise RouterInstallError(
            f"`{' '.join(cmd)}` failed (exit {proc.returncode}); is PyPI reachable?\n{said}"
        )


def command(
    router: RustRouter,
    venv: Path,
    *,
    port: int,
    workers: Sequence[str],
    policy: str,
    metrics_port: int,
) -> list[str]:
    """The router's command line in front of ``workers`` on loopback ``port``.

    Its Prometheus listener (on 29000 by default in both, so two would collide) gets
    ``metrics_port``; workers are checked every second at start-up (30 s by default), so
    the benchmark does not wait half a minute for a router to notice a ready replica.
    """
    if policy not in router.policies:
        raise ValueError(
            f"{router.name} has no policy {policy!r} here; one of {', '.join(router.policies)}"
        )
    if not workers:
        raise ValueError(f"{router.name} needs at least one worker URL")
    return [
        str(executable(router, venv)),
        *router.subcommand,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--worker-urls", *workers,
        "--policy", router.policies[policy],
        "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(metrics_port),
        "--worker-startup-check-interval", "1",
        "--log-level", router.log_level,
    ]  # fmt: skip


def add_worker(router: RustRouter, base_url: str, worker: str) -> None:
    """Add ``worker`` to the router running at ``base_url`` through its HTTP API (both list
    theirs at ``GET /workers``: see ``has_healthy_worker``)."""
    import httpx

    url = base_url + router.add_worker_path
    if router.add_worker_in_body:
        response = httpx.post(url, json={"url": worker}, timeout=30)
    else:
        response = httpx.post(url, params={"url": worker}, timeout=30)
    if response.status_code not in (200, 201, 202):
        raise RuntimeError(
            f"{router.name} refused to add worker {worker}: POST {router.add_worker_path} "
            f"answered {response.status_code} {response.text[:200]}"
        )


def has_healthy_worker(base_url: str, worker: str) -> bool:
    """Whether the router at ``base_url`` lists ``worker`` as healthy (``GET /workers``)."""
    import httpx

    listed = httpx.get(base_url + "/workers", timeout=10).json().get("workers", [])
    return any(w.get("url") == worker and w.get("is_healthy") for w in listed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conveyor.bench.gateway.routers",
        description="The Rust routers the gateway is benchmarked against, each in its own "
        "cached virtual environment.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (
        ("install", "install each router if it is not complete; print its path"),
        ("path", "print each router's path; exit 1 if one is not installed"),
    ):
        p = sub.add_parser(name, help=help_)
        p.add_argument("routers", nargs="+", choices=list(ROUTERS), help="routers to act on")
    args = parser.parse_args(argv)
    routers = [ROUTERS[name] for name in args.routers]
    if args.command == "path":
        for router in routers:
            print(env_dir(router))
        return 0 if all(is_installed(r, env_dir(r)) for r in routers) else 1
    try:
        for router in routers:
            print(ensure(router, lambda m: print(f"[routers] {m}", file=sys.stderr, flush=True)))
    except RouterInstallError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
