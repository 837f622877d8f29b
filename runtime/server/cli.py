"""``conveyor serve``: one runtime replica (the process each GPU pod runs).

SIGTERM drains: ``/ready`` turns 503 at once, new requests get 503, in-flight ones run
to completion (up to ``--drain-timeout``), then the process exits 0. A second signal
exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from types import FrameType

import uvicorn

from conveyor.runtime.server.app import build_app
from conveyor.runtime.server.context import Drain
from conveyor.runtime.server.settings import ServerSettings

logger = logging.getLogger("conveyor.runtime.server")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="conveyor serve",
        description="Serve a model over an OpenAI-compatible HTTP API, with Prometheus metrics, "
        "/health, /ready and /load.",
    )
    ServerSettings.add_cli_args(parser)
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = ServerSettings.from_cli_args(args)
    except ValueError as exc:
        print(f"conveyor serve: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    return serve(settings)


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def serve(settings: ServerSettings) -> int:
    """Run the server until it is stopped; the process's exit code."""
    drain = Drain()
    app = build_app(settings, drain=drain)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,  # keep the logging configured above
        log_level=settings.log_level,
        access_log=settings.access_log,
        timeout_graceful_shutdown=5,
        lifespan="on",
        ws="none",  # no WebSocket routes: skips importing the websockets package at start
    )
    server = DrainingServer(config, drain, settings.drain_timeout)
    server.run()
    if server.failed:
        return 1
    return 0


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM/SIGINT drains before stopping."""

    def __init__(self, config: uvicorn.Config, drain: Drain, drain_timeout: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.drain_timeout = drain_timeout
        self.failed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.should_exit:
            self._watch = asyncio.create_task(self._exit_if_engine_dies())
            host, port = self.config.host, self.config.port
            for server in getattr(self, "servers", []):
                for sock in server.sockets:
                    host, port = sock.getsockname()[:2]
            logger.info("listening on http://%s:%d", host, port)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain.draining or self._loop is None:
            super().handle_exit(sig, frame)  # a second signal: stop now
            return
        logger.info("received %s: draining", signal.Signals(sig).name)
        self.drain.draining = True  # /ready is 503 from this instant
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        await self.drain.drain(self.drain_timeout)
        self.should_exit = True

    async def _exit_if_engine_dies(self) -> None:
        """A replica whose engine failed (to load, or mid-run) exits non-zero to be restarted."""
        ctx = self.lifespan.state.get("ctx")
        if ctx is None:
            return
        error = await ctx.client.wait_dead()
        logger.error("engine stopped (%s); exiting", error)
        self.failed = True
        self.should_exit = True
