"""``GET`` and ``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``: a stored
response is read where it is stored.

A replica keeps the responses it made in its own memory; the id names it
(``conveyor/contracts/response_id.py``), so the gateway forwards these to that replica and
passes its answer back. An id that names no replica of this gateway is a 404 here.
"""

from __future__ import annotations

import logging

import httpx
from fastapi.responses import Response

from conveyor.contracts.response_id import tag_of
from conveyor.gateway.errors import error_json
from conveyor.gateway.pool import Registry

log = logging.getLogger("conveyor.gateway")

PASSED_HEADERS = ("content-type",)
"""Of the replica's answer, what the client gets (the rest is the replica's own transport)."""


async def on_holder(
    registry: Registry,
    client: httpx.AsyncClient,
    headers: dict[str, str],
    method: str,
    response_id: str,
    query: str = "",
    timeout: float = 60.0,
    suffix: str = "",
) -> Response:
    """``method`` on the stored response ``response_id`` (its path ``suffix``, with the URL's
    ``query``), answered by the replica holding it within ``timeout`` seconds."""
    tag = tag_of(response_id)
    holder = next((r for r in registry.replicas.values() if tag and r.tag == tag), None)
    if holder is None:
        return _error(
            404,
            f"no replica of this gateway stores response {response_id!r}: a response is kept "
            "on the replica that made it, which is gone or never had it",
            code="response_not_found",
        )
    try:
        url = f"{holder.url}/v1/responses/{response_id}{suffix}" + (f"?{query}" if query else "")
        # the control client's timeout is a /load poll's (1 s): a busy replica's event loop
        # may take longer to answer, and a stored response may be megabytes
        answer = await client.request(method, url, headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        log.warning("stored response %s: %s did not answer: %r", response_id, holder.url, exc)
        return _error(502, f"the replica storing response {response_id!r} did not answer")
    kept = {k: v for k, v in answer.headers.items() if k.lower() in PASSED_HEADERS}
    return Response(answer.content, status_code=answer.status_code, headers=kept)


def _error(status: int, message: str, code: str | None = None) -> Response:
    return Response(
        error_json(status, message, code=code), status_code=status, media_type="application/json"
    )
