"""The processes of ``conveyor bench gateway``: runtime replicas, the stub, the gateway."""

from __future__ import annotations

from pathlib import Path

import httpx

from conveyor.bench.gateway import routers
from conveyor.bench.gateway.settings import MODEL, BenchSettings, replica_cpu_limit
from conveyor.bench.procs import ChildProcess, conveyor_serve, free_port, python_module
from conveyor.bench.wait import wait_until


def replica(s: BenchSettings) -> ChildProcess:
    """``conveyor serve`` on the built-in model with a small KV cache, limited to its share
    of the CPUs (``--replica-cpus``)."""
    args = ["--model", MODEL, "--num-threads", str(s.num_threads),
            "--max-total-tokens", str(s.max_total_tokens)]  # fmt: skip
    return conveyor_serve(args, name="runtime", ready_timeout=300, cpu_limit=replica_cpu_limit(s))


def stub(*args: str) -> ChildProcess:
    """The minimal streaming server (``conveyor.bench.gateway.stub``), on the port it reports."""
    return ChildProcess(
        "stub",
        lambda port: python_module("conveyor.bench.gateway.stub", "--port", str(port), *args),
        ready_path="/load",
        reports_port=True,
    )


def gateway(
    backends: list[str], *extra: str, env: dict[str, str | None] | None = None
) -> ChildProcess:
    """``conveyor gateway`` in front of ``backends`` (``env``: added to its environment)."""
    return ChildProcess(
        "gateway",
        lambda port: python_module(
            "conveyor.cli",
            "gateway",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
            *[a for b in backends for a in ("--backend", b)],
            *extra,
        ),
        ready_path="/health",
        env=env,
    )


def rust_router(
    router: routers.RustRouter, venv: Path, workers: list[str], policy: str
) -> ChildProcess:
    """A Rust router (``routers.py``) in front of ``workers``; ready once its /health answers,
    which both give only after their workers answered theirs."""
    metrics_port = free_port()
    return ChildProcess(
        router.name,
        lambda port: routers.command(
            router, venv, port=port, workers=workers, policy=policy, metrics_port=metrics_port
        ),
        ready_path="/health",
        ready_timeout=120,
    )


def wait_admitted(gateway: ChildProcess, count: int, timeout: float = 60) -> None:
    """Until the gateway has admitted ``count`` replicas (their first /load answered)."""

    def admitted() -> bool:
        pools = httpx.get(gateway.url + "/debug/pools", timeout=5).json()
        return sum(r["admitted"] for pool in pools.values() for r in pool["replicas"]) >= count

    wait_until(admitted, timeout, f"the gateway to admit {count} replicas")
