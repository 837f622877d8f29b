"""Bearer-token check, in constant time over every configured key."""

from __future__ import annotations

import hmac
import os
from pathlib import Path

API_KEY_ENV = "CONVEYOR_API_KEY"
"""Environment variable with API keys, comma-separated (how a Kubernetes Secret reaches the pod)."""


def backend_headers(backend_api_key: str | None) -> dict[str, str]:
    """What authenticates the gateway to replicas started with --api-key (its polls, model
    lookups and proxied requests); nothing without a key."""
    return {"authorization": f"Bearer {backend_api_key}"} if backend_api_key else {}


def load_api_keys(
    flags: list[str], key_file: str | None, environ: dict[str, str] | None = None
) -> tuple[str, ...]:
    """Keys from --api-key flags, a file (one per line, ``#`` comments) and $CONVEYOR_API_KEY."""
    keys = [k.strip() for k in flags]
    if key_file:
        for line in Path(key_file).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(line)
    env = os.environ if environ is None else environ
    keys += [k.strip() for k in env.get(API_KEY_ENV, "").split(",")]
    return tuple(dict.fromkeys(k for k in keys if k))


class ApiKeyAuth:
    def __init__(self, keys: tuple[str, ...]) -> None:
        self._keys = [key.encode() for key in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def allows(self, authorization: bytes | None) -> bool:
        """True for ``Bearer <a configured key>``; every key is compared, whatever matches."""
        if not self._keys:
            return True
        if not authorization or authorization[:7].lower() != b"bearer ":
            return False
        token = authorization[7:].strip()
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(token, key)
        return ok
