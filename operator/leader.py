"""Leader election on a ``coordination.k8s.io`` Lease, so that one of several replicas acts.

kopf's peering freezes replicas of equal priority instead of electing one, so the operator
holds a Lease the way client-go's leader election does: the holder renews it every
``lease_renew_interval_s``; a standby takes it once it has seen no renewal for
``lease_duration_s`` (measured on its own clock, so clock skew between machines does not
matter), or at once when the holder released it on a clean stop. Writes use the Lease's
resourceVersion, so two standbys can never both win.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from conveyor.operator.kube import ApiError, Kube

log = logging.getLogger("conveyor.operator")


def now_micro() -> str:
    """A Lease's MicroTime: RFC 3339 with exactly six fractional digits."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_path(namespace: str, name: str | None = None) -> str:
    base = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
    return f"{base}/{name}" if name else base


@dataclass
class Observation:
    """The Lease record as last seen, and when (local monotonic clock) it last changed."""

    record: tuple[str, str]
    since: float


def may_take(
    spec: dict[str, Any], identity: str, observed: Observation | None, now: float, duration_s: float
) -> bool:
    """Whether ``identity`` may write itself into a Lease whose spec is ``spec``."""
    holder = spec.get("holderIdentity") or ""
    if not holder or holder == identity:
        return True
    return observed is not None and now - observed.since >= duration_s


class LeaderElector:
    def __init__(
        self,
        *,
        kube: Kube,
        namespace: str,
        name: str,
        identity: str,
        duration_s: float,
        renew_interval_s: float,
        retry_interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.duration_s = duration_s
        self.renew_interval_s = renew_interval_s
        self.retry_interval_s = retry_interval_s
        self.clock = clock
        self._observed: Observation | None = None

    def _observe(self, spec: dict[str, Any]) -> None:
        record = (spec.get("holderIdentity") or "", spec.get("renewTime") or "")
        if self._observed is None or self._observed.record != record:
            self._observed = Observation(record, self.clock())

    async def try_acquire(self) -> bool:
        """One attempt to take or renew the Lease; True when this replica holds it after."""
        now = now_micro()
        lease = await self.kube.get(lease_path(self.namespace, self.name))
        if lease is None:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": self._spec(acquire_time=now, renew_time=now, transitions=0),
            }
            try:
                await self.kube.request("POST", lease_path(self.namespace), body)
            except ApiError as exc:
                if exc.status == 409:
                    return False  # another replica created it first
                raise
            return True
        spec = lease.get("spec") or {}
        self._observe(spec)
        if not may_take(spec, self.identity, self._observed, self.clock(), self.duration_s):
            return False
        holder = spec.get("holderIdentity") or ""
        transitions = int(spec.get("leaseTransitions") or 0) + (holder != self.identity)
        acquired = spec.get("acquireTime") if holder == self.identity else now
        lease["spec"] = self._spec(
            acquire_time=acquired or now, renew_time=now, transitions=transitions
        )
        try:
            await self.kube.request("PUT", lease_path(self.namespace, self.name), lease)
        except ApiError as exc:
            if exc.status == 409:
                return False  # someone else wrote it since we read it
            raise
        return True

    def _spec(self, *, acquire_time: str, renew_time: str, transitions: int) -> dict[str, Any]:
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": max(1, round(self.duration_s)),
            "acquireTime": acquire_time,
            "renewTime": renew_time,
            "leaseTransitions": transitions,
        }

    async def acquire(self) -> None:
        """Return once this replica holds the Lease."""
        while True:
            try:
                if await self.try_acquire():
                    log.info(
                        "leader: %s holds Lease %s/%s", self.identity, self.namespace, self.name
                    )
                    return
            except (ApiError, OSError) as exc:
                log.warning("leader election: %s", exc)
            await asyncio.sleep(self.retry_interval_s)

    async def hold(self) -> None:
        """Renew the Lease until a renewal has failed for longer than the renew deadline; then return
        (leadership is lost and this replica must stop acting)."""
        deadline_s = self.duration_s * 2 / 3
        last_renewed = self.clock()
        while True:
            await asyncio.sleep(self.renew_interval_s)
            # A renewal that hangs (a frozen or partitioned apiserver) counts as failed once the
            # renew deadline has passed: a standby may take the Lease then, so this replica
            # must have stopped acting by that time, not whenever the call returns.
            left_s = max(deadline_s - (self.clock() - last_renewed), self.retry_interval_s)
            try:
                async with asyncio.timeout(left_s):
                    renewed = await self.try_acquire()
                if renewed:
                    last_renewed = self.clock()
                    continue
                log.error(
                    "leader: Lease %s/%s was taken by another replica", self.namespace, self.name
                )
                return
            except TimeoutError:
                log.warning("leader: renewal got no answer in %.1f s", left_s)
            except (ApiError, OSError) as exc:
                log.warning("leader: renewal failed: %s", exc)
            if self.clock() - last_renewed >= deadline_s:
                log.error("leader: could not renew for %.0f s; stepping down", deadline_s)
                return

    async def release(self) -> None:
        """Give the Lease up on a clean stop, so that a standby takes over at once."""
        lease = await self.kube.get(lease_path(self.namespace, self.name))
        if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
            return
        lease["spec"]["holderIdentity"] = ""
        lease["spec"]["leaseDurationSeconds"] = 1
        try:
            await self.kube.request("PUT", lease_path(self.namespace, self.name), lease)
        except ApiError as exc:
            log.warning("leader: could not release the Lease: %s", exc)
