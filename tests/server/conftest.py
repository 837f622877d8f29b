"""Real ``conveyor serve`` processes on loopback ports, on the built-in model."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from conveyor.bench.procs import ChildProcess, conveyor_serve

# Small and fast: a 4k-token KV cache, short steps on two CPU cores.
BASE_ARGS = [
    "--model",
    "conveyor-tiny",
    "--max-total-tokens",
    "4096",
    "--max-running-requests",
    "32",
    "--chunked-prefill-size",
    "512",
]


@pytest.fixture(scope="session")
def server() -> Iterator[ChildProcess]:
    """One server for every test that only needs the defaults."""
    with conveyor_serve(BASE_ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def start_server() -> Iterator[Callable[..., ChildProcess]]:
    """``start_server(*extra_flags)``: a ready server with the base flags plus these; each
    one is stopped when the module's tests are done."""
    started: list[ChildProcess] = []

    def start(*extra: str) -> ChildProcess:
        s = conveyor_serve([*BASE_ARGS, *extra])
        started.append(s)
        return s.start()

    yield start
    for s in started:
        s.stop()
