"""kopf handlers: thin, each calls the :class:`Reconciler` and turns its outcome into kopf's
vocabulary (``TemporaryError`` for what will heal, ``PermanentError`` for a spec that cannot
run, after the Degraded condition is written).

Registered on a registry passed in (no module-level kopf registry). Triggers of a reconcile:
the LLMService created, changed or found at start (resume); one of its children changed or
deleted by someone else (watches of Deployments, Services and PDBs the operator manages); and
a resync timer per LLMService. The autoscaler's timer (``autoscaler_timer.py``) runs per
LLMService every ``--autoscale-interval`` and acts only while spec.autoscaling.enabled is set.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import Any

import kopf

from conveyor.operator.autoscaler_timer import AutoscalerTimer
from conveyor.operator.kube import ApiError
from conveyor.operator.names import (
    APP,
    APP_LABEL,
    GATEWAY_NAME,
    GROUP,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    PLURAL,
    VERSION,
)
from conveyor.operator.reconciler import Reconciler
from conveyor.operator.settings import OperatorSettings

log = logging.getLogger("conveyor.operator")

RETRY_DELAY_S = 10.0
"""Seconds before kopf retries a reconcile that failed on the API (a conflict, the apiserver away)."""

CHILD_KINDS = (
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("policy", "v1", "poddisruptionbudgets"),
)
"""Children watched for drift; the gateway's ServiceAccount and RBAC are repaired by the resync."""


def register(
    registry: kopf.OperatorRegistry,
    *,
    reconciler: Reconciler,
    settings: OperatorSettings,
    autoscaler: AutoscalerTimer | None = None,
) -> None:
    resource = (GROUP, VERSION, PLURAL)

    async def reconcile_or_raise(namespace: str, name: str) -> None:
        try:
            problem = await reconciler.reconcile(namespace, name)
        except ApiError as exc:
            raise kopf.TemporaryError(str(exc), delay=RETRY_DELAY_S) from exc
        if problem is not None:
            raise kopf.PermanentError(f"{problem.reason}: {problem.message}")

    @kopf.on.resume(*resource, registry=registry, id="reconcile")
    @kopf.on.create(*resource, registry=registry, id="reconcile")
    @kopf.on.update(*resource, registry=registry, field="spec", id="reconcile")
    async def llmservice_changed(namespace: str | None, name: str, **_: Any) -> None:
        await reconcile_or_raise(_namespaced(namespace), name)

    @kopf.on.delete(*resource, registry=registry, optional=True, id="deleted")
    async def llmservice_deleted(namespace: str | None, name: str, **_: Any) -> None:
        namespace = _namespaced(namespace)
        # Children go with their owner (garbage collector); the gateway loses this owner.
        reconciler.forget(namespace, name)
        if autoscaler is not None:
            autoscaler.forget(namespace, name)
        try:
            await reconciler.reconcile_gateway(namespace)
        except ApiError as exc:
            log.warning(
                "%s: gateway owners not updated after %s was deleted: %s", namespace, name, exc
            )

    @kopf.timer(
        *resource,
        registry=registry,
        id="resync",
        interval=settings.resync_interval_s,
        initial_delay=settings.resync_interval_s,
    )
    async def resync(namespace: str | None, name: str, **_: Any) -> None:
        namespace = _namespaced(namespace)
        await _timer_run(
            reconciler.reconcile(namespace, name),
            f"{namespace}/{name}: resync",
            settings.resync_interval_s,
        )

    if autoscaler is not None:

        @kopf.timer(
            *resource,
            registry=registry,
            id="autoscale",
            interval=settings.autoscale_interval_s,
            initial_delay=settings.autoscale_interval_s,
        )
        async def autoscale(namespace: str | None, name: str, spec: Any, **_: Any) -> None:
            namespace = _namespaced(namespace)
            if not (spec.get("autoscaling") or {}).get("enabled"):
                autoscaler.forget(namespace, name)  # turned off: the user owns spec.replicas
                return
            await _timer_run(
                autoscaler.tick(namespace, name),
                f"{namespace}/{name}: autoscaler tick",
                settings.autoscale_interval_s,
            )

    managed = {APP_LABEL: APP, MANAGED_BY_LABEL: MANAGED_BY}
    for group, version, plural in CHILD_KINDS:

        @kopf.on.event(
            group, version, plural, registry=registry, labels=managed, id=f"child-{plural}"
        )
        async def child_event(event: kopf.RawEvent, namespace: str | None, **_: Any) -> None:
            namespace = _namespaced(namespace)
            child: dict[str, Any] = dict(event["object"])
            kind = event["type"]
            if kind is None:
                return  # the initial listing: the resume handlers reconcile every owner anyway
            owners = reconciler.owners_of(child)
            if child["metadata"]["name"] == GATEWAY_NAME:
                if reconciler.drifted(kind, child):
                    await _safely(reconciler.reconcile_gateway(namespace), namespace, GATEWAY_NAME)
                return
            name = reconciler.runtime_owner(child)
            if name is None or name not in owners:
                return
            if reconciler.drifted(kind, child):
                await _safely(reconciler.reconcile(namespace, name), namespace, name)
            elif child.get("kind") == "Deployment":
                await _safely(reconciler.refresh_status(namespace, name, child), namespace, name)


def _namespaced(namespace: str | None) -> str:
    """The namespace kopf passes a handler: LLMServices and their children are namespaced, so
    there always is one (None is for cluster-scoped objects)."""
    assert namespace is not None, "a namespaced object came without its namespace"
    return namespace


async def _timer_run(coro: Awaitable[object], what: str, interval_s: float) -> None:
    """One run of a timer: an API error is logged, and the next run ``interval_s`` later
    tries again."""
    try:
        await coro
    except ApiError as exc:
        log.warning("%s failed (%s); next in %.0f s", what, exc, interval_s)


async def _safely(coro: Awaitable[object], namespace: str, name: str) -> None:
    """A reconcile triggered by a child's event: failures are retried by the resync timer."""
    try:
        await coro
    except ApiError as exc:
        log.warning("%s/%s: reconcile after a child's event failed: %s", namespace, name, exc)
