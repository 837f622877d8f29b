"""``kubectl logs`` and ``kubectl port-forward`` through kwok's kubelet server.

kwok serves the kubelet API of the simulated nodes; it reads a pod's logs from files and
forwards a pod's ports to an address when ``Logs`` and ``PortForward`` objects
(``kwok.x-k8s.io/v1alpha1``) name them. kwok watches those objects when started with
``--enable-crds=Logs,PortForward``; the cluster installs the two CustomResourceDefinitions
(``crds()``, schemas of our own that keep every field) before kwok starts. The agent writes
each container's output in the CRI log format kwok reads, and publishes one ``Logs`` and
one ``PortForward`` object per pod, named as the pod, removed with it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import httpx

from conveyor.cluster.agent_api import AsyncApi
from conveyor.cluster.api import ApiClient, ApiError, wait_for

if TYPE_CHECKING:
    from conveyor.cluster.pod_worker import PodWorker

GROUP = "kwok.x-k8s.io"
VERSION = "v1alpha1"
KWOK_CRDS = ("Logs", "PortForward")
"""The kwok kinds the cluster enables (``--enable-crds``)."""


def crd(kind: str, plural: str) -> dict[str, Any]:
    """A namespaced CustomResourceDefinition of kwok's group that keeps whatever it is given."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind,
                "plural": plural,
                "singular": kind.lower(),
                "listKind": f"{kind}List",
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "x-kubernetes-preserve-unknown-fields": True,
                        }
                    },
                }
            ],
        },
    }


def crds() -> list[dict[str, Any]]:
    """The CustomResourceDefinitions kwok needs for ``--enable-crds=Logs,PortForward``."""
    return [crd("Logs", "logs"), crd("PortForward", "portforwards")]


def logs_object(worker: PodWorker) -> dict[str, Any]:
    """The ``Logs`` object of a pod: each container's current and previous log file."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Logs",
        "metadata": {
            "name": worker.name,
            "namespace": worker.namespace,
            "labels": {"conveyor.dev/pod-uid": worker.uid},
        },
        "spec": {
            "logs": [
                {
                    "containers": [r.name],
                    "logsFile": str(worker.logs_dir(r.name) / "current.log"),
                    "previousLogsFile": str(worker.logs_dir(r.name) / "previous.log"),
                    "follow": True,
                }
                for r in worker.runners
            ]
        },
    }


def port_forward_object(worker: PodWorker) -> dict[str, Any]:
    """The ``PortForward`` object of a pod: every port to the same port at the pod's address."""
    ports = sorted(
        {
            int(p["containerPort"])
            for c in worker.pod["spec"]["containers"]
            for p in c.get("ports") or []
        }
    )
    forwards = [{"ports": [p], "target": {"port": p, "address": worker.pod_ip}} for p in ports]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "PortForward",
        "metadata": {
            "name": worker.name,
            "namespace": worker.namespace,
            "labels": {"conveyor.dev/pod-uid": worker.uid},
        },
        "spec": {"forwards": forwards},
    }


class KwokLogs:
    """Publishes pods' ``Logs``/``PortForward`` objects when the cluster's kwok reads them."""

    def __init__(self, api: AsyncApi, log: logging.Logger) -> None:
        self.api = api
        self.log = log
        self.available = False

    async def start(self) -> None:
        try:
            await self.api.get(f"/apis/{GROUP}/{VERSION}")
            self.available = True
        except ApiError as exc:
            if exc.status != 404:
                raise
            self.log.warning(
                "kwok's Logs/PortForward kinds are not installed: `kubectl logs` cannot reach pod logs "
                "(use `conveyor cluster logs POD`)"
            )

    async def publish(self, worker: PodWorker) -> None:
        if not self.available:
            return
        for plural, obj in (
            ("logs", logs_object(worker)),
            ("portforwards", port_forward_object(worker)),
        ):
            path = f"/apis/{GROUP}/{VERSION}/namespaces/{worker.namespace}/{plural}"
            try:
                await self.api.request("POST", path, obj)
            except ApiError as exc:
                if exc.status != 409:
                    raise
                await self.api.request(
                    "PUT",
                    f"{path}/{worker.name}",
                    obj | {"metadata": obj["metadata"] | await self._rv(f"{path}/{worker.name}")},
                )

    async def _rv(self, path: str) -> dict[str, str]:
        current = await self.api.get(path)
        return {"resourceVersion": current["metadata"]["resourceVersion"]}

    async def withdraw(self, worker: PodWorker) -> None:
        if not self.available:
            return
        for plural in ("logs", "portforwards"):
            path = f"/apis/{GROUP}/{VERSION}/namespaces/{worker.namespace}/{plural}/{worker.name}"
            try:
                current = await self.api.get(path)
                if (current["metadata"].get("labels") or {}).get(
                    "conveyor.dev/pod-uid"
                ) == worker.uid:
                    await self.api.request("DELETE", path)
            except ApiError as exc:
                if exc.status != 404:
                    self.log.warning("%s: removing %s failed: %s", worker.key, plural, exc)
            except httpx.HTTPError as exc:
                self.log.warning("%s: removing %s failed: %s", worker.key, plural, exc)


def install_crds(api: ApiClient, timeout_s: float = 60.0) -> None:
    """Create kwok's ``Logs`` and ``PortForward`` kinds and wait until the apiserver serves them."""
    for obj in crds():
        try:
            api.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", obj)
        except ApiError as exc:
            if exc.status != 409:
                raise

    def established() -> bool:
        for obj in crds():
            got = api.get(
                f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{obj['metadata']['name']}"
            )
            conditions = (got.get("status") or {}).get("conditions") or []
            if not any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
                return False
        return True

    wait_for("kwok's Logs and PortForward kinds", established, timeout_s=timeout_s, interval_s=0.1)
