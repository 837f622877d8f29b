"""The node agent: what a kubelet does, for every simulated node of the cluster, with processes.

``python -m conveyor.cluster.agent WORK_DIR`` (the cluster starts it last). It lists
and watches the pods bound to the simulated nodes (those kwok manages) and gives each a
``PodWorker``. Only one agent runs per cluster (a lock in its directory). Killed, it leaves
the pods running; started again, it adopts them from their directories (never a second
copy), finishes the deletion of pods deleted meanwhile and cleans up after them. SIGTERM
stops every pod (short grace) and removes everything, then exits: the cluster's stop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import logging
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from conveyor.cluster.agent_api import AsyncApi
from conveyor.cluster.agent_process import SKIP_ANNOTATION
from conveyor.cluster.agent_settings import AgentSettings
from conveyor.cluster.api import ApiError, credentials_from_kubeconfig
from conveyor.cluster.kwok_logs import KwokLogs
from conveyor.cluster.nodes import KWOK_ANNOTATION
from conveyor.cluster.pod_worker import AgentContext, PodWorker, cleanup_pod_dir
from conveyor.cluster.podcgroups import sweep_pod_cgroups
from conveyor.cluster.podnet import PodNetworks
from conveyor.cluster.state import read_state

LOCK_FILE = "agent.lock"
READY_FILE = "ready"
"""Holds the agent's pid once it has listed the pods and adopted its own (the cluster waits for it)."""


class AgentAlreadyRunning(RuntimeError):
    """Another node agent holds this cluster's lock (never two agents, never two copies of a pod)."""


class Agent:
    """Watches the pods of the simulated nodes and runs them. ``await agent.run(stop)``."""

    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.log = logging.getLogger("conveyor.cluster.agent")
        self.workers: dict[str, PodWorker] = {}
        self.nodes: set[str] = set()
        self._lock_file: Any = None
        self._background: set[asyncio.Task[None]] = set()

    def _lock(self) -> None:
        agent_dir = self.settings.agent_dir()
        agent_dir.mkdir(parents=True, exist_ok=True)
        self._lock_file = (agent_dir / LOCK_FILE).open("a+")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            self._lock_file.close()
            raise AgentAlreadyRunning(
                f"another node agent runs for {self.settings.work_dir}"
            ) from exc
        self._lock_file.seek(0)
        self._lock_file.truncate()
        self._lock_file.write(str(os.getpid()))
        self._lock_file.flush()
        (agent_dir / READY_FILE).unlink(missing_ok=True)

    async def run(self, stop: asyncio.Event) -> None:
        """Run pods until ``stop`` is set; then stop them all and remove what they left."""
        self._lock()
        state = read_state(self.settings.work_dir)
        if state is None:
            raise RuntimeError(f"no cluster state in {self.settings.work_dir}")
        plan = state.plan()
        if state.tools_dir and "prometheus" not in self.settings.images:
            # The cluster's built tools include Prometheus: its image runs that binary.
            images = {**self.settings.images, "prometheus": (state.tools_dir,)}
            self.settings = replace(self.settings, images=images)
        creds = credentials_from_kubeconfig(self.settings.work_dir / "kubeconfig")
        api = AsyncApi(creds)
        port = int(creds.server.rsplit(":", 1)[1])
        ctx = AgentContext(
            settings=self.settings,
            api=api,
            networks=PodNetworks(plan),
            network_lock=asyncio.Lock(),
            cluster_name=state.name,
            host_ip=str(plan.host_address),
            service_host=str(plan.kubernetes_service_ip),
            service_port=443,
            ca_file=creds.ca_file or Path(),
            log=self.log,
        )
        ctx.logs_registry = KwokLogs(api, self.log)
        await ctx.logs_registry.start()
        self.ctx = ctx
        self.log.info(
            "node agent for %s (apiserver port %d), pods in %s", state.name, port, ctx.pods_dir()
        )
        ctx.pods_dir().mkdir(parents=True, exist_ok=True)
        watcher = asyncio.create_task(self._watch_forever())
        try:
            await stop.wait()
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            (self.settings.agent_dir() / READY_FILE).unlink(missing_ok=True)
            await self._stop_all()
            await api.aclose()

    async def _stop_all(self) -> None:
        workers = list(self.workers.values())
        self.log.info("stopping %d pods", len(workers))
        for w in workers:
            w.stop_for_shutdown()
        tasks = [w.task for w in workers if w.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        # Pods the agent never got to (its directory only) and the cgroups' parent directories.
        for pod_dir in list(self.ctx.pods_dir().iterdir()):
            await asyncio.to_thread(self._remove_orphan, pod_dir)
        await asyncio.to_thread(sweep_pod_cgroups, self.ctx.cluster_name)

    # ---- watching ----------------------------------------------------------------------

    async def _refresh_nodes(self) -> None:
        nodes = await self.ctx.api.get("/api/v1/nodes")
        self.nodes = {
            n["metadata"]["name"]
            for n in nodes["items"]
            if (n["metadata"].get("annotations") or {}).get(KWOK_ANNOTATION) == "fake"
        }

    async def _watch_forever(self) -> None:
        first = True
        while True:
            try:
                await self._refresh_nodes()
                listed = await self.ctx.api.get("/api/v1/pods")
                rv = listed["metadata"]["resourceVersion"]
                pods = {p["metadata"]["uid"]: p for p in listed["items"] if self._ours(p)}
                if first:
                    await self._adopt_or_clean(pods)
                    first = False
                for uid, w in list(self.workers.items()):
                    if uid not in pods:
                        w.gone()
                for pod in pods.values():
                    self._handle("ADDED", pod)
                ready = self.settings.agent_dir() / READY_FILE
                if not ready.exists():
                    ready.write_text(str(os.getpid()))
                while True:
                    async for event in self.ctx.api.watch(
                        "/api/v1/pods",
                        {"resourceVersion": rv},
                        self.settings.watch_timeout_s,
                        idle_s=self.settings.watch_idle_s,
                    ):
                        obj = event.get("object") or {}
                        if event["type"] == "ERROR":
                            raise ApiError("WATCH", "/api/v1/pods", obj.get("code", 500), obj)
                        rv = obj.get("metadata", {}).get("resourceVersion", rv)
                        if event["type"] == "BOOKMARK":
                            continue
                        node = obj.get("spec", {}).get("nodeName")
                        if node and node not in self.nodes:
                            await self._refresh_nodes()
                        if self._ours(obj):
                            self._handle(event["type"], obj)
            except asyncio.CancelledError:
                raise
            except (ApiError, httpx.HTTPError, OSError, ValueError) as exc:
                self.log.warning("pod watch interrupted (%s); listing again", exc)
                await asyncio.sleep(1)

    def _ours(self, pod: dict[str, Any]) -> bool:
        annotations = pod.get("metadata", {}).get("annotations") or {}
        if annotations.get(SKIP_ANNOTATION) == "skip":
            return False
        return pod.get("spec", {}).get("nodeName") in self.nodes

    def _handle(self, kind: str, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        worker = self.workers.get(uid)
        if kind == "DELETED":
            if worker is not None:
                worker.gone()
            return
        if worker is not None:
            worker.update(pod)
            return
        phase = (pod.get("status") or {}).get("phase")
        known = (self.ctx.pods_dir() / uid).exists()
        if not known and (
            phase in ("Succeeded", "Failed") or pod["metadata"].get("deletionTimestamp")
        ):
            if pod["metadata"].get("deletionTimestamp"):
                # Nothing of it runs here: finish its deletion (a finished pod stays until deleted).
                task = asyncio.create_task(self._delete_now(pod))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            return
        worker = PodWorker(self.ctx, pod)
        self.workers[uid] = worker
        worker.task = asyncio.create_task(self._run_worker(worker))

    async def _run_worker(self, worker: PodWorker) -> None:
        # A pod recreated under the same name (a StatefulSet's) waits until its predecessor is
        # gone from the host: its network namespace and directories are named after it.
        for other in list(self.workers.values()):
            if other is not worker and other.key == worker.key and other.task is not None:
                await asyncio.wait([other.task])
        try:
            await worker.run()
        except asyncio.CancelledError:
            raise
        except Exception:
            self.log.exception("%s: pod worker failed", worker.key)
        finally:
            if self.workers.get(worker.uid) is worker:
                del self.workers[worker.uid]

    async def _delete_now(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        with contextlib.suppress(ApiError, httpx.HTTPError):
            await self.ctx.api.request(
                "DELETE",
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                {
                    "apiVersion": "v1",
                    "kind": "DeleteOptions",
                    "gracePeriodSeconds": 0,
                    "preconditions": {"uid": meta["uid"]},
                },
            )

    async def _adopt_or_clean(self, pods: dict[str, dict[str, Any]]) -> None:
        """At start: pods with a directory but no pod object any more are removed from the host."""
        for pod_dir in sorted(self.ctx.pods_dir().iterdir()):
            if pod_dir.name in pods:
                self.log.info("adopting pod %s", pod_dir.name)
                continue
            await asyncio.to_thread(self._remove_orphan, pod_dir)

    def _remove_orphan(self, pod_dir: Path) -> None:
        try:
            meta = json.loads((pod_dir / "pod.json").read_text())
        except FileNotFoundError:
            meta = {"namespace": "", "name": "", "uid": pod_dir.name}
        self.log.info("removing pod %s/%s (no longer in the API)", meta["namespace"], meta["name"])
        if meta["name"]:
            cleanup_pod_dir(self.ctx, pod_dir, meta["namespace"], meta["name"], meta["uid"])
        else:
            import shutil

            shutil.rmtree(pod_dir)


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m conveyor.cluster.agent WORK_DIR``."""
    parser = argparse.ArgumentParser(prog="conveyor-node-agent", description=__doc__)
    parser.add_argument("work_dir", type=Path, help="the cluster's work directory")
    parser.add_argument(
        "--restart-backoff-initial",
        type=float,
        default=None,
        help="seconds of the first restart back-off",
    )
    args = parser.parse_args(argv)
    settings = AgentSettings(work_dir=args.work_dir)
    if args.restart_backoff_initial is not None:
        settings = replace(settings, restart_backoff_initial_s=args.restart_backoff_initial)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await Agent(settings).run(stop)

    try:
        asyncio.run(serve())
    except AgentAlreadyRunning as exc:
        print(f"conveyor node agent: {exc}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
