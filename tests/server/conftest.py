"""Real ``conveyor serve`` processes on loopback ports, on the built-in model."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from conveyor.runtime.server.process import ServerProcess

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
def server() -> Iterator[ServerProcess]:
    """One server for every test that only needs the defaults."""
    with ServerProcess(BASE_ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def start_server() -> Iterator[Callable[..., ServerProcess]]:
    """``start_server(*extra_flags)``: a ready server with the base flags plus these; each
    one is stopped when the module's tests are done."""
    started: list[ServerProcess] = []

    def start(*extra: str) -> ServerProcess:
        s = ServerProcess([*BASE_ARGS, *extra])
        started.append(s)
        return s.start()

    yield start
    for s in started:
        s.stop()
