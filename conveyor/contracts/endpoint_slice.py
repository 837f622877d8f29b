"""Which endpoints of a Kubernetes EndpointSlice may take new requests.

Read from the API's JSON (camelCase dicts) by the gateway's discovery and by the autoscaler.
An endpoint counts when it is ready (``conditions.ready`` unset means ready, the API's
convention) and not terminating (a pod that is shutting down gets no new requests, even where
a Service publishes not-ready addresses and so marks it ready). All addresses of an endpoint
are one pod: the first is used.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReadyEndpoint:
    """One endpoint that may take requests: its base URL and, where known, its pod."""

    url: str
    """``http://ADDRESS:PORT`` (an IPv6 address in brackets)."""
    pod: str | None
    """The pod's name (``targetRef.name``); None where the slice does not say."""


def ready_endpoints(slice_: Mapping[str, Any], port_name: str | None) -> list[ReadyEndpoint]:
    """The endpoints of one EndpointSlice that may take new requests, at the port named
    ``port_name`` (None: the slice's first port); none when the slice has no such port."""
    ports = [
        p for p in slice_.get("ports") or [] if port_name is None or p.get("name") == port_name
    ]
    if not ports or ports[0].get("port") is None:
        return []
    port = int(ports[0]["port"])
    found: list[ReadyEndpoint] = []
    for endpoint in slice_.get("endpoints") or []:
        conditions = endpoint.get("conditions") or {}
        if conditions.get("ready") is False or conditions.get("terminating") is True:
            continue
        addresses = endpoint.get("addresses") or []
        if not addresses:
            continue
        host = f"[{addresses[0]}]" if ":" in addresses[0] else addresses[0]
        pod = (endpoint.get("targetRef") or {}).get("name")
        found.append(ReadyEndpoint(url=f"http://{host}:{port}", pod=pod))
    return found
