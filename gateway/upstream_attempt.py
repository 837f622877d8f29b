"""One try of a proxied request on one replica.

Until the first byte goes to the client, a failure (the replica unreachable, a 5xx, a stream
that breaks before its first token) is returned as a :class:`Failure` for the caller to retry
elsewhere, and the replica is ejected for ``--ejection`` seconds; after it, a failure ends the
stream with an OpenAI-style error event. Streams pass through chunk by chunk as the replica
sends them. Closing the upstream response before its end is what aborts the request on the
replica (its KV blocks are freed).

A pooled connection the replica closed just as it was reused (its keep-alive ran out, or the
gateway's loop was too busy to see the close) is not the replica failing: that request is
sent once more before the replica is ejected; idle connections are dropped after 4 s, before
uvicorn's 5 s keep-alive closes them on the replica's side.

A replica silent for ``--upstream-timeout`` fails the attempt. Until the response head, which
for a whole answer comes only once it is generated (and for a stream once the request left the
replica's queue), silence is the replica showing no work: its load reports (polls, response
headers) no longer count new engine steps, or, from a replica that does not count them (vLLM,
SGLang), no longer come. An ``asyncio.timeout`` around the request, whose deadline the
:class:`SilenceWatch` moves on while the replica works, so a long generation is not cut off
or re-run elsewhere, and a replica whose engine hangs behind a server that still answers is.
After the head of a stream, silence is no chunk for that long while the gateway is waiting on
the replica (not while a slow client holds back the chunk before). The watch is one task that
looks a few times per timeout; aiohttp's own ``sock_read`` timeout did this by moving a timer
on every chunk, which took a tenth of the gateway's CPU at 2,000 streams
(docs/profiles/gateway-proxy.md); here a chunk costs a clock read and two attribute writes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
from starlette.types import Send
from yarl import URL

from conveyor.contracts.load import LOAD_HEADER, ReplicaLoad
from conveyor.contracts.response_id import REPLICA_TAG_HEADER
from conveyor.gateway import sse
from conveyor.gateway.errors import Failure
from conveyor.gateway.metrics import GatewayMetrics
from conveyor.gateway.pool import Pool
from conveyor.gateway.replica import Replica
from conveyor.gateway.settings import GatewaySettings

log = logging.getLogger("conveyor.gateway")

HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"date", b"server",
     b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer", b"upgrade"}
)  # fmt: skip
NOT_FORWARDED = HOP_BY_HOP | {LOAD_HEADER.encode()}
"""Headers of a replica's response that stay in the gateway (its load is for routing only)."""
BACKEND_HEADER = b"x-conveyor-backend"
LoadHeard = Callable[[Replica, ReplicaLoad, float, int], None]
UPSTREAM_ERRORS = (aiohttp.ClientError, TimeoutError)
"""What a replica that is gone, hung or broken looks like from the data path."""


@dataclass(frozen=True)
class UpstreamRequest:
    """A request as it is sent to each replica tried."""

    path: str
    body: bytes
    headers: dict[str, str]
    stream: bool
    """The client asked for a stream (``"stream": true``)."""
    arrival: float
    """Event-loop time the request reached the gateway."""
    stalled: Callable[[], None] = lambda: None
    """Drops the request (its client read nothing for --client-stall-timeout)."""
    tag_replica: bool = False
    """Send each replica tried its tag (``x-conveyor-replica-tag``), which it writes into the
    ids of the responses it stores (``POST /v1/responses``)."""
    responded: Callable[[], None] = lambda: None
    """Called once the client has the whole response while the replica's is still being read
    (a stream's ``[DONE]`` event went out): from then on the client leaving is no failure."""


@functools.lru_cache(maxsize=4096)
def upstream_url(base: str, path: str) -> URL:
    """A replica's URL for ``path``, parsed once rather than on every request."""
    return URL(base + path)


@functools.lru_cache(maxsize=1024)
def load_from_header(value: str) -> ReplicaLoad:
    """A ``LOAD_HEADER`` value read once per distinct value: a replica's counts change less
    often than it answers, and reports are immutable, so replicas' answers share them."""
    return ReplicaLoad.from_header(value)


@dataclass(eq=False)
class _Watched:
    response: aiohttp.ClientResponse
    replica: str
    last: float
    """Loop time the replica last sent something; ``inf`` while the gateway is not waiting on
    it (a chunk is being written to a client that holds it back)."""
    stalled: Callable[[], None]
    """Drops the request, for a client that stopped reading."""
    writing_since: float = math.inf
    """Loop time the chunk being written to the client began (``inf``: none is)."""


@dataclass(eq=False)
class _HeadWait:
    timeout: asyncio.Timeout
    replica: Replica
    sent_at: float


@dataclass
class SilenceWatch:
    """Fails the open upstream streams whose replica said nothing for ``timeout_s``, drops those
    whose client read nothing for ``client_stall_s``, and keeps the deadline of each request
    still waiting for its response head at ``timeout_s`` after the replica last showed work
    (the request's send, or a load report with new engine steps: ``Replica.progress_at``)."""

    timeout_s: float
    client_stall_s: float = math.inf
    """A chunk written to a client for this long drops the request (the client reads nothing)."""
    streams: set[_Watched] = field(default_factory=set)
    heads: set[_HeadWait] = field(default_factory=set)

    @property
    def interval_s(self) -> float:
        """How often streams are looked at: a stream fails at most this late."""
        return min(1.0, max(0.01, self.timeout_s / 4))

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.interval_s)  # the watch's period, not synchronisation
            self.look(loop.time())

    def look(self, now: float) -> None:
        """Move each waiting head's deadline to the replica's last sign of work, and fail the
        streams silent since ``now - timeout_s``."""
        for head in self.heads:
            if head.timeout.expired():
                continue  # its request is failing already (rescheduling would raise)
            working = max(head.sent_at, head.replica.progress_at)
            head.timeout.reschedule(working + self.timeout_s)
        stall = now - self.client_stall_s
        for watched in [w for w in self.streams if w.writing_since < stall]:
            self.streams.discard(watched)
            watched.stalled()
        deadline = now - self.timeout_s
        for watched in [w for w in self.streams if w.last < deadline]:
            self.streams.discard(watched)
            # what aiohttp's sock_read timeout does: the reader wakes with the error
            watched.response.content.set_exception(
                aiohttp.ServerTimeoutError(
                    f"{watched.replica} sent nothing for {self.timeout_s:g}s (--upstream-timeout)"
                )
            )


class Upstream:
    """Sends requests to replicas over the data path's one pooled client."""

    def __init__(
        self,
        *,
        session: aiohttp.ClientSession,
        metrics: GatewayMetrics,
        settings: GatewaySettings,
    ) -> None:
        self._session = session
        self._metrics = metrics
        self._s = settings
        self.watch = SilenceWatch(settings.upstream_timeout_s, settings.client_stall_timeout_s)
        """Run by the gateway (``watch.run()``) beside the load poller."""
        self.load_heard: LoadHeard | None = None
        """Given each load report a response's ``x-conveyor-load`` header carries (the load
        poller's ``heard``): the replica, the report, when the request was sent and the
        gateway's in-flight count there then."""

    def _read_load(
        self, replica: Replica, response: aiohttp.ClientResponse, sent_at: float, in_flight: int
    ) -> None:
        value = response.headers.get(LOAD_HEADER)
        if value is None or self.load_heard is None:
            return  # not a Conveyor replica (vLLM, SGLang): the poller reads it
        try:
            report = load_from_header(value)
        except ValueError as exc:
            log.debug("replica %s sent a load header that is no load: %s", replica.url, exc)
            return
        self.load_heard(replica, report, sent_at, in_flight)

    async def attempt(
        self, pool: Pool, replica: Replica, request: UpstreamRequest, send: Send
    ) -> Failure | None:
        """One try on one replica; a Failure means nothing reached the client yet."""
        loop = asyncio.get_running_loop()
        in_flight = self._metrics.in_flight.labels(pool.model, replica.url)
        replica.in_flight += 1
        in_flight.inc()
        sent_at = loop.time()
        response: aiohttp.ClientResponse | None = None
        watched: _Watched | None = None
        done = False
        try:
            for retry_stale in (True, False):
                try:
                    async with asyncio.timeout(self._s.upstream_timeout_s) as timeout:
                        head = _HeadWait(timeout, replica, sent_at)
                        self.watch.heads.add(head)
                        try:
                            response = await self._session.post(
                                upstream_url(replica.url, request.path),
                                data=request.body,
                                headers=_headers_for(request, replica),
                            )
                        finally:
                            self.watch.heads.discard(head)
                    break
                except UPSTREAM_ERRORS as exc:
                    if retry_stale and stale_connection(exc):
                        continue  # the replica had closed that pooled connection: once more
                    if isinstance(exc, TimeoutError) and not isinstance(exc, aiohttp.ClientError):
                        why = (
                            f"{replica.url} showed no work on the request for "
                            f"{self._s.upstream_timeout_s:g}s (--upstream-timeout)"
                        )
                    else:
                        why = f"could not reach {replica.url}: {_describe(exc)}"
                    return self._eject(pool, replica, why)
            assert response is not None
            status = response.status
            if status < 500 and self.load_heard is not None:
                # The replica wrote the report as it began its answer, which for a stream
                # that queued is seconds after the send: what this gateway sent before then is
                # in it, so ``in_flight`` is counted now, not at the send (else the requests
                # sent in between count twice, and the replica looks busier than it is). A
                # whole answer (or a refusal) is written once the request is done on the
                # replica, so its report leaves this request out.
                streamed = status == 200 and response.content_type == "text/event-stream"
                counted = replica.in_flight - (0 if streamed else 1)
                self._read_load(replica, response, sent_at, counted)
            if status >= 500:
                return self._eject(pool, replica, f"{replica.url} answered {status}", response)
            if status == 429:
                return Failure(
                    429,
                    f"every replica of model {pool.model!r} is over its queue bound; retry later",
                    response.headers.get("retry-after", str(self._s.retry_after_s)).encode(),
                    code="queue_full",
                )
            out_headers = [
                (k, v) for k, v in response.raw_headers if k.lower() not in NOT_FORWARDED
            ]
            out_headers.append((BACKEND_HEADER, replica.url.encode()))
            if not (request.stream and response.content_type == "text/event-stream"):
                try:
                    async with asyncio.timeout(self._s.upstream_timeout_s):
                        content = await response.read()
                except UPSTREAM_ERRORS as exc:
                    return self._eject(pool, replica, f"{replica.url} broke off: {_describe(exc)}")
                out_headers.append((b"content-length", str(len(content)).encode()))
                await send(
                    {"type": "http.response.start", "status": status, "headers": out_headers}
                )
                await send({"type": "http.response.body", "body": content})
                done = True
                self._finish(pool, replica, status, request.arrival)
                return None

            watched = _Watched(response, replica.url, loop.time(), request.stalled)
            self.watch.streams.add(watched)
            chunks = response.content.iter_any()
            try:
                first = await sse.read_to_first_token(chunks)
            except UPSTREAM_ERRORS as exc:
                return self._eject(pool, replica, f"{replica.url} broke off: {_describe(exc)}")
            watched.last = loop.time()
            # The first byte goes out now: from here on there is no retry. The chunk that
            # ends the stream (``data: [DONE]``, a response's last event) ends the client's
            # response with it, in one
            # write; the replica's own end of the response is still read, so that its
            # connection goes back to the pool.
            stream = sse.StreamEnd(first)
            ended = stream.ended
            # a client slow to take it is not the replica's silence (but has a bound of its own)
            watched.last, watched.writing_since = math.inf, loop.time()
            await send({"type": "http.response.start", "status": status, "headers": out_headers})
            await send({"type": "http.response.body", "body": first, "more_body": not ended})
            watched.last, watched.writing_since = loop.time(), math.inf
            self._metrics.ttft.labels(pool.model).observe(loop.time() - request.arrival)
            if ended:
                request.responded()
                self._finish(pool, replica, status, request.arrival)
            try:
                async for chunk in chunks:
                    if ended:
                        watched.last = loop.time()
                        log.debug("%s sent %d bytes after [DONE]; dropped", replica.url, len(chunk))
                        continue
                    ended = stream.sent(chunk)
                    watched.last, watched.writing_since = math.inf, loop.time()
                    await send(
                        {"type": "http.response.body", "body": chunk, "more_body": not ended}
                    )
                    watched.last, watched.writing_since = loop.time(), math.inf
                    if ended:
                        request.responded()
                        self._finish(pool, replica, status, request.arrival)
                done = True
            except UPSTREAM_ERRORS as exc:
                if ended:  # the client has the whole stream: only this connection is lost
                    log.debug("%s broke off after [DONE]: %s", replica.url, _describe(exc))
                    return None
                message = f"replica {replica.url} failed mid-stream: {_describe(exc)}"
                log.warning("model %s: %s", pool.model, message)
                self._eject(pool, replica, message)
                event = stream.error(message)
                await send({"type": "http.response.body", "body": event, "more_body": True})
            if not ended:
                await send({"type": "http.response.body", "body": b""})
                self._finish(pool, replica, status, request.arrival)
            return None
        finally:
            if watched is not None:
                self.watch.streams.discard(watched)
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


def _headers_for(request: UpstreamRequest, replica: Replica) -> dict[str, str]:
    if not request.tag_replica:
        return request.headers
    return {**request.headers, REPLICA_TAG_HEADER: replica.tag}


def stale_connection(exc: BaseException) -> bool:
    """Whether ``exc`` is a pooled keep-alive connection the replica closed as it was reused
    (it disconnected, or the request could not be written): the replica is fine, and the
    request is tried once more on it before it counts as a failure. A refused or timed-out
    connect is not this."""
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return True
    return isinstance(exc, aiohttp.ClientOSError) and not isinstance(
        exc, aiohttp.ClientConnectorError
    )


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError) and not str(exc):
        return "TimeoutError: no answer within --upstream-timeout"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
