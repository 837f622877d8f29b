"""The reconcile of one LLMService and of its namespace's gateway, independent of kopf.

The kopf handlers (``handlers.py``) only call into :class:`Reconciler`: it fetches the object
fresh, calls the pure builders, applies the manifests (server-side apply: idempotent, creates
what is missing, takes back hand edits of the fields it owns), posts an Event for each action,
and patches status. One lock per LLMService (and one per namespace gateway) serialises the
handlers, the child watches and the resync timer; a lock is dropped when its object goes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from conveyor.operator.engines import engine_problems
from conveyor.operator.gateway_manifests import gateway_children, gateway_url
from conveyor.operator.kube import ApiError, Kube, collection_path, object_path
from conveyor.operator.metrics import OperatorMetrics
from conveyor.operator.names import API_VERSION, GATEWAY_NAME, KIND, LLMSERVICE_LABEL
from conveyor.operator.placement import gpu_problem
from conveyor.operator.runtime_manifests import runtime_children, served_name
from conveyor.operator.settings import OperatorSettings
from conveyor.operator.status import Problem, llmservice_status, status_changed

log = logging.getLogger("conveyor.operator")

PostEvent = Callable[[dict[str, Any], str, str, str], None]
"""(involved object, type Normal|Warning, reason, message): posts a Kubernetes Event."""

PODMONITOR_API = "monitoring.coreos.com/v1"
PODMONITOR_RECHECK_S = 60.0
"""Seconds between checks whether the Prometheus Operator's API exists (it may be installed later)."""


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def fingerprint(obj: dict[str, Any]) -> str:
    """What changes when someone changes an object's spec: its generation where it has one
    (status updates do not bump it), else its resourceVersion."""
    meta = obj.get("metadata") or {}
    if obj.get("kind") in ("Deployment", "PodDisruptionBudget") and "generation" in meta:
        return f"g{meta['generation']}"
    return f"r{meta.get('resourceVersion', '')}"


def llmservice_path(namespace: str, name: str) -> str:
    return f"{collection_path(API_VERSION, KIND, namespace)}/{name}"


class Reconciler:
    def __init__(
        self,
        *,
        kube: Kube,
        settings: OperatorSettings,
        metrics: OperatorMetrics,
        post_event: PostEvent,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube = kube
        self.settings = settings
        self.metrics = metrics
        self.post_event = post_event
        self.clock = clock
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._applied: dict[str, str] = {}
        """Child path -> fingerprint after the operator's last apply (drift = anything else)."""
        self._problems: dict[tuple[str, str], Problem | None] = {}
        self._podmonitor: tuple[float, bool] | None = None

    # ---- locks --------------------------------------------------------------------------

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        """The lock of one LLMService (``name``) or of a namespace's gateway (``name`` empty)."""
        return self._locks.setdefault((namespace, name), asyncio.Lock())

    def forget(self, namespace: str, name: str) -> None:
        """Drop what is kept for a deleted LLMService (its lock, its last problem)."""
        lock = self._locks.get((namespace, name))
        if lock is not None and not lock.locked():
            del self._locks[(namespace, name)]
        self._problems.pop((namespace, name), None)
        self.metrics.llmservices.set(len(self._problems))

    # ---- the reconcile ------------------------------------------------------------------

    async def reconcile(self, namespace: str, name: str) -> Problem | None:
        """Bring one LLMService's children and status in line with its spec; the Problem that
        keeps it from running, if any. Raises ApiError on what may heal (the caller retries)."""
        started = self.clock()
        try:
            async with self.lock(namespace, name):
                problem = await self._reconcile(namespace, name)
            if (namespace, name) not in self._problems:
                self.forget(namespace, name)  # it was gone: drop its lock, now released
        except Exception:
            self.metrics.reconcile_total.labels("error").inc()
            raise
        self.metrics.reconcile_total.labels("degraded" if problem else "success").inc()
        self.metrics.reconcile_seconds.observe(self.clock() - started)
        return problem

    async def _reconcile(self, namespace: str, name: str) -> Problem | None:
        llmservice = await self.kube.get(llmservice_path(namespace, name))
        if llmservice is None or llmservice["metadata"].get("deletionTimestamp"):
            await self.reconcile_gateway(namespace)
            self.forget(namespace, name)
            return None
        spec = llmservice["spec"]
        problem = None
        if unsupported := engine_problems(spec):  # the CRD's rules refuse these already
            problem = Problem("EngineSettingUnsupported", "; ".join(unsupported))
        elif int((spec.get("resources") or {}).get("gpus", 0)) > 0:
            problem = gpu_problem(spec, await self.kube.list("/api/v1/nodes"))
        self._problems[(namespace, name)] = problem
        self.metrics.llmservices.set(len(self._problems))
        deployment = None
        if problem is None:
            podmonitor = await self._podmonitor_api()
            for child in runtime_children(llmservice, self.settings, podmonitor=podmonitor):
                applied = await self._apply(llmservice, child)
                if child["kind"] == "Deployment":
                    deployment = applied
        else:
            # Nothing new is rolled out; replicas of an earlier spec that runs keep serving.
            deployment = await self.kube.get(
                f"{collection_path('apps/v1', 'Deployment', namespace)}/{name}"
            )
            previous = (llmservice.get("status") or {}).get("conditions") or []
            if not any(
                c.get("type") == "Degraded" and c.get("message") == problem.message
                for c in previous
            ):
                self.post_event(llmservice, "Warning", problem.reason, problem.message)
        gateway_service = await self.reconcile_gateway(namespace)
        endpoint = None
        if gateway_service is not None:
            endpoint = {
                "url": gateway_url(namespace),
                "clusterIP": (gateway_service.get("spec") or {}).get("clusterIP", ""),
                "service": f"{namespace}/{GATEWAY_NAME}",
                "model": served_name(llmservice),
            }
        await self._patch_status(llmservice, deployment, problem=problem, endpoint=endpoint)
        return problem

    async def reconcile_gateway(self, namespace: str) -> dict[str, Any] | None:
        """The namespace's gateway, owned by every LLMService that is not being deleted; its
        Service as applied (None when no LLMService is left: the garbage collector removes it)."""
        async with self.lock(namespace, ""):
            items = await self.kube.list(collection_path(API_VERSION, KIND, namespace))
            owners = [o for o in items if not o["metadata"].get("deletionTimestamp")]
            if not owners:
                return None
            service = None
            for child in gateway_children(namespace, owners, self.settings):
                applied = await self._apply(owners[0], child, quiet_updates=True)
                if child["kind"] == "Service":
                    service = applied
            return service

    async def _apply(
        self, owner: dict[str, Any], child: dict[str, Any], *, quiet_updates: bool = False
    ) -> dict[str, Any]:
        path = object_path(child)
        existed = await self.kube.get(path)
        applied = await self.kube.apply(child)
        before = self._applied.get(path)
        self._applied[path] = fingerprint(applied)
        what = f"{child['kind']} {child['metadata']['name']}"
        if existed is None:
            log.info(
                "%s/%s: created %s", owner["metadata"]["namespace"], owner["metadata"]["name"], what
            )
            self.post_event(owner, "Normal", "Created", f"created {what}")
        elif fingerprint(existed) != fingerprint(applied) and not quiet_updates:
            why = (
                "drift repaired"
                if before == fingerprint(existed) or before is None
                else "spec changed"
            )
            if before is not None and before != fingerprint(existed):
                why = "hand edit taken back"
            log.info(
                "%s/%s: updated %s (%s)",
                owner["metadata"]["namespace"],
                owner["metadata"]["name"],
                what,
                why,
            )
            self.post_event(owner, "Normal", "Updated", f"updated {what} ({why})")
        return applied

    async def _podmonitor_api(self) -> bool:
        now = self.clock()
        if self._podmonitor is None or now - self._podmonitor[0] > PODMONITOR_RECHECK_S:
            self._podmonitor = (now, await self.kube.has_api(PODMONITOR_API))
        return self._podmonitor[1]

    # ---- status -------------------------------------------------------------------------

    async def _patch_status(
        self,
        llmservice: dict[str, Any],
        deployment: dict[str, Any] | None,
        *,
        problem: Problem | None,
        endpoint: dict[str, Any] | None,
    ) -> None:
        old = llmservice.get("status") or {}
        new = llmservice_status(
            llmservice, deployment, problem=problem, endpoint=endpoint, now=now_rfc3339()
        )
        if not status_changed(old, new):
            return
        meta = llmservice["metadata"]
        path = f"{llmservice_path(meta['namespace'], meta['name'])}/status"
        await self.kube.merge_patch(path, {"status": new})
        if old.get("phase") != new["phase"]:
            kind = "Warning" if new["phase"] == "Degraded" else "Normal"
            self.post_event(
                llmservice, kind, new["phase"], f"phase {old.get('phase', '-')} -> {new['phase']}"
            )

    async def refresh_status(self, namespace: str, name: str, deployment: dict[str, Any]) -> None:
        """Status from a runtime Deployment's event (replicas becoming ready), without re-applying."""
        async with self.lock(namespace, name):
            llmservice = await self.kube.get(llmservice_path(namespace, name))
            if llmservice is None or llmservice["metadata"].get("deletionTimestamp"):
                return
            status = llmservice.get("status") or {}
            if status.get("observedGeneration") != llmservice["metadata"].get("generation"):
                return  # the reconcile of the new generation writes status when it is done
            await self._patch_status(
                llmservice,
                deployment,
                problem=self._problems.get((namespace, name)),
                endpoint=status.get("endpoint"),
            )

    # ---- child events -------------------------------------------------------------------

    def drifted(self, event_type: str, child: dict[str, Any]) -> bool:
        """Whether a child's event means someone else changed or deleted it."""
        if event_type == "DELETED":
            return True
        known = self._applied.get(object_path(child))
        return known is not None and known != fingerprint(child)

    @staticmethod
    def owners_of(child: dict[str, Any]) -> list[str]:
        """Names of the LLMServices a child belongs to (from its owner references)."""
        refs = (child.get("metadata") or {}).get("ownerReferences") or []
        return [
            r["name"] for r in refs if r.get("kind") == KIND and r.get("apiVersion") == API_VERSION
        ]

    @staticmethod
    def runtime_owner(child: dict[str, Any]) -> str | None:
        return ((child.get("metadata") or {}).get("labels") or {}).get(LLMSERVICE_LABEL)


__all__ = ["ApiError", "Reconciler", "fingerprint"]
