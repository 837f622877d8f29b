"""The operator's Kubernetes boundary: JSON in and out, server-side apply, nothing else.

A thin layer over ``kubernetes_asyncio``'s ``ApiClient`` (credentials, TLS, token refresh);
everything above it sees plain dicts, so the reconcile is tested with a fake of this class.
"""

from __future__ import annotations

import json
import os
from typing import Any

from conveyor.operator.names import FIELD_MANAGER

PLURALS: dict[str, str] = {
    "Deployment": "deployments",
    "Service": "services",
    "ServiceAccount": "serviceaccounts",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "PodMonitor": "podmonitors",
    "LLMService": "llmservices",
    "Lease": "leases",
    "Node": "nodes",
}


class ApiError(RuntimeError):
    """A non-2xx answer from the apiserver; ``status`` and the server's ``message`` come with it."""

    def __init__(self, method: str, path: str, status: int, body: str | bytes) -> None:
        text = body.decode(errors="replace") if isinstance(body, bytes) else body
        try:
            message = json.loads(text).get("message", text)
        except (ValueError, AttributeError):
            message = text
        super().__init__(f"{method} {path}: {status} {message}")
        self.status = status
        self.message = message


def collection_path(api_version: str, kind: str, namespace: str | None) -> str:
    """``/api/v1/namespaces/NS/services``, ``/apis/apps/v1/namespaces/NS/deployments``, ..."""
    root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    ns = f"/namespaces/{namespace}" if namespace else ""
    return f"{root}{ns}/{PLURALS[kind]}"


def object_path(manifest: dict[str, Any]) -> str:
    meta = manifest["metadata"]
    base = collection_path(manifest["apiVersion"], manifest["kind"], meta.get("namespace"))
    return f"{base}/{meta['name']}"


REQUEST_TIMEOUT_S = 30.0
"""Longest wait for one answer from the apiserver (a frozen or partitioned one gives none: without
a bound, a reconcile or a Lease renewal would wait on its socket forever). Generous: the largest
call, a list of a namespace's children, takes milliseconds."""
CONNECT_TIMEOUT_S = 10.0
"""Longest wait for a connection to the apiserver."""


class Kube:
    """JSON calls to one apiserver."""

    def __init__(self, api_client: Any, *, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.api_client = api_client
        self.timeout_s = timeout_s

    @classmethod
    async def connect(cls, kubeconfig: str | None) -> Kube:
        """From ``kubeconfig``, else in-cluster configuration in a pod, else $KUBECONFIG / ~/.kube/config."""
        from kubernetes_asyncio import client, config

        configuration = client.Configuration()
        if kubeconfig:
            await config.load_kube_config(
                config_file=kubeconfig, client_configuration=configuration
            )
        elif os.environ.get("KUBERNETES_SERVICE_HOST"):
            # kubernetes_asyncio leaves this one function unannotated.
            config.load_incluster_config(  # type: ignore[no-untyped-call]
                client_configuration=configuration
            )
        else:
            await config.load_kube_config(client_configuration=configuration)
        return cls(client.ApiClient(configuration))

    @property
    def configuration(self) -> Any:
        return self.api_client.configuration

    async def close(self) -> None:
        await self.api_client.close()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        """One call; the decoded JSON answer, or ``ApiError``; ``TimeoutError`` (an ``OSError``)
        when the apiserver does not answer within ``timeout_s``."""
        import aiohttp
        from kubernetes_asyncio.client.exceptions import ApiException

        # kubernetes_asyncio's own default is no timeout at all (an empty aiohttp.ClientTimeout).
        timeout = aiohttp.ClientTimeout(
            total=self.timeout_s, sock_connect=min(self.timeout_s, CONNECT_TIMEOUT_S)
        )
        try:
            data, _, _ = await self.api_client.call_api(
                path,
                method,
                query_params=query or [],
                header_params={"Content-Type": content_type, "Accept": "application/json"},
                body=body,
                auth_settings=["BearerToken"],
                response_types_map={200: "object", 201: "object"},
                _return_http_data_only=False,
                _request_timeout=timeout,
            )
        except ApiException as exc:
            raise ApiError(method, path, exc.status, exc.body or exc.reason or "") from None
        return data

    async def get(self, path: str) -> dict[str, Any] | None:
        """The object at ``path``, or None when it does not exist."""
        try:
            found: dict[str, Any] = await self.request("GET", path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise
        return found

    async def list(self, path: str, *, label_selector: str | None = None) -> list[dict[str, Any]]:
        query = [("labelSelector", label_selector)] if label_selector else None
        items: list[dict[str, Any]] = (await self.request("GET", path, query=query)).get("items")
        return items or []

    async def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply as the operator's field manager, forcing conflicts (the operator owns
        every field it sets: a hand edit of one of them is drift and is taken back)."""
        applied: dict[str, Any] = await self.request(
            "PATCH",
            object_path(manifest),
            manifest,
            query=[("fieldManager", FIELD_MANAGER), ("force", "true")],
            content_type="application/apply-patch+yaml",
        )
        return applied

    async def merge_patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        patched: dict[str, Any] = await self.request(
            "PATCH", path, patch, content_type="application/merge-patch+json"
        )
        return patched

    async def delete(self, path: str) -> None:
        try:
            await self.request("DELETE", path)
        except ApiError as exc:
            if exc.status != 404:
                raise

    async def has_api(self, group_version: str) -> bool:
        """Whether the apiserver serves ``group/version`` (e.g. monitoring.coreos.com/v1)."""
        return await self.get(f"/apis/{group_version}") is not None
