"""Proxying ``POST /v1/completions``, ``/v1/chat/completions``, ``/v1/responses``, ``/tokenize``
and ``/detokenize`` to one replica of the model's pool: the ASGI handler and its retries.

A raw ASGI handler: the body is read once (bounded), the model picks the pool; while the
model has no ready replica the request is held (``holding.py``); then the pool offers a
replica (``Pool.choose``) and one attempt is made on it (``upstream_attempt.py``). Until the
first byte goes to the client every failure is retried on another replica, up to
``--max-attempts``. A client that goes away cancels the upstream request, so the replica
aborts it and frees its KV blocks. Bodies and Authorization headers are never logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
from starlette.types import Receive, Scope, Send

from conveyor.gateway.auth import ApiKeyAuth, backend_headers
from conveyor.gateway.errors import ClientError, Failure, error_json
from conveyor.gateway.holding import Holding
from conveyor.gateway.metrics import GatewayMetrics
from conveyor.gateway.pool import NoCandidate, Pool, Registry
from conveyor.gateway.prefix_key import RouteRequest
from conveyor.gateway.settings import GatewaySettings
from conveyor.gateway.upstream_attempt import LoadHeard, SilenceWatch, Upstream, UpstreamRequest

log = logging.getLogger("conveyor.gateway")

CLIENT_CLOSED = "499"
"""nginx's code for a client that went away first."""


class Proxy:
    def __init__(
        self,
        *,
        registry: Registry,
        session: aiohttp.ClientSession,
        metrics: GatewayMetrics,
        auth: ApiKeyAuth,
        settings: GatewaySettings,
    ) -> None:
        self._registry = registry
        self._metrics = metrics
        self._auth = auth
        self._s = settings
        self._holding = Holding(registry=registry, metrics=metrics, settings=settings)
        self._upstream = Upstream(session=session, metrics=metrics, settings=settings)
        self._upstream_headers = {
            "content-type": "application/json",
            **backend_headers(settings.backend_api_key),
        }

    def hear_load_with(self, heard: LoadHeard) -> None:
        """Hand the load report in each response's head to ``heard`` (the load poller's)."""
        self._upstream.load_heard = heard

    def silence_watch(self) -> SilenceWatch:
        """What fails streams whose replica went silent; the gateway runs it."""
        return self._upstream.watch

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrival = asyncio.get_running_loop().time()
        headers: dict[bytes, bytes] = dict(scope["headers"])
        try:
            if not self._auth.allows(headers.get(b"authorization")):
                raise ClientError(
                    401,
                    "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                )
            if not _is_json(headers.get(b"content-type")):
                raise ClientError(
                    400,
                    "the request body was not read as JSON; send a JSON object with the header "
                    "Content-Type: application/json",
                )
            raw = await self._read_body(headers, receive)
            body, model = _parse(raw)
            if not model:
                model = self._only_model()
            pool = self._registry.pools.get(model)
            if pool is None:
                served = ", ".join(self._registry.served_models()) or "none yet"
                raise ClientError(
                    404,
                    f"model {model!r} is not served here; served models: {served}",
                    param="model",
                    code="model_not_found",
                )
        except ClientError as exc:
            error = error_json(exc.status, str(exc), param=exc.param, code=exc.code)
            extra = [(b"www-authenticate", b"Bearer")] if exc.status == 401 else []
            await _respond(send, exc.status, error, extra)
            self._metrics.requests.labels("", "", str(exc.status)).inc()
            return

        request_headers = self._upstream_headers
        if (request_id := headers.get(b"x-request-id")) is not None:
            request_headers = {**request_headers, "x-request-id": request_id.decode("latin-1")}
        route = RouteRequest(
            scope["path"], body, self._s.prefix_block_chars, self._s.prefix_max_blocks
        )
        # The request is forwarded in this task; a watcher cancels it if the client goes away
        # first (closing the upstream stream is what aborts it on the replica). One task and a
        # callback per request, where two tasks and asyncio.wait took 8% of the gateway's
        # samples on the routing workload's chats (docs/profiles/gateway-cpu.md).
        client = _ClientWatch(receive)
        request = UpstreamRequest(
            scope["path"],
            raw,
            request_headers,
            bool(body.get("stream")),
            arrival,
            # each replica tried is told its tag, for the ids of the responses it stores
            tag_replica=scope["path"] == "/v1/responses",
            stalled=client.stalled,
            responded=client.responded,
        )
        try:
            await self._forward(pool, route, request, send)
        except asyncio.CancelledError:
            if not client.went_away or client.task.uncancel():
                raise  # cancelled from elsewhere (shutdown), not only by the client leaving
            self._metrics.requests.labels(pool.model, "", CLIENT_CLOSED).inc()
        finally:
            client.close()

    def _only_model(self) -> str:
        """The model a request that names none is for: the one this gateway serves, as a
        replica (and vLLM) takes a request without ``model`` for its one model."""
        served = self._registry.served_models()
        if len(served) == 1:
            return served[0]
        raise ClientError(
            400,
            f"'model' is required: this gateway serves {len(served)} models "
            f"({', '.join(served) or 'none yet'}); name one (GET /v1/models lists them)",
            param="model",
        )

    async def _read_body(self, headers: dict[bytes, bytes], receive: Receive) -> bytes:
        limit = self._s.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise _too_large(limit)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientError(400, "client disconnected before sending the whole body")
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _forward(
        self, pool: Pool, route: RouteRequest, request: UpstreamRequest, send: Send
    ) -> None:
        """Hold while the model has no ready replica (or, queueing at the gateway, none with
        room), then try replicas the pool offers until one answers or ``--max-attempts`` were
        made; answer the last failure."""
        loop = asyncio.get_running_loop()
        tried: set[str] = set()
        last_url = ""
        failure: Failure | None = None
        if not pool.has_ready():
            failure = await self._holding.until_ready(pool, request.arrival)
        if failure is None and self._s.queue_at_gateway:
            priority = route.priority if pool.orders_by_priority() else 0
            failure = await self._holding.until_room(pool, request.arrival, priority)
        for attempt in range(self._s.max_attempts if failure is None else 0):
            choice = pool.choose(route, self._holding.view(), tried)
            if choice is NoCandidate.QUEUES_FULL:
                failure = Failure(
                    429,
                    f"every replica of model {pool.model!r} has a full queue; retry later",
                    str(self._s.retry_after_s).encode(),
                    code="queue_full",
                )
            if isinstance(choice, NoCandidate):
                break
            self._metrics.decisions.labels(pool.model, pool.policy.name, choice.reason).inc()
            if attempt:
                self._metrics.retries.labels(pool.model, last_url).inc()
                await asyncio.sleep(self._s.retry_backoff_s * 2 ** (attempt - 1))
            tried.add(choice.replica.url)
            last_url = choice.replica.url
            try:
                failure = await self._upstream.attempt(pool, choice.replica, request, send)
            finally:
                self._holding.room_freed(pool)
            if failure is None:
                return
            log.warning(
                "attempt %d for model %s on %s failed: %s",
                attempt + 1, pool.model, choice.replica.url, failure.message,
            )  # fmt: skip

        if failure is None:
            failure = Failure(
                503,
                f"no ready replica for model {pool.model!r}; retry later",
                str(self._s.retry_after_s).encode(),
            )
        extra = [(b"retry-after", failure.retry_after)] if failure.retry_after else []
        error = error_json(failure.status, failure.message, code=failure.code)
        await _respond(send, failure.status, error, extra)
        self._metrics.requests.labels(pool.model, "", str(failure.status)).inc()
        self._metrics.duration.labels(pool.model).observe(loop.time() - request.arrival)


def _too_large(limit: int) -> ClientError:
    return ClientError(
        413,
        f"request body is larger than {limit} bytes; send a shorter prompt or raise --max-body-bytes",
    )


def _parse(raw: bytes) -> tuple[dict[str, Any], str]:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep to parse
        raise ClientError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ClientError(400, "request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ClientError(
            400,
            f"'model' must be a string naming the model (GET /v1/models lists them), "
            f"got {type(model).__name__}",
            param="model",
        )
    return body, model or ""


def _is_json(content_type: bytes | None) -> bool:
    """Whether a body with this Content-Type is read as JSON: none given, ``application/json``
    or ``application/...+json`` (what a replica's FastAPI reads as JSON; anything else it
    refuses)."""
    if content_type is None:
        return True
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (
        media.startswith(b"application/") and media.endswith(b"+json")
    )


class _ClientWatch:
    """Cancels the task that forwards a request when its client goes away before the last
    byte of the response was sent to it. Until the forwarding returns, or it says the client
    has the whole response (``responded``), uvicorn's ``receive`` says ``http.disconnect``
    only for a client that left."""

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None, "the proxy runs in the ASGI server's request task"
        self.task = task
        self.went_away = False
        self._responded = False
        self._watcher = asyncio.ensure_future(_wait_disconnect(receive))
        self._watcher.add_done_callback(self._on_disconnect)

    def stalled(self) -> None:
        """The client read nothing for --client-stall-timeout: drop its request as if it had
        left (the upstream stream is closed, which aborts it on the replica)."""
        if self._responded or self.went_away:
            return
        log.warning("a client read nothing for --client-stall-timeout; its request is dropped")
        self.went_away = True
        self.task.cancel()

    def responded(self) -> None:
        """The client has the whole response (uvicorn's ``receive`` says ``http.disconnect``
        from now on)."""
        self._responded = True

    def _on_disconnect(self, watcher: asyncio.Future[None]) -> None:
        if watcher.cancelled() or watcher.exception() is not None or self._responded:
            return
        self.went_away = True
        self.task.cancel()

    def close(self) -> None:
        self._responded = True
        self._watcher.cancel()


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _respond(
    send: Send, status: int, body: bytes, extra_headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *(extra_headers or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
