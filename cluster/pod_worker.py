"""One pod on the node agent: its network, volumes and containers, its probes, status and end.

``PodWorker.run`` is the pod's whole life: make its network namespace (``PodNetworks``), its
``/etc/hosts`` and ``/etc/resolv.conf`` and its volumes; run each container
(``ContainerRunner``: start, probes, restart with back-off per ``restartPolicy``); report
the status after every change; on deletion run ``preStop``, SIGTERM, wait up to the grace
period, SIGKILL; remove the cgroups, mounts, network namespace and files; and finish the
deletion as a kubelet does. Everything a pod needs after an agent restart is in its
directory, so a new worker adopts the runs that are still going instead of starting
second copies.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from conveyor.cluster.agent_api import AsyncApi
from conveyor.cluster.agent_settings import AgentSettings
from conveyor.cluster.api import ApiError
from conveyor.cluster.container_attempt import ContainerAttempt, Exit
from conveyor.cluster.podcgroups import ContainerCgroup, remove_pod_cgroups
from conveyor.cluster.podnet import NETNS_DIR, PodNetworks
from conveyor.cluster.podspec import (
    ConfigError,
    container_limits,
    decode_data,
    effective_user,
    expand,
    field_value,
    hosts_file,
    image_name,
    image_path,
    kubernetes_env,
    now_rfc3339,
    pod_phase,
    resolv_conf,
    resource_value,
    service_env,
)
from conveyor.cluster.probes import ExecTarget, ProbeSpec, run_handler
from conveyor.cluster.volumes import PodVolumes, teardown_volumes

CONFIG = "CreateContainerConfigError"


@dataclass
class AgentContext:
    """What every pod worker shares: settings, API client, pod networks, addresses."""

    settings: AgentSettings
    api: AsyncApi
    networks: PodNetworks
    network_lock: asyncio.Lock
    cluster_name: str
    host_ip: str
    service_host: str
    """The ``kubernetes`` Service's ClusterIP (``KUBERNETES_SERVICE_HOST``)."""
    service_port: int
    ca_file: Path
    log: logging.Logger
    logs_registry: Any = None
    """Publishes each pod's log files to kwok (``kubectl logs``); ``None`` when not available."""

    def pods_dir(self) -> Path:
        return self.settings.agent_dir() / "pods"


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait for ``event`` at most ``timeout_s``; True if it is set."""
    if timeout_s <= 0:
        return event.is_set()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await event.wait()
    return event.is_set()


class ContainerRunner:
    """One container of a pod: its runs one after another, its probes, its status."""

    def __init__(self, worker: PodWorker, spec: dict[str, Any]) -> None:
        self.worker = worker
        self.spec = spec
        self.name: str = spec["name"]
        self.dir = worker.dir / "containers" / self.name
        self.state: dict[str, Any] = {"waiting": {"reason": "ContainerCreating"}}
        self.last_state: dict[str, Any] = {}
        self.restart_count = 0
        self.backoff_s = 0.0
        self.ready = False
        self.started = False
        self.run: ContainerAttempt | None = None
        self.attempt = -1
        self.done = False
        self.stopping = asyncio.Event()
        self.ever_ran = False
        self.cgroup = ContainerCgroup(worker.ctx.cluster_name, worker.uid, self.name)
        self._load()
        self._adopt()

    # ---- persistence (for an agent restart) ---------------------------------------------

    def _load(self) -> None:
        path = self.dir / "state.json"
        if not path.exists():
            return
        data = json.loads(path.read_text())
        self.restart_count = data["restart_count"]
        self.backoff_s = data["backoff_s"]
        self.last_state = data["last_state"]
        self.attempt = data["attempt"]
        self.ever_ran = self.attempt >= 0

    def _adopt(self) -> None:
        """After an agent restart, a run still alive keeps what the API shows of it (running,
        started, ready) from the pod's very first status report on, until its probes say
        otherwise, as a restarted kubelet does. Reported as newly created until its runner got
        going, every pod of the nodes flapped not Ready at each restart of the agent, and the
        Services dropped their endpoints meanwhile."""
        run = ContainerAttempt.find(self.dir / str(self.attempt)) if self.attempt >= 0 else None
        if run is None or not run.alive():
            return
        for cs in (self.worker.pod.get("status") or {}).get("containerStatuses") or []:
            if cs.get("name") == self.name and cs.get("containerID") == self.container_id():
                self.ready = bool(cs.get("ready"))
                self.started = bool(cs.get("started"))
        self.state = {"running": {"startedAt": now_rfc3339(run.started_at or time.time())}}

    def _save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / "state.json.tmp"
        tmp.write_text(
            json.dumps(
                {
                    "restart_count": self.restart_count,
                    "backoff_s": self.backoff_s,
                    "last_state": self.last_state,
                    "attempt": self.attempt,
                }
            )
        )
        tmp.replace(self.dir / "state.json")

    # ---- status ------------------------------------------------------------------------

    def container_id(self) -> str | None:
        if self.attempt < 0:
            return None
        return f"conveyor://{self.worker.uid[:8]}-{self.name}-{self.attempt}"

    def status(self) -> dict[str, Any]:
        image = self.spec.get("image", "")
        out: dict[str, Any] = {
            "name": self.name,
            "image": image,
            "imageID": f"conveyor://{image_name(image)}" if self.ever_ran else "",
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restart_count,
            "state": self.state,
            "lastState": self.last_state,
        }
        if cid := self.container_id():
            out["containerID"] = cid
        return out

    def changed(self) -> None:
        self.worker.status_changed()

    # ---- the loop ----------------------------------------------------------------------

    async def loop(self) -> None:
        """Run the container until the pod stops or ``restartPolicy`` says it is finished."""
        # A run adopted after an agent restart (its status was restored by ``_adopt``).
        run = ContainerAttempt.find(self.dir / str(self.attempt)) if self.attempt >= 0 else None
        if run is not None:
            self.worker.ctx.log.info(
                "%s/%s: adopting run %d (alive: %s)",
                self.worker.key,
                self.name,
                self.attempt,
                run.alive(),
            )
        policy = self.worker.pod["spec"].get("restartPolicy", "Always")
        while not self.stopping.is_set():
            if run is None:
                try:
                    spec = await self.worker.shim_spec(self.spec, self)
                except ConfigError as exc:
                    self.state = {"waiting": {"reason": exc.reason, "message": exc.message}}
                    self.changed()
                    await wait_event(self.stopping, self.worker.ctx.settings.config_retry_s)
                    continue
                run = await self._start(spec)
            self.run = run
            started_at = run.started_at or time.time()
            if run.alive():
                self.state = {"running": {"startedAt": now_rfc3339(started_at)}}
                self.ever_ran = True
                self.changed()
            probes = asyncio.create_task(self._probes(run))
            try:
                ended = await run.wait()
            finally:
                probes.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await probes
            self.ready = False
            self.started = False
            self.run = None
            terminated = self._terminated(ended)
            self.state = {"terminated": terminated}
            self.changed()
            self.worker.ctx.log.info(
                "%s/%s: run %d ended: exit %d (%s)",
                self.worker.key,
                self.name,
                self.attempt,
                ended.exit_code,
                ended.reason,
            )
            run = None
            if self.stopping.is_set():
                break
            if policy == "Never" or (policy == "OnFailure" and ended.exit_code == 0):
                self.done = True
                self._save()
                self.worker.status_changed()
                return
            s = self.worker.ctx.settings
            if ended.finished_at - ended.started_at >= s.backoff_reset_s:
                self.backoff_s = 0.0
            delay = self.backoff_s
            self.backoff_s = min(
                s.restart_backoff_max_s, max(s.restart_backoff_initial_s, self.backoff_s * 2)
            )
            self.last_state = {"terminated": terminated}
            self._save()
            if delay > 0:
                pod = self.worker.pod["metadata"]
                self.state = {
                    "waiting": {
                        "reason": "CrashLoopBackOff",
                        "message": f"back-off {delay:g}s restarting failed container={self.name} "
                        f"pod={pod['name']}_{pod['namespace']}({self.worker.uid})",
                    }
                }
                self.changed()
                if await wait_event(self.stopping, delay):
                    break
            self.restart_count += 1
            self._save()
        self.done = True

    def _terminated(self, ended: Exit) -> dict[str, Any]:
        out: dict[str, Any] = {
            "exitCode": ended.exit_code,
            "reason": ended.reason,
            "startedAt": now_rfc3339(ended.started_at),
            "finishedAt": now_rfc3339(ended.finished_at),
        }
        if ended.signal:
            out["signal"] = ended.signal
        if cid := self.container_id():
            out["containerID"] = cid
        return out

    async def _start(self, spec: dict[str, Any]) -> ContainerAttempt:
        self.attempt += 1
        limits = container_limits(self.spec)
        await asyncio.to_thread(self.cgroup.kill)
        self.cgroup.create(cpu_cores=limits.cpu_cores, memory_bytes=limits.memory_bytes)
        logs = self.worker.logs_dir(self.name)
        logs.mkdir(parents=True, exist_ok=True)
        current = logs / "current.log"
        if current.exists():
            current.replace(logs / "previous.log")
        self._save()
        run = ContainerAttempt(self.dir / str(self.attempt))
        await run.start(spec)
        self.worker.ctx.log.info(
            "%s/%s: started run %d (shim pid %s)",
            self.worker.key,
            self.name,
            self.attempt,
            run.shim.pid if run.shim else None,
        )
        return run

    # ---- probes ------------------------------------------------------------------------

    def exec_target(self, run: ContainerAttempt) -> ExecTarget | None:
        pid = run.pid()
        if pid is None:
            return None
        try:
            spec = json.loads((run.dir / "spec.json").read_text())
        except FileNotFoundError:
            return None
        return ExecTarget(pid, spec.get("uid"), spec.get("gid"), spec["env"])

    async def _check(self, probe: ProbeSpec, run: ContainerAttempt) -> tuple[bool, str]:
        return await run_handler(
            probe.handler,
            pod_ip=self.worker.pod_ip or "",
            container=self.spec,
            target=self.exec_target(run),
            timeout_s=probe.timeout_s,
        )

    async def _probes(self, run: ContainerAttempt) -> None:
        startup = ProbeSpec.of(self.spec.get("startupProbe"))
        readiness = ProbeSpec.of(self.spec.get("readinessProbe"))
        liveness = ProbeSpec.of(self.spec.get("livenessProbe"))
        if startup is not None:
            ok = await self._probe_loop(startup, run, "Startup", until_success=True)
            if not ok:
                return
        self.started = True
        if readiness is None:
            self.ready = True
        self.changed()
        tasks = []
        if readiness is not None:
            tasks.append(asyncio.create_task(self._probe_loop(readiness, run, "Readiness")))
        if liveness is not None:
            tasks.append(asyncio.create_task(self._probe_loop(liveness, run, "Liveness")))
        try:
            if tasks:
                await asyncio.gather(*tasks)
            else:
                await asyncio.Event().wait()
        finally:
            for t in tasks:
                t.cancel()

    async def _probe_loop(
        self, probe: ProbeSpec, run: ContainerAttempt, kind: str, *, until_success: bool = False
    ) -> bool:
        """Probe every period; returns True once a startup probe succeeded, False after a kill."""
        await asyncio.sleep(probe.initial_delay_s)
        successes = failures = 0
        while True:
            ok, message = await self._check(probe, run)
            if ok:
                successes += 1
                failures = 0
                if until_success and successes >= 1:
                    return True
                if kind == "Readiness" and successes >= probe.success_threshold and not self.ready:
                    self.ready = True
                    self.changed()
            else:
                failures += 1
                successes = 0
                if failures >= probe.failure_threshold:
                    if kind == "Readiness":
                        if self.ready:
                            self.ready = False
                            self.changed()
                    else:
                        self.worker.ctx.log.info(
                            "%s/%s: %s probe failed %d times (%s); restarting the container",
                            self.worker.key,
                            self.name,
                            kind,
                            failures,
                            message,
                        )
                        await self.stop_run(run, self.worker.grace_s())
                        return False
            await asyncio.sleep(probe.period_s)

    # ---- stopping ----------------------------------------------------------------------

    async def stop_run(
        self, run: ContainerAttempt, grace_s: float, *, pre_stop: bool = True
    ) -> None:
        """``preStop``, SIGTERM, up to ``grace_s`` in all, then SIGKILL of what is left."""
        deadline = time.monotonic() + grace_s
        handler = (self.spec.get("lifecycle") or {}).get("preStop")
        if handler and pre_stop and grace_s > 0 and run.alive():
            ok, message = await run_handler(
                handler,
                pod_ip=self.worker.pod_ip or "",
                container=self.spec,
                target=self.exec_target(run),
                timeout_s=max(0.1, deadline - time.monotonic()),
            )
            if not ok:
                self.worker.ctx.log.info(
                    "%s/%s: preStop failed: %s", self.worker.key, self.name, message
                )
        run.signal(signal.SIGTERM)
        remaining = deadline - time.monotonic()
        if remaining > 0 and run.alive():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await run.wait()
        if run.alive():
            run.kill_group()
            await asyncio.to_thread(self.cgroup.kill)
            await run.wait()

    async def terminate(self, grace_s: float) -> None:
        """Stop for good (pod deletion or agent shutdown)."""
        self.stopping.set()
        run = self.run
        if run is not None and run.alive():
            await self.stop_run(run, grace_s)


class PodWorker:
    """The life of one pod on the simulated nodes."""

    def __init__(self, ctx: AgentContext, pod: dict[str, Any]) -> None:
        self.ctx = ctx
        self.pod = pod
        meta = pod["metadata"]
        self.uid: str = meta["uid"]
        self.namespace: str = meta["namespace"]
        self.name: str = meta["name"]
        self.key = f"{self.namespace}/{self.name}"
        self.dir = ctx.pods_dir() / self.uid
        self.runners = [ContainerRunner(self, c) for c in pod["spec"]["containers"]]
        self.deletion = asyncio.Event()
        self.forced = False
        self.shutdown = False
        self.config_error: ConfigError | None = None
        self.pod_ip: str | None = None
        self.start_time: str | None = (pod.get("status") or {}).get("startTime")
        self.volumes: PodVolumes | None = None
        self._dirty = asyncio.Event()
        self._sent: dict[str, Any] | None = None
        self._conditions: list[dict[str, Any]] = list(
            (pod.get("status") or {}).get("conditions") or []
        )
        self._services: list[dict[str, Any]] | None = None
        self.task: asyncio.Task[None] | None = None
        if pod["metadata"].get("deletionTimestamp"):
            self.deletion.set()

    # ---- events from the agent ---------------------------------------------------------

    def update(self, pod: dict[str, Any]) -> None:
        """A newer version of the pod from the watch (or a re-list)."""
        self.pod = pod
        if pod["metadata"].get("deletionTimestamp"):
            self.deletion.set()
        api_status = pod.get("status") or {}
        if self._sent is not None and owned_status(api_status) != owned_status(self._sent):
            # Someone else wrote the status this agent owns: the node lifecycle controller
            # marks every pod of a node whose lease went stale (a frozen apiserver, a partition)
            # not Ready. A kubelet re-asserts the truth on its next status sync; so does the
            # agent, counting the transitions from what the API now shows.
            self._conditions = list(api_status.get("conditions") or [])
            self._sent = None
            self.status_changed()

    def gone(self) -> None:
        """The pod object is gone from the API: stop at once, nothing left to report."""
        self.forced = True
        self.deletion.set()

    def stop_for_shutdown(self) -> None:
        """The agent stops all pods (cluster stop): short grace, the pod objects stay."""
        self.shutdown = True
        self.deletion.set()

    def grace_s(self) -> float:
        meta = self.pod["metadata"]
        grace = meta.get("deletionGracePeriodSeconds")
        if grace is None:
            grace = self.pod["spec"].get("terminationGracePeriodSeconds", 30)
        if self.forced:
            return 0.0
        if self.shutdown:
            return min(float(grace), self.ctx.settings.shutdown_grace_s)
        return float(grace)

    def logs_dir(self, container: str) -> Path:
        return self.dir / "logs" / container

    def status_changed(self) -> None:
        self._dirty.set()

    # ---- the life ----------------------------------------------------------------------

    async def run(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "pod.json").write_text(
            json.dumps({"namespace": self.namespace, "name": self.name, "uid": self.uid})
        )
        status = asyncio.create_task(self._report())
        runners: list[asyncio.Task[None]] = []
        try:
            if await self._setup():
                token_refresh = asyncio.create_task(self._refresh_tokens())
                runners = [asyncio.create_task(self._run_container(r)) for r in self.runners]
                stop = asyncio.create_task(self.deletion.wait())
                either: list[asyncio.Future[Any]] = [stop, asyncio.gather(*runners)]
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
                if not self.deletion.is_set():
                    # Every container finished for good (restartPolicy): stay until deleted.
                    self.status_changed()
                    await self.deletion.wait()
                stop.cancel()
                token_refresh.cancel()
            grace = self.grace_s()
            self.ctx.log.info("%s: stopping (grace %.0f s)", self.key, grace)
            await asyncio.gather(*(r.terminate(grace) for r in self.runners))
            await asyncio.gather(*runners, return_exceptions=True)
        finally:
            status.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await status
            await self.cleanup()
        if not self.forced and not self.shutdown:
            await self._finish_deletion()

    async def _run_container(self, runner: ContainerRunner) -> None:
        try:
            await runner.loop()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.ctx.log.exception("%s/%s: container runner failed", self.key, runner.name)
            runner.state = {"waiting": {"reason": "RunContainerError", "message": str(exc)}}
            runner.done = True
            self.status_changed()

    async def _setup(self) -> bool:
        """Network, files and volumes; on a ``ConfigError`` the pod waits (and retries) with its reason."""
        while not self.deletion.is_set():
            try:
                for c in self.pod["spec"]["containers"]:
                    image_path(c.get("image", ""), self.ctx.settings.images)
                if self.pod["spec"].get("initContainers"):
                    raise ConfigError(
                        CONFIG, "init containers are not run by the conveyor node agent"
                    )
                await self._network()
                self.status_changed()
                self._write_files()
                self.volumes = PodVolumes(
                    self.ctx.api,
                    self.pod,
                    self.dir,
                    ca_file=self.ctx.ca_file,
                    pod_ip=self.pod_ip or "",
                    host_ip=self.ctx.host_ip,
                    refresh_fraction=self.ctx.settings.token_refresh_fraction,
                )
                await self.volumes.prepare()
                if self.ctx.logs_registry is not None:
                    await self.ctx.logs_registry.publish(self)
                self.config_error = None
                return True
            except ConfigError as exc:
                if self.config_error is None or self.config_error.message != exc.message:
                    self.ctx.log.info("%s: waits: %s: %s", self.key, exc.reason, exc.message)
                self.config_error = exc
                for r in self.runners:
                    r.state = {"waiting": {"reason": exc.reason, "message": exc.message}}
                self.status_changed()
                retry = self.ctx.settings.config_retry_s * (
                    5 if exc.reason == "ErrImagePull" else 1
                )
                await wait_event(self.deletion, retry)
        return False

    async def _network(self) -> None:
        networks = self.ctx.networks
        netns, _ = networks.names(self.namespace, self.name)
        async with self.ctx.network_lock:
            if (NETNS_DIR / netns).exists():
                address = await asyncio.to_thread(self._existing_address, netns)
            else:
                net = await asyncio.to_thread(networks.create, self.namespace, self.name)
                address = str(net.address)
        self.pod_ip = address
        if self.start_time is None:
            self.start_time = now_rfc3339()

    def _existing_address(self, netns: str) -> str:
        from conveyor.cluster.network import run

        out = run("ip", "-n", netns, "-j", "addr", "show", "dev", "eth0").stdout
        for link in json.loads(out or "[]"):
            for a in link.get("addr_info", []):
                if a.get("family") == "inet":
                    return str(ipaddress.IPv4Address(a["local"]))
        raise RuntimeError(f"network namespace {netns} has no address")

    def _write_files(self) -> None:
        etc = self.dir / "etc"
        etc.mkdir(exist_ok=True)
        (etc / "hosts").write_text(hosts_file(self.pod, self.pod_ip or ""))
        (etc / "resolv.conf").write_text(resolv_conf(self.pod, self.ctx.host_ip))
        (etc / "hostname").write_text((self.pod["spec"].get("hostname") or self.name) + "\n")
        for p in etc.iterdir():
            p.chmod(0o644)
        (self.dir / "rootfs").mkdir(exist_ok=True)

    async def _refresh_tokens(self) -> None:
        while self.volumes is not None:
            due = self.volumes.next_refresh()
            if due is None:
                return
            await asyncio.sleep(max(1.0, due - time.time()))
            try:
                await self.volumes.refresh()
            except (ConfigError, ApiError, httpx.HTTPError) as exc:
                self.ctx.log.warning("%s: token refresh failed (retrying): %s", self.key, exc)
                await asyncio.sleep(10)

    # ---- a container's command line ----------------------------------------------------

    async def _get(self, kind: str, name: str, optional: bool) -> dict[str, bytes] | None:
        plural = "secrets" if kind == "secret" else "configmaps"
        try:
            obj = await self.ctx.api.get(f"/api/v1/namespaces/{self.namespace}/{plural}/{name}")
        except ApiError as exc:
            if exc.status == 404:
                if optional:
                    return None
                raise ConfigError(CONFIG, f'{kind} "{name}" not found') from exc
            raise
        return decode_data(obj, secret=kind == "secret")

    async def container_env(self, container: dict[str, Any], uid: int | None) -> dict[str, str]:
        """The container's environment, as a kubelet builds it."""
        env: dict[str, str] = {
            "PATH": image_path(container.get("image", ""), self.ctx.settings.images),
            "HOSTNAME": self.pod["spec"].get("hostname") or self.name,
            "HOME": "/root" if not uid else "/",
        }
        env |= self.ctx.settings.image_env.get(image_name(container.get("image", "")), {})
        if self.pod["spec"].get("enableServiceLinks", True):
            if self._services is None:
                listed = await self.ctx.api.get(f"/api/v1/namespaces/{self.namespace}/services")
                self._services = listed["items"]
            env |= service_env(self._services)
        env |= kubernetes_env(self.ctx.service_host, self.ctx.service_port)
        for source in container.get("envFrom") or []:
            prefix = source.get("prefix", "")
            kind = "secret" if "secretRef" in source else "configMap"
            ref = source.get("secretRef") or source.get("configMapRef") or {}
            data = await self._get(kind, ref["name"], bool(ref.get("optional")))
            for k, v in (data or {}).items():
                env[prefix + k] = v.decode(errors="replace")
        for var in container.get("env") or []:
            name = var["name"]
            if "value" in var:
                env[name] = expand(var["value"], env)
            elif "valueFrom" in var:
                value = await self._value_from(var["valueFrom"], container)
                if value is not None:
                    env[name] = value
            else:
                env[name] = ""
        return env

    async def _value_from(self, source: dict[str, Any], container: dict[str, Any]) -> str | None:
        if "fieldRef" in source:
            return field_value(
                self.pod,
                source["fieldRef"]["fieldPath"],
                pod_ip=self.pod_ip or "",
                host_ip=self.ctx.host_ip,
            )
        if "resourceFieldRef" in source:
            return resource_value(container, source["resourceFieldRef"])
        kind = "secret" if "secretKeyRef" in source else "configMap"
        ref = source.get("secretKeyRef") or source.get("configMapKeyRef") or {}
        data = await self._get(kind, ref["name"], bool(ref.get("optional")))
        if data is None:
            return None
        if ref["key"] not in data:
            if ref.get("optional"):
                return None
            raise ConfigError(
                CONFIG, f"couldn't find key {ref['key']} in {kind} {self.namespace}/{ref['name']}"
            )
        return data[ref["key"]].decode(errors="replace")

    async def shim_spec(self, container: dict[str, Any], runner: ContainerRunner) -> dict[str, Any]:
        """What the shim needs to start one run of ``container``."""
        assert self.volumes is not None
        uid, gid, groups = effective_user(self.pod, container)
        self._services = None
        env = await self.container_env(container, uid)
        entrypoint = self.ctx.settings.entrypoints.get(image_name(container.get("image", "")), ())
        command = [expand(a, env) for a in container.get("command") or entrypoint]
        args = [expand(a, env) for a in container.get("args") or []]
        argv = command + args
        if not argv:
            raise ConfigError(
                CONFIG,
                f"container {container['name']!r} has no command and its image no entrypoint "
                "(AgentSettings.entrypoints): set command",
            )
        mounts = []
        targets = set()
        for m in container.get("volumeMounts") or []:
            if m["name"] not in self.volumes.paths:
                raise ConfigError(CONFIG, f"volumeMount {m['name']!r} names no volume of the pod")
            source = Path(self.volumes.paths[m["name"]])
            if sub := m.get("subPath"):
                source = source / expand(sub, env)
                if not source.exists():
                    source.mkdir(parents=True)
            mounts.append(
                {
                    "source": str(source),
                    "target": m["mountPath"],
                    "readonly": bool(m.get("readOnly")),
                }
            )
            targets.add(m["mountPath"].rstrip("/"))
        for name in ("hosts", "resolv.conf", "hostname"):
            if f"/etc/{name}" not in targets:
                mounts.append(
                    {
                        "source": str(self.dir / "etc" / name),
                        "target": f"/etc/{name}",
                        "readonly": False,
                    }
                )
        mounts.sort(key=lambda m: m["target"].rstrip("/").count("/"))
        mounts += [
            {"source": src, "target": dst, "readonly": False} for src, dst in runner.cgroup.mounts()
        ]
        netns, _ = self.ctx.networks.names(self.namespace, self.name)
        return {
            "argv": argv,
            "env": env,
            "working_dir": container.get("workingDir") or "/",
            "uid": uid,
            "gid": gid,
            "supplemental_groups": groups,
            "netns": str(NETNS_DIR / netns),
            "traversable": closed_ancestors(env["PATH"]) if uid else [],
            "image_paths": image_paths(env["PATH"]),
            "rootfs": str(self.dir / "rootfs"),
            "mounts": mounts,
            "cgroup_procs": runner.cgroup.procs_files(),
            "oom_counter": runner.cgroup.oom_counter(),
            "log_file": str(self.logs_dir(container["name"]) / "current.log"),
        }

    # ---- status ------------------------------------------------------------------------

    def build_status(self) -> dict[str, Any]:
        states = [r.state for r in self.runners]
        ever = any(r.ever_ran for r in self.runners)
        policy = self.pod["spec"].get("restartPolicy", "Always")
        phase = pod_phase(policy, states, ever)
        if phase == "Running" and all(r.done for r in self.runners):
            phase = (
                "Succeeded"
                if all(s.get("terminated", {}).get("exitCode") == 0 for s in states)
                else "Failed"
            )
        unready = [r.name for r in self.runners if not r.ready]
        finished = phase in ("Succeeded", "Failed")
        values = {
            "PodReadyToStartContainers": (self.pod_ip is not None, None),
            "Initialized": (True, None),
            "Ready": (
                not unready and not finished,
                "PodCompleted" if finished else "ContainersNotReady",
            ),
            "ContainersReady": (
                not unready and not finished,
                "PodCompleted" if finished else "ContainersNotReady",
            ),
            "PodScheduled": (True, None),
        }
        from conveyor.cluster.podspec import conditions

        self._conditions = conditions(self._conditions, values)
        for c in self._conditions:
            if (
                c["type"] in ("Ready", "ContainersReady")
                and c["status"] == "False"
                and not finished
            ):
                c["message"] = f"containers with unready status: [{' '.join(unready)}]"
        status: dict[str, Any] = {
            "phase": phase,
            "conditions": self._conditions,
            "hostIP": self.ctx.host_ip,
            "hostIPs": [{"ip": self.ctx.host_ip}],
            "containerStatuses": [r.status() for r in self.runners],
        }
        if self.pod_ip:
            status["podIP"] = self.pod_ip
            status["podIPs"] = [{"ip": self.pod_ip}]
        if self.start_time:
            status["startTime"] = self.start_time
        return status

    async def _report(self) -> None:
        """Patch the pod's status after each change (changes in between are coalesced)."""
        path = f"/api/v1/namespaces/{self.namespace}/pods/{self.name}"
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            status = self.build_status()
            if status == self._sent:
                continue
            try:
                await self.ctx.api.patch_status(path, status)
                self._sent = status
            except ApiError as exc:
                if exc.status == 404:
                    return
                self.ctx.log.warning("%s: status patch failed (retrying): %s", self.key, exc)
                await asyncio.sleep(1)
                self._dirty.set()
            except httpx.HTTPError as exc:
                self.ctx.log.warning("%s: status patch failed (retrying): %s", self.key, exc)
                await asyncio.sleep(1)
                self._dirty.set()

    async def flush_status(self) -> None:
        """Send the current status now (before the deletion is finished)."""
        with contextlib.suppress(ApiError, httpx.HTTPError):
            await self.ctx.api.patch_status(
                f"/api/v1/namespaces/{self.namespace}/pods/{self.name}", self.build_status()
            )

    # ---- the end -----------------------------------------------------------------------

    async def cleanup(self) -> None:
        """Remove everything of the pod on the host: processes, cgroups, mounts, network, files."""
        await asyncio.to_thread(
            cleanup_pod_dir, self.ctx, self.dir, self.namespace, self.name, self.uid
        )
        if self.ctx.logs_registry is not None and not self.shutdown:
            await self.ctx.logs_registry.withdraw(self)
        self.ctx.log.info("%s: cleaned up", self.key)

    async def _finish_deletion(self) -> None:
        """Delete the pod object with grace 0, as a kubelet does once its containers are gone."""
        try:
            await self.ctx.api.request(
                "DELETE",
                f"/api/v1/namespaces/{self.namespace}/pods/{self.name}",
                {
                    "apiVersion": "v1",
                    "kind": "DeleteOptions",
                    "gracePeriodSeconds": 0,
                    "preconditions": {"uid": self.uid},
                },
            )
        except ApiError as exc:
            if exc.status not in (404, 409):
                raise


CHECKOUT = Path(__file__).resolve().parent.parent


NODE_CONDITIONS = (
    "PodReadyToStartContainers",
    "Initialized",
    "Ready",
    "ContainersReady",
    "PodScheduled",
)
"""The pod conditions the node writes; others (``DisruptionTarget``, a readiness gate's) are
other writers' and are left alone."""


def owned_status(status: dict[str, Any]) -> tuple[str | None, dict[str, str]]:
    """The part of a pod's status the node asserts: its phase and its conditions' statuses."""
    conditions = status.get("conditions") or []
    return status.get("phase"), {
        c["type"]: c["status"] for c in conditions if c.get("type") in NODE_CONDITIONS
    }


def image_paths(path_env: str) -> list[str]:
    """What the image's programs are made of here: the virtual environments on PATH and this
    checkout (an editable install). A real image carries them in its root filesystem, where a
    volume over ``/tmp`` cannot hide them; here they stay visible even when the checkout or its
    environment lies under a pod's volume (a clone in /tmp, and the runtime's /tmp emptyDir)."""
    paths = {str(CHECKOUT)}
    for d in path_env.split(":"):
        prefix = Path(d).parent
        if (prefix / "pyvenv.cfg").exists():
            paths |= {str(prefix), str(prefix.resolve())}
    return sorted(paths)


def closed_ancestors(path_env: str) -> list[str]:
    """Directories above the PATH's programs (and their interpreters) that others may not enter."""
    closed: set[str] = set()
    for d in path_env.split(":"):
        for target in {Path(d), Path(d).resolve(), *(p.resolve() for p in _interpreters(Path(d)))}:
            for parent in [target, *target.parents]:
                with contextlib.suppress(OSError):
                    if not parent.stat().st_mode & 0o001:
                        closed.add(str(parent))
    return sorted(closed, key=lambda p: p.count("/"))


def _interpreters(directory: Path) -> list[Path]:
    """The python of a virtual environment's bin directory (its programs' interpreter)."""
    python = directory / "python3"
    return [python] if python.exists() else []


def cleanup_pod_dir(ctx: AgentContext, pod_dir: Path, namespace: str, name: str, uid: str) -> None:
    """Remove a pod's processes, cgroups, mounts, network and directory (blocking; in a thread)."""
    remove_pod_cgroups(ctx.cluster_name, uid)
    # Shims end once their container has; wait for them so nothing writes into the directory.
    containers = pod_dir / "containers"
    if containers.exists():
        for run_dir in containers.glob("*/*"):
            run = ContainerAttempt.find(run_dir) if run_dir.name.isdigit() else None
            deadline = time.monotonic() + 10
            while run is not None and run.alive() and time.monotonic() < deadline:
                time.sleep(0.02)
    teardown_volumes(pod_dir / "volumes")
    ctx.networks.delete(namespace, name)
    shutil.rmtree(pod_dir, ignore_errors=False)
