"""The id of a stored response (``POST /v1/responses``), which says which replica holds it.

A replica keeps its responses in memory, so a later request that names one
(``previous_response_id``, ``GET`` or ``DELETE /v1/responses/{id}``) must reach the replica
that made it. The gateway sends each request a replica's tag in ``x-conveyor-replica-tag``
(a hash of the replica's URL as the gateway knows it: every gateway process computes the
same); the replica writes it into the id, ``resp_`` + 8 hex digits of tag + 32 of uuid; the
gateway reads it back and sends the request to that replica. An id without a known tag (a
replica reached directly, or one gone) is routed as any request: the replica that does not
hold it answers 404.
"""

from __future__ import annotations

import hashlib
import re
import uuid

REPLICA_TAG_HEADER = "x-conveyor-replica-tag"
"""Request header: the tag of the replica the gateway sent the request to."""
PREFIX = "resp_"
_TAG = re.compile(r"[0-9a-f]{8}")
_ID = re.compile(r"resp_([0-9a-f]{8})[0-9a-f]{32}")


def replica_tag(url: str) -> str:
    """The 8 hex digits that stand for the replica at ``url`` (the same in every process)."""
    return hashlib.blake2b(url.encode(), digest_size=4).hexdigest()


def new_response_id(tag: str | None) -> str:
    """A fresh response id carrying ``tag`` (a header's value, unchecked: anything that is
    not a tag gives an id with a random one)."""
    if tag is None or not _TAG.fullmatch(tag):
        tag = uuid.uuid4().hex[:8]
    return f"{PREFIX}{tag}{uuid.uuid4().hex}"


def tag_of(response_id: str) -> str | None:
    """The replica tag in an id this contract wrote; None for any other string."""
    match = _ID.fullmatch(response_id)
    return match.group(1) if match else None
