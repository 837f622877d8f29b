"""``EngineClient.call``: a function run on the engine thread between two steps (a LoRA load
or unload) always answers its caller: with its result, its refusal, or the error that
stopped the engine; it never leaves the caller waiting."""

from __future__ import annotations

import asyncio

import pytest

from conveyor.runtime.engine.outputs import EngineStats
from conveyor.runtime.server.engine_client import EngineClient, EngineDeadError


class IdleEngine:
    """Just what the engine thread's loop asks of an engine that has no requests."""

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0.0, 1, 1, 0, 0, 0, 0, 0, 0)

    def on_rank_failure(self, callback: object) -> None:
        pass

    def has_unfinished_requests(self) -> bool:
        return False

    def close(self) -> None:
        pass


def fail(exc: BaseException):
    def raise_it(engine: object) -> None:
        raise exc

    return raise_it


async def test_a_call_answers_with_its_result_its_refusal_or_the_error_that_stopped_the_engine() -> (
    None
):
    client = EngineClient(IdleEngine)  # type: ignore[arg-type, return-value]
    client.start()
    await client.wait_loaded()
    assert await client.call(lambda engine: 42) == 42
    with pytest.raises(ValueError, match="refused"):
        await client.call(fail(ValueError("refused")))
    assert client.alive  # a refusal leaves the engine as it was
    with pytest.raises(MemoryError):
        await asyncio.wait_for(client.call(fail(MemoryError("no room"))), 30)
    await asyncio.wait_for(client.wait_dead(), 30)
    with pytest.raises(EngineDeadError):
        await client.call(lambda engine: 1)
    await client.shutdown()
