"""The Rust routers the gateway is measured against, each in its own cached virtual environment.

``vllm-router`` and ``sglang-router`` are the load balancers users put in front of vLLM or
SGLang instead of a gateway like Conveyor's: Rust binaries shipped as PyPI wheels (a Python
launcher around a compiled extension). Both front any OpenAI-compatible worker that answers
``/health``, so they stand in front of the same stub and runtime replicas as the gateway.

Each router is installed, pinned, into ``$CONVEYOR_CACHE/peers/<name>-<version>``
(``~/.cache/conveyor`` by default), wheels only (no Rust toolchain is needed or used), by
``bench/pinned_env.py``: complete only once a stamp file is written, so an interrupted install
is redone rather than half used. Installing is a benchmark step (``conveyor bench gateway
--peers ...``), never a test step.

    python -m conveyor.bench.gateway.routers install vllm-router sglang-router
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from conveyor.bench import pinned_env
from conveyor.bench.pinned_env import PinnedTool, ToolInstallError

RouterInstallError = ToolInstallError
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

    @property
    def tool(self) -> PinnedTool:
        """Its pinned environment (wheels only: no Rust toolchain is needed or used)."""
        return PinnedTool(self.name, self.version, command=self.name)


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


def env_dir(router: RustRouter, root: Path | None = None) -> Path:
    return pinned_env.env_dir(router.tool, root)


def executable(router: RustRouter, venv: Path) -> Path:
    return pinned_env.executable(router.tool, venv)


def is_installed(router: RustRouter, venv: Path) -> bool:
    return pinned_env.is_installed(router.tool, venv)


def ensure(
    router: RustRouter, progress: Callable[[str], None] = print, root: Path | None = None
) -> Path:
    """The router's virtual environment, installed first if it is not complete (idempotent)."""
    return pinned_env.ensure(router.tool, progress, root)


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
