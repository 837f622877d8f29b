"""Polls every replica's load on a fixed interval from one background task, but for the
replicas whose load came with a response lately (Conveyor replicas say it in the
``x-conveyor-load`` header of every API response; the gateway's settings say how lately):
under traffic the replicas serve no polls, each of which is a request on a busy replica's CPU.

A replica's load is read through ``conveyor.contracts.engine_load``, whatever engine it runs:
Conveyor's ``GET /load``, or, where a replica has no such document there (SGLang answers 404,
vLLM a ``/load`` of its own), its ``GET /metrics``, which is where it is read from then on.
Both at the same interval.

Polls go over aiohttp, as the data path does: a poll through httpx took about 2 ms of the
gateway's CPU against 0.1-0.2 ms, and at 5 polls per replica per second that was half the
gateway's CPU on the routing bench's chat workload (docs/profiles/gateway-proxy.md). A
pooled connection the replica closed just as it was reused is tried once more, so a
keep-alive race does not make a replica unroutable until its next poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging

import aiohttp

from conveyor.contracts.engine_load import LOAD_PATH, METRICS_PATH, read_load
from conveyor.contracts.load import ReplicaLoad
from conveyor.gateway.auth import backend_headers
from conveyor.gateway.metrics import GatewayMetrics
from conveyor.gateway.pool import Registry
from conveyor.gateway.replica import Replica
from conveyor.gateway.upstream_attempt import stale_connection, upstream_url

log = logging.getLogger("conveyor.gateway")

POLL_ERRORS = (aiohttp.ClientError, TimeoutError, ValueError)
"""A replica that does not answer, answers an error, or answers something that is no load."""


class LoadPoller:
    """One loop; each replica has at most one poll in flight, with its own timeout.

    A replica that joins is polled at once, so it takes traffic as soon as it says ready.
    """

    def __init__(
        self,
        *,
        registry: Registry,
        session: aiohttp.ClientSession,
        metrics: GatewayMetrics,
        interval_s: float,
        timeout_s: float,
        backend_api_key: str | None,
        heard_max_age_s: float = 0.0,
    ) -> None:
        self._registry = registry
        self._session = session
        self._metrics = metrics
        self._interval = interval_s
        self._heard_max_age = heard_max_age_s
        """How long a load report in a response's header stands in for polls (0: never)."""
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._headers = backend_headers(backend_api_key)
        self._polls: dict[str, asyncio.Task[None]] = {}
        self._unanswered: set[str] = set()
        """Replicas whose last /load poll failed (its first failure is logged, not each)."""
        self._paths: dict[str, str] = {}
        """Replicas read from /metrics (they have no /load); any other is read from /load."""
        self._wake = asyncio.Event()
        registry.listeners.append(self._on_change)

    def _on_change(self, added: list[Replica], removed: list[Replica]) -> None:
        for replica in removed:
            self._unanswered.discard(replica.url)
            self._paths.pop(replica.url, None)
            task = self._polls.pop(replica.url, None)
            if task is not None:
                task.cancel()
            self._metrics.forget_backend(replica.url, set(self._registry.pools) | {""})
        if added:
            self._wake.set()

    async def run(self) -> None:
        try:
            while True:
                for replica in self.due(asyncio.get_running_loop().time()):
                    url = replica.url
                    task = asyncio.create_task(self._poll(replica), name=f"poll {url}")
                    self._polls[url] = task
                    task.add_done_callback(functools.partial(self._forget_poll, url))
                self._wake.clear()
                with contextlib.suppress(TimeoutError):  # the interval passed: poll again
                    await asyncio.wait_for(self._wake.wait(), self._interval)
        finally:
            for task in list(self._polls.values()):
                task.cancel()
            await asyncio.gather(*self._polls.values(), return_exceptions=True)

    def due(self, now: float) -> list[Replica]:
        """The replicas to poll now: all but those with a poll in flight and those whose load
        came with a response (after any ejection) less than ``heard_max_age`` ago."""
        return [
            replica
            for url, replica in self._registry.replicas.items()
            if url not in self._polls
            and not (
                replica.load is not None
                and replica.heard_at > max(replica.ejected_at, now - self._heard_max_age)
            )
        ]

    def _forget_poll(self, url: str, _task: asyncio.Task[None]) -> None:
        self._polls.pop(url, None)

    async def _get(self, url: str, path: str) -> ReplicaLoad:
        try:
            return await self._get_once(url, path)
        except aiohttp.ClientError as exc:
            if not stale_connection(exc):
                raise
        return await self._get_once(url, path)  # the replica had closed that pooled connection

    async def _get_once(self, url: str, path: str) -> ReplicaLoad:
        async with self._session.get(
            upstream_url(url, path), headers=self._headers, timeout=self._timeout
        ) as response:
            response.raise_for_status()
            return read_load(path, await response.read(), self._registry.limits_of(url))

    async def _read(self, url: str) -> ReplicaLoad:
        """The replica's load from where it was last read (``/load`` at first). Where that
        path is missing or holds another document (vLLM has a ``/load`` of its own,
        ``{"server_load": n}``), the other path is read, and from then on if it answers."""
        path = self._paths.get(url, LOAD_PATH)
        try:
            return await self._get(url, path)
        except (aiohttp.ClientResponseError, ValueError) as exc:
            if isinstance(exc, aiohttp.ClientResponseError) and exc.status != 404:
                raise
            other = METRICS_PATH if path == LOAD_PATH else LOAD_PATH
            try:
                report = await self._get(url, other)
            except POLL_ERRORS:
                raise exc from None  # what the path it is read from said
        if other == METRICS_PATH:
            self._paths[url] = other
        else:
            self._paths.pop(url, None)
        return report

    async def _poll(self, replica: Replica) -> None:
        loop = asyncio.get_running_loop()
        sent_at = loop.time()
        in_flight = replica.in_flight
        try:
            report = await self._read(replica.url)
        except POLL_ERRORS as exc:
            was_admitted = replica.admitted(loop.time())
            if replica.url not in self._unanswered:
                self._unanswered.add(replica.url)
                if not was_admitted:  # a replica that never answered, or came back unready
                    log.info(
                        "replica %s does not answer /load yet: %s", replica.url, _describe(exc)
                    )
            replica.record_poll_failure()
            if was_admitted:
                log.warning("replica %s stopped answering /load: %s", replica.url, _describe(exc))
                for model in replica.pools:
                    self._metrics.ejections.labels(model, replica.url).inc()
            return
        self.heard(replica, report, sent_at, in_flight)

    def heard_in_response(
        self, replica: Replica, report: ReplicaLoad, sent_at: float, in_flight: int
    ) -> None:
        """The ``x-conveyor-load`` header of a response to a request sent at ``sent_at``,
        received when this gateway had ``in_flight`` requests open there (``upstream_attempt``)."""
        replica.heard_at = max(replica.heard_at, sent_at)
        self.heard(replica, report, sent_at, in_flight)

    def heard(self, replica: Replica, report: ReplicaLoad, sent_at: float, in_flight: int) -> None:
        """A load report from ``replica``, taken after ``sent_at`` (when this gateway had
        ``in_flight`` requests open there)."""
        self._unanswered.discard(replica.url)
        now = asyncio.get_running_loop().time()
        was_admitted = replica.admitted(now)
        was_ready = replica.load is not None and replica.load.ready
        replica.record_poll(report, sent_at, in_flight)
        if replica.admitted(now) and not was_admitted:
            log.info("replica %s is ready", replica.url)
        if report.ready and not was_ready:
            self._registry.notify()  # requests held for this replica's model go now
        for model in replica.pools:
            self._metrics.load.labels(model, replica.url, "running").set(report.running)
            self._metrics.load.labels(model, replica.url, "waiting").set(report.waiting)
            self._metrics.load.labels(model, replica.url, "kv_cache_usage").set(
                report.kv_cache_usage
            )


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
