"""The node agent's asynchronous API client: JSON calls and watches over one HTTP/1.1 pool."""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from typing import Any

import httpx

from conveyor.cluster.api import ApiError, Credentials


class AsyncApi:
    """Calls to one apiserver with the agent's credentials. Close with ``aclose``."""

    def __init__(self, credentials: Credentials, *, timeout_s: float = 30.0) -> None:
        ctx = ssl.create_default_context(
            cafile=str(credentials.ca_file) if credentials.ca_file else None
        )
        if credentials.cert_file and credentials.key_file:
            ctx.load_cert_chain(str(credentials.cert_file), str(credentials.key_file))
        headers = {"Accept": "application/json"}
        if credentials.token:
            headers["Authorization"] = f"Bearer {credentials.token}"
        self.server = credentials.server
        self._client = httpx.AsyncClient(
            base_url=credentials.server,
            verify=ctx,
            headers=headers,
            timeout=timeout_s,
            trust_env=False,
            limits=httpx.Limits(max_connections=20, max_keepalive_connections=10),
        )

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        """One call; the decoded JSON, or ``ApiError`` for a status other than 2xx."""
        content = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": content_type} if body is not None else None
        resp = await self._client.request(
            method, path, content=content, params=params, headers=headers
        )
        try:
            decoded: Any = resp.json() if resp.content else None
        except ValueError:
            decoded = resp.text
        if resp.status_code >= 300:
            raise ApiError(method, path, resp.status_code, decoded)
        return decoded

    async def get(self, path: str, **params: str) -> Any:
        return await self.request("GET", path, params=params or None)

    async def patch_status(self, path: str, status: dict[str, Any]) -> Any:
        """Merge-patch a status subresource (lists in it are replaced whole)."""
        return await self.request(
            "PATCH",
            f"{path}/status",
            {"status": status},
            content_type="application/merge-patch+json",
        )

    async def watch(
        self, path: str, params: dict[str, str], timeout_s: int, *, idle_s: float = 90.0
    ) -> AsyncIterator[dict[str, Any]]:
        """The events of a watch from ``resourceVersion`` in ``params`` until the server ends it;
        ``httpx.ReadTimeout`` when no event (bookmarks included) came for ``idle_s``."""
        query = {
            **params,
            "watch": "1",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_s),
        }
        timeout = httpx.Timeout(30.0, read=min(idle_s, timeout_s + 30.0))
        async with self._client.stream("GET", path, params=query, timeout=timeout) as resp:
            if resp.status_code >= 300:
                body = (await resp.aread()).decode(errors="replace")
                raise ApiError("GET", path, resp.status_code, body)
            async for line in resp.aiter_lines():
                if line.strip():
                    yield json.loads(line)

    async def aclose(self) -> None:
        await self._client.aclose()
