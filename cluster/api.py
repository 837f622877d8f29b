"""A small synchronous Kubernetes API client (stdlib only) and the kubeconfig files.

The cluster needs a handful of calls (readiness, nodes, status patches in tests); the
operator and gateway use ``kubernetes_asyncio``. Credentials: a client certificate or a
bearer token, from a kubeconfig written by ``kubeconfig``.
"""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import yaml


class ApiError(RuntimeError):
    """A response other than 2xx; ``status`` and the decoded ``body`` come with it."""

    def __init__(self, method: str, path: str, status: int, body: Any) -> None:
        message = body.get("message") if isinstance(body, dict) else body
        super().__init__(f"{method} {path}: {status} {message}")
        self.status = status
        self.body = body


@dataclass(frozen=True)
class Credentials:
    """Where the server is and how to log in to it."""

    server: str
    ca_file: Path | None
    cert_file: Path | None = None
    key_file: Path | None = None
    token: str | None = None


def kubeconfig(
    *,
    server: str,
    ca: Path | None,
    user: str,
    cert: Path | None = None,
    key: Path | None = None,
    token: str | None = None,
    context: str = "conveyor",
) -> dict:
    """A kubeconfig with one cluster, user and context (file paths, so the certificates can be rotated)."""
    user_entry: dict[str, str] = {}
    if cert and key:
        user_entry = {"client-certificate": str(cert), "client-key": str(key)}
    if token:
        user_entry["token"] = token
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": context, "cluster": {"server": server, "certificate-authority": str(ca)}}
        ],
        "users": [{"name": user, "user": user_entry}],
        "contexts": [{"name": context, "context": {"cluster": context, "user": user}}],
        "current-context": context,
    }


def write_kubeconfig(path: Path, config: dict) -> None:
    """Write a kubeconfig readable only by its owner."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def credentials_from_kubeconfig(path: Path) -> Credentials:
    """The current context's server and credentials (file paths or inline base64 data)."""
    config = yaml.safe_load(path.read_text())
    ctx_name = config["current-context"]
    ctx = next(c["context"] for c in config["contexts"] if c["name"] == ctx_name)
    cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == ctx["cluster"])
    user = next(u["user"] for u in config.get("users", []) if u["name"] == ctx["user"])
    base = path.parent

    def file_or_data(entry: dict, key: str) -> Path | None:
        if entry.get(key):
            p = Path(entry[key])
            return p if p.is_absolute() else base / p
        if entry.get(f"{key}-data"):
            with tempfile.NamedTemporaryFile(prefix="conveyor-kube-", delete=False) as tmp:
                tmp.write(base64.b64decode(entry[f"{key}-data"]))
            return Path(tmp.name)
        return None

    return Credentials(
        server=cluster["server"],
        ca_file=file_or_data(cluster, "certificate-authority"),
        cert_file=file_or_data(user, "client-certificate"),
        key_file=file_or_data(user, "client-key"),
        token=user.get("token"),
    )


def wait_for(
    what: str,
    check: Callable[[], Any],
    *,
    timeout_s: float,
    interval_s: float = 0.2,
    guard: Callable[[], None] = lambda: None,
    context: Callable[[], str] = lambda: "",
) -> Any:
    """Poll ``check`` until it returns something truthy and return that.

    API and connection errors count as "not yet". ``guard`` runs before each try and may
    raise (a process that died); ``context`` adds to the ``TimeoutError`` (a log tail).
    """
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while True:
        guard()
        try:
            last = check()
        except (ApiError, OSError) as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"timed out after {timeout_s:.0f} s waiting for {what} (last: {last!r}){context()}"
            )
        time.sleep(interval_s)


class ApiClient:
    """JSON over HTTPS to one apiserver; a connection per call (these calls are few)."""

    def __init__(self, credentials: Credentials, *, timeout_s: float = 30.0) -> None:
        self.credentials = credentials
        self.timeout_s = timeout_s
        url = urlsplit(credentials.server)
        self._host = url.hostname or "localhost"
        self._port = url.port or 443
        self._ssl = ssl.create_default_context(
            cafile=str(credentials.ca_file) if credentials.ca_file else None
        )
        if credentials.cert_file and credentials.key_file:
            self._ssl.load_cert_chain(str(credentials.cert_file), str(credentials.key_file))

    @classmethod
    def from_kubeconfig(cls, path: Path, **kwargs: Any) -> ApiClient:
        """A client for the current context of a kubeconfig file."""
        return cls(credentials_from_kubeconfig(path), **kwargs)

    def with_token(self, token: str) -> ApiClient:
        """The same server, logged in with a bearer token instead (for RBAC checks)."""
        c = self.credentials
        return ApiClient(Credentials(c.server, c.ca_file, token=token), timeout_s=self.timeout_s)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: dict[str, str] | None = None,
        content_type: str = "application/json",
        raw: bool = False,
    ) -> Any:
        """One call; returns the decoded JSON (or text when ``raw``), raises ``ApiError`` on non-2xx."""
        if query:
            path = f"{path}?{urlencode(query)}"
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = content_type
        if self.credentials.token:
            headers["Authorization"] = f"Bearer {self.credentials.token}"
        conn = http.client.HTTPSConnection(
            self._host, self._port, context=self._ssl, timeout=self.timeout_s
        )
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            text = resp.read().decode(errors="replace")
        finally:
            conn.close()
        decoded: Any = text
        if not raw or resp.status >= 300:
            try:
                decoded = json.loads(text) if text else None
            except json.JSONDecodeError:
                decoded = text
        if resp.status >= 300:
            raise ApiError(method, path, resp.status, decoded)
        return decoded

    def get(self, path: str, **query: str) -> Any:
        return self.request("GET", path, query=query or None)

    def create(self, path: str, body: dict) -> Any:
        return self.request("POST", path, body)

    def delete(self, path: str) -> Any:
        return self.request("DELETE", path)

    def merge_patch(self, path: str, body: dict) -> Any:
        return self.request("PATCH", path, body, content_type="application/merge-patch+json")

    def readyz(self) -> tuple[bool, str]:
        """``/readyz``: (ready, the server's words or the connection error)."""
        try:
            return True, self.request("GET", "/readyz", raw=True)
        except ApiError as exc:
            return False, str(exc.body)
        except OSError as exc:
            return False, str(exc)

    def wait_for(
        self, what: str, check: Callable[[], Any], *, timeout_s: float, interval_s: float = 0.2
    ) -> Any:
        """Poll ``check`` until it returns something truthy (see ``wait_for``)."""
        return wait_for(what, check, timeout_s=timeout_s, interval_s=interval_s)
