"""Static discovery: replicas from ``--backend`` flags and a file that is re-read when it changes.

A backend is ``URL`` or ``MODEL=URL``. Without a model the names come from the replica's
``GET /v1/models``; a replica that does not answer yet is asked again every interval, and
joins its pools once it does, and one that did is asked again every ``REFRESH_INTERVALS``
intervals, so a replica restarted under another name moves to that name's pool (until it
answers, it keeps the names it had). Editing the file adds and removes replicas without a
restart.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Iterable

import httpx

from conveyor.gateway.auth import backend_headers
from conveyor.gateway.pool import Registry

log = logging.getLogger("conveyor.gateway")

REFRESH_INTERVALS = 10
"""Discovery intervals after which a replica's model names are asked for again."""


def parse_backend(spec: str) -> tuple[str | None, str]:
    """``URL`` or ``MODEL=URL`` -> (model or None, URL without a trailing slash)."""
    spec = spec.strip()
    model, sep, url = spec.partition("=")
    if not sep or "://" in model:
        model, url = "", spec
    if not url.startswith(("http://", "https://")):
        raise ValueError(
            f"backend {spec!r} is not a URL: write http://HOST:PORT, or MODEL=http://HOST:PORT"
        )
    return (model.strip() or None), url.rstrip("/")


def parse_backends(lines: Iterable[str]) -> list[tuple[str | None, str]]:
    specs = []
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            specs.append(parse_backend(line))
    return specs


async def fetch_models(
    client: httpx.AsyncClient, url: str, headers: dict[str, str], timeout: float
) -> list[str]:
    """Model names a replica serves, from its /v1/models."""
    response = await client.get(f"{url}/v1/models", headers=headers, timeout=timeout)
    response.raise_for_status()
    data = json.loads(response.content).get("data")
    if not isinstance(data, list):
        raise ValueError(f"{url}/v1/models has no 'data' list")
    return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]


class StaticDiscovery:
    source = "static"

    def __init__(
        self,
        *,
        registry: Registry,
        client: httpx.AsyncClient,
        backends: tuple[str, ...],
        backends_file: str | None,
        interval_s: float,
        timeout_s: float,
        backend_api_key: str | None,
    ) -> None:
        self._registry = registry
        self._client = client
        self._flag_specs = parse_backends(backends)
        self._file = backends_file
        self._file_stamp: tuple[int, int, int] | None = None
        self._file_specs: list[tuple[str | None, str]] = []
        self._interval = interval_s
        self._timeout = timeout_s
        self._headers = backend_headers(backend_api_key)
        self._models: dict[str, list[str]] = {}
        """Model names learned from replicas' /v1/models, by URL."""
        self._asked_at: dict[str, float] = {}
        """Loop time each URL's names were last asked for (answered or not)."""
        self.synced = asyncio.Event()

    async def run(self) -> None:
        while True:
            await self.sync_once()
            await asyncio.sleep(self._interval)  # a polling interval, not synchronisation

    async def sync_once(self) -> None:
        if self._file:
            await self._reload_file()
        specs = self._flag_specs + self._file_specs
        now = asyncio.get_running_loop().time()
        refresh_after = REFRESH_INTERVALS * self._interval
        unresolved = {
            url
            for model, url in specs
            if model is None
            and (url not in self._models or now - self._asked_at.get(url, now) >= refresh_after)
        }
        if unresolved:
            await asyncio.gather(*(self._resolve(url, now) for url in sorted(unresolved)))
        members: dict[str, set[str]] = {}
        for model, url in specs:
            for name in [model] if model else self._models.get(url, []):
                members.setdefault(name, set()).add(url)
        listed = {url for _, url in specs}
        for url in self._models.keys() - listed:
            del self._models[url]
        for url in self._asked_at.keys() - listed:
            del self._asked_at[url]
        self._registry.sync(self.source, members)
        self.synced.set()

    async def _resolve(self, url: str, now: float) -> None:
        self._asked_at[url] = now
        known = self._models.get(url)
        try:
            models = await fetch_models(self._client, url, self._headers, self._timeout)
        except (httpx.HTTPError, ValueError) as exc:
            if known is None:
                log.info(
                    "backend %s has not told its models yet (%s); asking again",
                    url,
                    type(exc).__name__,
                )
            return  # a replica that told its names once keeps them until it tells others
        self._models[url] = models
        if models != known:
            log.info("backend %s serves %s", url, models)

    async def _reload_file(self) -> None:
        assert self._file is not None
        try:
            stat = await asyncio.to_thread(os.stat, self._file)
        except FileNotFoundError:
            if self._file_stamp is not None or not self.synced.is_set():
                log.warning("backends file %s does not exist; no backends from it", self._file)
            self._file_stamp, self._file_specs = None, []
            return
        stamp = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        if stamp == self._file_stamp:
            return
        text = await asyncio.to_thread(_read_text, self._file)
        try:
            self._file_specs = parse_backends(text.splitlines())
        except ValueError as exc:
            log.error("backends file %s: %s; keeping the previous backends", self._file, exc)
            return
        self._file_stamp = stamp
        log.info("backends file %s: %d backends", self._file, len(self._file_specs))


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()
