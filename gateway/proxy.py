"""Proxying ``POST /v1/completions``, ``/v1/chat/completions``, ``/tokenize`` and ``/detokenize``
to one replica of the model's pool.

A raw ASGI handler: the body is read once (bounded), the model picks the pool, the pool's
policy picks a replica. Until the first byte goes to the client every failure is retried on
another replica (connection errors, timeouts, 5xx, a replica that dies before its first
chunk); after it, a failure ends the stream with an OpenAI-style error event. Streams pass
through chunk by chunk as the replica sends them. A client that goes away cancels the
upstream request, so the replica aborts it and frees its KV blocks. Bodies and
Authorization headers are never logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp

from conveyor.gateway.auth import ApiKeyAuth
from conveyor.gateway.errors import error_body, sse_error_event
from conveyor.gateway.metrics import GatewayMetrics
from conveyor.gateway.pool import Pool, Registry
from conveyor.gateway.prefix_key import RouteRequest
from conveyor.gateway.replica import Replica
from conveyor.gateway.routing import LoadView
from conveyor.gateway.settings import GatewaySettings

log = logging.getLogger("conveyor.gateway")

HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"date", b"server",
     b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer", b"upgrade"}
)  # fmt: skip
BACKEND_HEADER = b"x-conveyor-backend"
CLIENT_CLOSED = "499"
UPSTREAM_ERRORS = (aiohttp.ClientError, TimeoutError)
"""What a replica that is gone, hung or broken looks like from the data path."""
# nginx's code for a client that went away first


@dataclass
class Failure:
    """An attempt that failed before the first byte reached the client."""

    status: int
    message: str
    retry_after: bytes | None = None


class ClientError(Exception):
    """A request the gateway refuses itself; the message says what to change."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


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
        self._session = session
        self._metrics = metrics
        self._auth = auth
        self._s = settings
        self._upstream_headers = {"content-type": "application/json"}
        if settings.backend_api_key:
            self._upstream_headers["authorization"] = f"Bearer {settings.backend_api_key}"

    # ASGI entry point ---------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        loop = asyncio.get_running_loop()
        arrival = loop.time()
        headers = dict(scope["headers"])
        try:
            if not self._auth.allows(headers.get(b"authorization")):
                raise ClientError(
                    401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'"
                )
            raw = await self._read_body(headers, receive)
            body, model = _parse(raw)
            pool = self._registry.pools.get(model)
            if pool is None:
                served = ", ".join(self._registry.served_models()) or "none yet"
                raise ClientError(
                    404,
                    f"model {model!r} is not served here; served models: {served}",
                    param="model",
                )
        except ClientError as exc:
            await _respond(send, exc.status, error_body(exc.status, str(exc), param=exc.param))
            self._metrics.requests.labels("", "", str(exc.status)).inc()
            return

        request_id = headers.get(b"x-request-id")
        route = RouteRequest(
            scope["path"], body, self._s.prefix_block_chars, self._s.prefix_max_blocks
        )
        forward = asyncio.ensure_future(
            self._forward(pool, route, raw, bool(body.get("stream")), request_id, arrival, send)
        )
        disconnect = asyncio.ensure_future(_wait_disconnect(receive))
        await asyncio.wait((forward, disconnect), return_when=asyncio.FIRST_COMPLETED)
        if forward.done():
            disconnect.cancel()
            forward.result()
            return
        forward.cancel()  # the client went away: closing the upstream stream aborts it there
        try:
            await forward
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # we are being cancelled too, not just forward
                raise
        self._metrics.requests.labels(pool.model, "", CLIENT_CLOSED).inc()

    async def _read_body(self, headers: dict[bytes, bytes], receive: Any) -> bytes:
        limit = self._s.max_body_bytes
        too_large = ClientError(
            413,
            f"request body is larger than {limit} bytes; send a shorter prompt or raise --max-body-bytes",
        )
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise too_large
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientError(400, "client disconnected before sending the whole body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    # Routing and retries -------------------------------------------------------------------

    async def _forward(
        self,
        pool: Pool,
        route: RouteRequest,
        raw: bytes,
        stream: bool,
        request_id: bytes | None,
        arrival: float,
        send: Any,
    ) -> None:
        loop = asyncio.get_running_loop()
        headers = self._upstream_headers
        if request_id is not None:
            headers = {**headers, "x-request-id": request_id.decode("latin-1")}
        tried: set[str] = set()
        last_url = ""
        failure: Failure | None = None
        if not pool.has_ready():
            failure = await self._hold(pool, arrival)
        for attempt in range(self._s.max_attempts if failure is None else 0):
            now = loop.time()
            admitted = [r for r in pool.replicas.values() if r.admitted(now) and r.url not in tried]
            if not admitted:
                # Panic mode (as Envoy's): every replica ejected is a guess gone wrong; those
                # whose last /load poll said ready are tried rather than refusing the request.
                admitted = [
                    r
                    for r in pool.replicas.values()
                    if r.load is not None and r.load.ready and r.url not in tried
                ]
            candidates = [r for r in admitted if not r.queue_full(now, self._s.load_stale_after_s)]
            if not candidates:
                if admitted:
                    failure = Failure(
                        429,
                        f"every replica of model {pool.model!r} has a full queue; retry later",
                        str(self._s.retry_after_s).encode(),
                    )
                break
            decision = pool.policy.choose(
                candidates, route, LoadView(now, self._s.load_stale_after_s)
            )
            self._metrics.decisions.labels(pool.model, pool.policy.name, decision.reason).inc()
            replica = decision.replica
            if attempt:
                self._metrics.retries.labels(pool.model, last_url).inc()
                await asyncio.sleep(self._s.retry_backoff_s * 2 ** (attempt - 1))
            tried.add(replica.url)
            last_url = replica.url
            failure = await self._attempt(
                pool, replica, route.path, raw, headers, stream, arrival, send
            )
            if failure is None:
                return
            log.warning(
                "attempt %d for model %s on %s failed: %s",
                attempt + 1,
                pool.model,
                replica.url,
                failure.message,
            )

        if failure is None:
            failure = Failure(
                503,
                f"no ready replica for model {pool.model!r}; retry later",
                str(self._s.retry_after_s).encode(),
            )
        extra = [(b"retry-after", failure.retry_after)] if failure.retry_after else []
        await _respond(send, failure.status, error_body(failure.status, failure.message), extra)
        self._metrics.requests.labels(pool.model, "", str(failure.status)).inc()
        self._metrics.duration.labels(pool.model).observe(loop.time() - arrival)

    async def _hold(self, pool: Pool, arrival: float) -> Failure | None:
        """Hold a request while its model has no ready replica (scale from zero), counted in
        ``conveyor_gateway_pending_requests`` for the operator to see; None once a replica is
        ready, a 503 when ``--hold-timeout`` passed, the model went away, or
        ``--max-held-requests`` are already held for it."""
        retry_after = str(self._s.retry_after_s).encode()
        if pool.held >= self._s.max_held_requests:
            return Failure(
                503,
                f"no ready replica for model {pool.model!r} and {pool.held} requests already "
                "waiting for one; retry later",
                retry_after,
            )
        loop = asyncio.get_running_loop()
        deadline = arrival + self._s.hold_timeout_s
        pending = self._metrics.pending.labels(pool.model)
        pending.inc()
        pool.held += 1
        try:
            while True:
                changed = self._registry.changed()
                if pool.has_ready():
                    return None
                remaining = deadline - loop.time()
                if remaining <= 0 or self._registry.pools.get(pool.model) is not pool:
                    break
                try:
                    await asyncio.wait_for(changed.wait(), remaining)
                except TimeoutError:
                    if pool.has_ready():
                        return None
                    break
        finally:
            pending.dec()
            pool.held -= 1
        return Failure(
            503,
            f"no ready replica for model {pool.model!r} after waiting "
            f"{self._s.hold_timeout_s:g} s; retry later",
            retry_after,
        )

    async def _attempt(
        self,
        pool: Pool,
        replica: Replica,
        path: str,
        raw: bytes,
        headers: dict[str, str],
        stream: bool,
        arrival: float,
        send: Any,
    ) -> Failure | None:
        """One try on one replica; a Failure means nothing reached the client yet."""
        loop = asyncio.get_running_loop()
        in_flight = self._metrics.in_flight.labels(pool.model, replica.url)
        replica.in_flight += 1
        in_flight.inc()
        response: aiohttp.ClientResponse | None = None
        done = False
        try:
            try:
                response = await self._session.post(replica.url + path, data=raw, headers=headers)
            except UPSTREAM_ERRORS as exc:
                return self._eject(
                    pool, replica, f"could not reach {replica.url}: {_describe(exc)}"
                )
            status = response.status
            if status >= 500:
                return self._eject(pool, replica, f"{replica.url} answered {status}", response)
            if status == 429:
                return Failure(
                    429,
                    f"every replica of model {pool.model!r} is over its queue bound; retry later",
                    response.headers.get("retry-after", str(self._s.retry_after_s)).encode(),
                )
            out_headers = [(k, v) for k, v in response.raw_headers if k.lower() not in HOP_BY_HOP]
            out_headers.append((BACKEND_HEADER, replica.url.encode()))
            if not (stream and response.content_type == "text/event-stream"):
                try:
                    content = await response.read()
                except UPSTREAM_ERRORS as exc:
                    return self._eject(pool, replica, f"{replica.url} broke off: {_describe(exc)}")
                out_headers.append((b"content-length", str(len(content)).encode()))
                await send(
                    {"type": "http.response.start", "status": status, "headers": out_headers}
                )
                await send({"type": "http.response.body", "body": content})
                done = True
                self._finish(pool, replica, status, arrival)
                return None

            chunks = response.content.iter_any()
            first = b""
            try:
                # Hold back a chat stream's role-only opening chunk, which a replica sends before
                # prefill: the first byte the client sees carries the first token, so a replica
                # that dies while queueing or prefilling is still retried elsewhere.
                async for chunk in chunks:
                    first += chunk
                    if _has_token(first):
                        break
            except UPSTREAM_ERRORS as exc:
                return self._eject(pool, replica, f"{replica.url} broke off: {_describe(exc)}")
            # The first byte goes out now: from here on there is no retry.
            await send({"type": "http.response.start", "status": status, "headers": out_headers})
            await send({"type": "http.response.body", "body": first, "more_body": True})
            self._metrics.ttft.labels(pool.model).observe(loop.time() - arrival)
            try:
                async for chunk in chunks:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                done = True
            except UPSTREAM_ERRORS as exc:
                message = f"replica {replica.url} failed mid-stream: {_describe(exc)}"
                log.warning("model %s: %s", pool.model, message)
                self._eject(pool, replica, message)
                event = sse_error_event(message)
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            self._finish(pool, replica, status, arrival)
            return None
        finally:
            if response is not None:
                if done:
                    response.release()  # read to the end: the connection goes back to the pool
                else:
                    response.close()  # closing the connection is what aborts the request upstream
            replica.in_flight -= 1
            in_flight.dec()

    def _eject(
        self,
        pool: Pool,
        replica: Replica,
        message: str,
        response: aiohttp.ClientResponse | None = None,
    ) -> Failure:
        now = asyncio.get_running_loop().time()
        if replica.eject(now, self._s.ejection_s):
            log.warning("ejected %s for %.1fs: %s", replica.url, self._s.ejection_s, message)
            self._metrics.ejections.labels(pool.model, replica.url).inc()
        status = 502
        retry_after = None
        if response is not None and response.status in (502, 503, 504):
            status = response.status
            retry_after = response.headers.get("retry-after", str(self._s.retry_after_s)).encode()
        return Failure(status, message, retry_after)

    def _finish(self, pool: Pool, replica: Replica, status: int, arrival: float) -> None:
        self._metrics.requests.labels(pool.model, replica.url, str(status)).inc()
        self._metrics.duration.labels(pool.model).observe(
            asyncio.get_running_loop().time() - arrival
        )


def _parse(raw: bytes) -> tuple[dict[str, Any], str]:
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise ClientError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ClientError(400, "request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ClientError(
            400,
            "'model' is required: name the model to use (GET /v1/models lists them)",
            param="model",
        )
    return body, model


def _has_token(buffer: bytes) -> bool:
    """Whether ``buffer`` holds a complete SSE event beyond a role-only opening chunk."""
    return any(not _is_role_only(event) for event in buffer.split(b"\n\n")[:-1])


def _is_role_only(event: bytes) -> bool:
    data = event.strip().removeprefix(b"data:").strip()
    if not data.startswith(b"{") or b'"role"' not in data:
        return False
    try:
        choices = json.loads(data).get("choices")
    except ValueError:
        return False
    if not isinstance(choices, list) or not choices:
        return False
    for choice in choices:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(delta, dict) or choice.get("finish_reason") is not None:
            return False
        if delta.get("content") or delta.keys() - {"role", "content"}:
            return False
    return True


async def _wait_disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _respond(
    send: Any, status: int, body: bytes, extra_headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *(extra_headers or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
