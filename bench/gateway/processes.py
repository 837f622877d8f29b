"""The processes of ``conveyor bench gateway``: runtime replicas, the stub, the gateway."""

from __future__ import annotations

import httpx

from conveyor.bench.gateway.settings import MODEL
from conveyor.bench.procs import ChildProcess, conveyor_serve, python_module
from conveyor.bench.wait import wait_until


def replica(num_threads: int, max_total_tokens: int) -> ChildProcess:
    """``conveyor serve`` on the built-in model with a small KV cache."""
    args = ["--model", MODEL, "--num-threads", str(num_threads),
            "--max-total-tokens", str(max_total_tokens)]  # fmt: skip
    return conveyor_serve(args, name="runtime", ready_timeout=300)


def stub(*args: str) -> ChildProcess:
    """The minimal streaming server (``conveyor.bench.gateway.stub``), on the port it reports."""
    return ChildProcess(
        "stub",
        lambda port: python_module("conveyor.bench.gateway.stub", "--port", str(port), *args),
        ready_path="/load",
        reports_port=True,
    )


def gateway(backends: list[str], *extra: str) -> ChildProcess:
    """``conveyor gateway`` in front of ``backends``."""
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
    )


def wait_admitted(gateway: ChildProcess, count: int, timeout: float = 60) -> None:
    """Until the gateway has admitted ``count`` replicas (their first /load answered)."""

    def admitted() -> bool:
        pools = httpx.get(gateway.url + "/debug/pools", timeout=5).json()
        return sum(r["admitted"] for pool in pools.values() for r in pool["replicas"]) >= count

    wait_until(admitted, timeout, f"the gateway to admit {count} replicas")
