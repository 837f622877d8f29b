"""What the request handlers share: built once in the app's lifespan and passed in."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from conveyor.runtime.server.engine_client import EngineClient
from conveyor.runtime.server.metrics import ServerMetrics
from conveyor.runtime.server.response_store import ResponseStore
from conveyor.runtime.server.settings import ServerSettings

logger = logging.getLogger("conveyor.runtime.server")


class Drain:
    """In-flight API requests, and whether the server is draining (SIGTERM).

    Owned by whoever runs the server (``cli.serve``), which starts the drain; the app's
    admission middleware counts requests and refuses new ones while draining.
    """

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle: asyncio.Event | None = None

    def enter(self) -> None:
        self.in_flight += 1

    def exit(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    async def drain(self, timeout: float) -> bool:
        """Refuse new requests, wait for in-flight ones; True if all finished within ``timeout``."""
        self.draining = True
        if self.in_flight == 0:
            return True
        self._idle = asyncio.Event()
        logger.info(
            "draining: waiting up to %.0fs for %d in-flight request(s)", timeout, self.in_flight
        )
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            logger.warning("drain timeout: %d request(s) still in flight", self.in_flight)
            return False
        return True


@dataclass
class ServerContext:
    """One replica's server: its settings, engine client, metrics and helpers."""

    settings: ServerSettings
    client: EngineClient
    metrics: ServerMetrics
    drain: Drain
    tokenize_pool: ThreadPoolExecutor
    """Prompts are tokenised here, off the event loop (a long prompt takes milliseconds)."""
    grammar_pool: ThreadPoolExecutor
    """Grammars of structured outputs are compiled here, off the event loop and the engine
    thread (a large JSON schema takes tens of milliseconds the first time)."""
    responses: ResponseStore
    """Stored responses of ``POST /v1/responses`` (``--responses-store-mb``)."""
    loras: dict[str, str] = field(default_factory=dict)
    """The LoRA adapters served (name -> folder): ``--lora-modules`` and those loaded since."""
    token_text: dict[int, str] = field(default_factory=dict)
    """Text of single token ids for logprobs, filled on first use (bounded by the vocabulary)."""

    @property
    def model_name(self) -> str:
        return self.settings.model_name

    @property
    def ready(self) -> bool:
        return self.client.loaded and self.client.alive and not self.drain.draining
