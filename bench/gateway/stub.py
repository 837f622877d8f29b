"""A minimal OpenAI-style streaming server that exists only for benchmarks and tests.

It answers like a runtime replica (``/v1/completions``, ``/v1/chat/completions`` streamed
or not, ``/v1/models``, ``/load``, ``/health``, ``/ready``) without a model, so a
measurement through the gateway measures the gateway. Each completion's text names the
stub (``--name``), so a test can tell which replica answered.

``python -m conveyor.bench.gateway.stub --port P [--tokens N --token-interval-ms MS]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

from conveyor.contracts.load import LOAD_HEADER, ReplicaLoad


@dataclass(frozen=True)
class StubSettings:
    host: str = "127.0.0.1"
    """Loopback: a stub is never meant to be reachable from elsewhere."""
    port: int = 8000
    """Port to listen on (the runtime's port by default; 0: any free port, printed)."""
    model: str = "stub"
    """Model name served."""
    name: str = ""
    """Name put in every completion's text; defaults to host:port."""
    tokens: int = 16
    """Chunks per streamed completion (and words in a non-streamed one)."""
    token_interval_ms: float = 0.0
    """Pause between chunks in milliseconds, to hold streams open for concurrency tests. A
    request whose prompt is ``pace MS`` is paced by MS instead, so one stub serves both held
    streams and fast probes, through routers that forward only the standard fields."""
    max_running_requests: int = 256
    """Reported in /load; the stub itself never queues."""
    max_queued_requests: int = -1
    """Reported in /load (negative: null, no bound)."""
    report_waiting: int = 0
    """Queue depth reported in /load, to make the gateway see a full replica."""
    replica_like: bool = False
    """Answer as a Conveyor replica does, for measuring the gateway's CPU on what it really
    proxies: each completion says the load in ``x-conveyor-load``, a chat stream opens with
    a role-only chunk, and a stream asked for usage (``stream_options``) ends with a usage
    chunk. Off by default: tests see the plain answers."""


class StubApp:
    def __init__(self, settings: StubSettings) -> None:
        self.s = settings
        self.name = settings.name or f"{settings.host}:{settings.port}"
        self.running = 0
        self.served = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        path = scope["path"]
        if path == "/load":
            # ``served`` is the stub's own: how many completions it answered, for the tests.
            await _json(send, {**self._load().to_json(), "served": self.served})
        elif path in ("/health", "/ready"):
            await _json(send, {"status": "ok"})
        elif path == "/v1/models":
            await _json(send, {"object": "list", "data": [{"id": self.s.model, "object": "model"}]})
        elif path in ("/v1/completions", "/v1/chat/completions") and scope["method"] == "POST":
            body = b""
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
            request = json.loads(body)
            self.running += 1
            self.served += 1
            # uvicorn drops sends after a disconnect silently: watch for it, as the runtime does
            complete = asyncio.ensure_future(
                self._complete(request, path.endswith("chat/completions"), send)
            )
            disconnect = asyncio.ensure_future(_wait_disconnect(receive))
            try:
                await asyncio.wait((complete, disconnect), return_when=asyncio.FIRST_COMPLETED)
            finally:
                complete.cancel()
                disconnect.cancel()
                self.running -= 1
        else:
            await _json(send, {"error": {"message": "not found"}}, 404)

    def _load(self) -> ReplicaLoad:
        return ReplicaLoad(
            running=self.running,
            waiting=self.s.report_waiting,
            kv_cache_usage=0.0,
            max_running_requests=self.s.max_running_requests,
            max_queued_requests=(
                None if self.s.max_queued_requests < 0 else self.s.max_queued_requests
            ),
            ready=True,
        )

    def _load_header(self) -> list[tuple[bytes, bytes]]:
        if not self.s.replica_like:
            return []
        return [(LOAD_HEADER.encode(), self._load().to_header())]

    async def _complete(self, request: dict[str, Any], chat: bool, send: Any) -> None:
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        base = {"id": "cmpl-stub", "created": created, "model": self.s.model}
        # sglang-router forwards a chat's max_tokens as max_completion_tokens
        n = int(request.get("max_tokens") or request.get("max_completion_tokens") or self.s.tokens)
        if not request.get("stream"):
            # A whole answer comes once generated: a ``pace MS`` prompt takes that long per token.
            generating = (n - 1) * _pace(request.get("prompt"), 0.0) / 1000
            if generating > 0:
                await asyncio.sleep(generating)  # the simulated generation, not synchronisation
            text = " ".join([self.name] * n)
            choice = (
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "length",
                }
                if chat
                else {"index": 0, "text": text, "finish_reason": "length"}
            )
            usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
            doc = {**base, "object": kind, "choices": [choice], "usage": usage}
            await _json(send, doc, extra_headers=self._load_header())
            return
        await send({
            "type": "http.response.start", "status": 200,
            "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                        *self._load_header()],
        })  # fmt: skip
        interval = _pace(request.get("prompt"), self.s.token_interval_ms) / 1000
        chunk_kind = f"{kind}.chunk" if chat else kind
        if chat and self.s.replica_like:  # the role-only opening chunk, sent before prefill
            role = {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "finish_reason": None,
            }
            await _event(send, {**base, "object": chunk_kind, "choices": [role]})
        usage_asked = self.s.replica_like and (request.get("stream_options") or {}).get(
            "include_usage"
        )
        for i in range(n):
            if i and interval:
                await asyncio.sleep(interval)
            last = i == n - 1
            delta = {"content": f"{self.name} "} if chat else None
            choice = (
                {"index": 0, "delta": delta, "finish_reason": "length" if last else None}
                if chat
                else {
                    "index": 0,
                    "text": f"{self.name} ",
                    "finish_reason": "length" if last else None,
                }
            )
            chunk = {**base, "object": chunk_kind, "choices": [choice]}
            payload = b"data: " + json.dumps(chunk).encode() + b"\n\n"
            if last and usage_asked:
                final_usage: dict[str, Any] = {
                    "prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1,
                    "prompt_tokens_details": {"cached_tokens": 0},
                }  # fmt: skip
                await send({"type": "http.response.body", "body": payload, "more_body": True})
                payload = _event_bytes(
                    {**base, "object": chunk_kind, "choices": [], "usage": final_usage}
                )
            if last:
                payload += b"data: [DONE]\n\n"
            await send({"type": "http.response.body", "body": payload, "more_body": not last})


def _pace(prompt: Any, default_ms: float) -> float:
    """Milliseconds between chunks: ``MS`` for the prompt ``pace MS``, else ``default_ms``."""
    if isinstance(prompt, str) and prompt.startswith("pace "):
        try:
            return float(prompt.removeprefix("pace "))
        except ValueError:
            pass
    return default_ms


async def _wait_disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _event_bytes(doc: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


async def _event(send: Any, doc: dict[str, Any]) -> None:
    await send({"type": "http.response.body", "body": _event_bytes(doc), "more_body": True})


async def _json(
    send: Any,
    doc: dict[str, Any],
    status: int = 200,
    extra_headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    body = json.dumps(doc).encode()
    await send({
        "type": "http.response.start", "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    *(extra_headers or [])],
    })  # fmt: skip
    await send({"type": "http.response.body", "body": body})


def _flag(value: str) -> bool:
    if value.lower() not in ("true", "false", "1", "0"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")
    return value.lower() in ("true", "1")


def main(argv: list[str] | None = None) -> int:
    defaults = StubSettings()
    parser = argparse.ArgumentParser(prog="python -m conveyor.bench.gateway.stub")
    for field, default in vars(defaults).items():
        kind = _flag if isinstance(default, bool) else type(default)
        parser.add_argument("--" + field.replace("_", "-"), type=kind, default=default)
    settings = StubSettings(**vars(parser.parse_args(sys.argv[1:] if argv is None else argv)))
    import uvicorn

    # Bound here, so that port 0 works: the port it got is printed for whoever started it.
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((settings.host, settings.port))
    settings = replace(settings, port=sock.getsockname()[1])
    print(f"listening on http://{settings.host}:{settings.port}", flush=True)
    config = uvicorn.Config(StubApp(settings), log_level="warning", access_log=False, backlog=4096)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
