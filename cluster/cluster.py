"""The one-machine cluster: one owner object with ``start()``/``stop()`` for everything it runs.

Order of ``start``: the pod network (guard route first), the cluster's cgroup, certificates,
etcd, kube-apiserver on the bridge's host address, kube-controller-manager, kube-scheduler,
CoreDNS (the cluster's names: ``dns``), the nodes (each a real kubelet with its own
containerd: ``real_nodes``; Ready before any pod), kube-proxy (ClusterIPs route). ``stop``
first stops the nodes in order while the apiserver runs (pods, kubelets, containers,
containerd), then ends the rest in reverse, SIGTERM then SIGKILL, and removes every link,
route, rule, mount and cgroup the cluster made (``teardown``). What was done is written to ``state.json``
in the work directory as it happens (``state``), so ``conveyor cluster down`` (another
process) can stop a cluster, and a later start can clean up after a crashed one, never
touching a cluster whose processes still run. The components' command lines come from
``control_plane``, their kubeconfigs from ``kubeconfigs``; their processes are kept (started,
waited for, restarted) by ``components``.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import time
import urllib.request
from pathlib import Path

import yaml

from conveyor.cluster.api import ApiClient
from conveyor.cluster.certs import Pki, generate_pki
from conveyor.cluster.cgroups import ClusterCgroup
from conveyor.cluster.components import Components
from conveyor.cluster.control_plane import (
    ControlPlaneInputs,
    Ports,
    apiserver_args,
    controller_manager_args,
    etcd_args,
    etcd_client_url,
    kube_proxy_args,
    kube_proxy_config,
    scheduler_args,
)
from conveyor.cluster.dns import coredns_args, corefile, rbac_objects
from conveyor.cluster.kubeconfigs import CLIENTS, write_kubeconfigs
from conveyor.cluster.kubelet_node import missing_host_tools
from conveyor.cluster.network import HostNetwork, NetworkPlan, nft_tables, run
from conveyor.cluster.nodes import node_names
from conveyor.cluster.process import ManagedProcess, ProcessRecord, tail
from conveyor.cluster.real_nodes import start_real_nodes, stop_real_nodes
from conveyor.cluster.settings import ClusterSettings
from conveyor.cluster.state import (
    STATE_FILE,
    ClusterState,
    machine_lock,
    read_state,
    write_state,
)
from conveyor.cluster.teardown import clean_leftovers, teardown
from conveyor.cluster.tools import CLUSTER_BINARIES, Tools, build_tools

TIMINGS_FILE = "timings.json"


def rotate_logs(logs: Path) -> None:
    """Move an earlier cluster's logs aside (to ``logs.previous``, replacing what was there),
    so that this cluster's failure reports show only its own components: a cluster of the
    same name leaves containerd and kubelet logs of nodes this one may not have."""
    if logs.is_dir():
        previous = logs.with_name(logs.name + ".previous")
        shutil.rmtree(previous, ignore_errors=True)
        logs.rename(previous)
    logs.mkdir()


def free_port(host: str) -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def free_ports(host: str) -> Ports:
    """A free port for each component: the apiserver's on ``host``, the rest on loopback."""
    return Ports(
        etcd=free_port("127.0.0.1"),
        etcd_peer=free_port("127.0.0.1"),
        apiserver=free_port(host),
        controller_manager=free_port("127.0.0.1"),
        scheduler=free_port("127.0.0.1"),
        proxy_healthz=free_port("127.0.0.1"),
        proxy_metrics=free_port("127.0.0.1"),
        dns_health=free_port("127.0.0.1"),
        dns_ready=free_port("127.0.0.1"),
    )


class Cluster:
    """The one-machine cluster. ``with Cluster(settings) as c:`` or ``start()`` then ``stop()``."""

    def __init__(self, settings: ClusterSettings | None = None) -> None:
        self.settings = settings or ClusterSettings()
        s = self.settings
        self.work_dir = s.work_dir()
        self.plan = NetworkPlan.from_strings(s.pod_cidr, s.service_cidr, s.guard_cidr, s.bridge)
        self.cgroup = ClusterCgroup(s.name)
        self.state: ClusterState | None = None
        self.components = Components(
            self.logs_dir, self.cgroup, timeout_s=s.start_timeout_s, on_start=self._record
        )
        self.tools: Tools | None = None
        self.pki: Pki | None = None
        self.timings: dict[str, float] = {}
        self._api: ApiClient | None = None

    @classmethod
    def attach(cls, state_root: Path | None = None) -> Cluster | None:
        """The cluster running on this machine (started by another process), or ``None``.

        The returned object can be used and stopped like one this process started.
        """
        root = state_root or ClusterSettings().state_root
        for state_file in sorted(root.glob(f"*/{STATE_FILE}")):
            state = read_state(state_file.parent)
            if state is None or not state.alive() or not state.settings:
                continue
            cluster = cls(ClusterSettings.from_json(state.settings))
            cluster.state = state
            if state.tools_dir:
                cluster.tools = Tools(Path(state.tools_dir))
            for record in state.processes:
                cluster.components.adopt(record)
            return cluster
        return None

    # ---- paths -------------------------------------------------------------------------

    @property
    def kubeconfig_path(self) -> Path:
        """The admin kubeconfig for users and tests."""
        return self.work_dir / "kubeconfig"

    @property
    def logs_dir(self) -> Path:
        """One log file per component (appended to at each start of it; the cluster's last
        run's are in ``logs.previous``)."""
        return self.work_dir / "logs"

    @property
    def processes(self) -> dict[str, ManagedProcess]:
        """The running components by name, in the order they started."""
        return self.components.processes

    @property
    def host_address(self) -> str:
        """The bridge's host address, where the apiserver listens."""
        return str(self.plan.host_address)

    @property
    def server(self) -> str:
        """The apiserver's URL."""
        if self.state is None or not self.state.server:
            raise RuntimeError("the cluster is not started")
        return self.state.server

    @property
    def api(self) -> ApiClient:
        """An admin client of the apiserver."""
        if self._api is None:
            self._api = ApiClient.from_kubeconfig(self.kubeconfig_path)
        return self._api

    def node_names(self) -> tuple[list[str], list[str]]:
        """Names of the GPU nodes and the CPU nodes."""
        return node_names(self.settings.gpu_nodes, self.settings.cpu_nodes)

    # ---- start -------------------------------------------------------------------------

    def start(self) -> None:
        """Start everything, in order; on any failure stop what was started and raise."""
        self.tools = (
            build_tools(CLUSTER_BINARIES)
            if self.settings.tools_dir is None
            else Tools(self.settings.tools_dir)
        )
        if missing := self.tools.missing(CLUSTER_BINARIES):
            raise FileNotFoundError(f"tools missing in {self.tools.directory}: {missing}")
        if why_not := missing_host_tools():
            raise RuntimeError(f"the cluster's nodes cannot run here: {why_not}")
        with machine_lock(self.settings.state_root):
            clean_leftovers(self.settings.state_root)
            t0 = time.monotonic()
            try:
                self._start(t0)
            except BaseException:
                self._stop()
                raise
        self.timings["start_total_s"] = time.monotonic() - t0
        (self.work_dir / TIMINGS_FILE).write_text(json.dumps(self.timings, indent=2))

    def _start(self, t0: float) -> None:
        s = self.settings
        if self.work_dir.exists():
            for stale in ("etcd", "pki", "config", STATE_FILE):
                p = self.work_dir / stale
                if p.is_dir():
                    shutil.rmtree(p)
                elif p.exists():
                    p.unlink()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        rotate_logs(self.logs_dir)
        self.state = ClusterState(
            s.name,
            s.bridge,
            s.pod_cidr,
            s.service_cidr,
            s.guard_cidr,
            settings=s.to_json(),
            tools_dir=str(self.tools.directory) if self.tools else "",
        )
        self._save_state()

        network = HostNetwork(self.plan, self.state.network)
        network.start(on_change=self._save_state)
        self.cgroup.create()
        self._save_state()

        host = self.host_address
        self.pki = generate_pki(
            self.work_dir / "pki",
            host_address=self.plan.host_address,
            service_ip=self.plan.kubernetes_service_ip,
            clients=CLIENTS,
        )
        ports = free_ports(host)
        self.state.server = f"https://{host}:{ports.apiserver}"
        self.state.kubeconfig = str(self.kubeconfig_path)
        config_dir = self.work_dir / "config"
        config_dir.mkdir(exist_ok=True)
        inputs = ControlPlaneInputs(
            work_dir=self.work_dir,
            host=host,
            ports=ports,
            pki=self.pki,
            kubeconfigs=write_kubeconfigs(
                self.pki,
                server=self.state.server,
                admin_path=self.kubeconfig_path,
                config_dir=config_dir,
                context=s.name,
            ),
            pod_cidr=str(self.plan.pod_cidr),
            service_cidr=str(self.plan.service_cidr),
            log_level=s.log_level,
        )

        self._start_etcd(inputs)
        self._run("kube-apiserver", apiserver_args(inputs))
        self.components.wait("kube-apiserver", "/readyz", lambda: self.api.readyz()[0])
        self.timings["start_to_readyz_s"] = time.monotonic() - t0
        self._run("kube-controller-manager", controller_manager_args(inputs))
        self._run("kube-scheduler", scheduler_args(inputs))
        self._start_dns(inputs, config_dir)
        self._start_nodes()
        self.timings["start_to_nodes_ready_s"] = time.monotonic() - t0
        self._start_kube_proxy(inputs, config_dir)
        self.api.wait_for(
            "the default ServiceAccount",
            lambda: self.api.get("/api/v1/namespaces/default/serviceaccounts/default"),
            timeout_s=s.start_timeout_s,
        )
        self.timings["start_to_ready_s"] = time.monotonic() - t0

    def _start_dns(self, inputs: ControlPlaneInputs, config_dir: Path) -> None:
        """CoreDNS on the bridge's host address, port 53; ready once it has listed the Services."""
        for path, obj in rbac_objects():
            self.api.create(path, obj)
        config = config_dir / "Corefile"
        config.write_text(
            corefile(
                inputs.host,
                kubeconfig=inputs.kubeconfigs["coredns"],
                health_port=inputs.ports.dns_health,
                ready_port=inputs.ports.dns_ready,
            )
        )
        self._run("coredns", coredns_args(config))
        ready = f"http://127.0.0.1:{inputs.ports.dns_ready}/ready"

        def serving() -> bool:
            with urllib.request.urlopen(ready, timeout=2) as resp:
                return bool(resp.status == 200)

        self.components.wait("coredns", f"CoreDNS's {ready}", serving)

    def _start_nodes(self) -> None:
        """The nodes: real kubelets, each with its own containerd (``real_nodes.py``)."""
        assert self.pki is not None and self.state is not None
        self.timings |= start_real_nodes(
            self.settings,
            plan=self.plan,
            ca=self.pki.ca,
            server=self.state.server,
            components=self.components,
            api=self.api,
            free_port=free_port,
        )

    def _run(self, name: str, args: list[str]) -> ManagedProcess:
        """Start the component ``name``, one of the cluster's tools, with ``args``."""
        assert self.tools is not None
        return self.components.start(name, [str(self.tools.path(name)), *args])

    def _start_etcd(self, inputs: ControlPlaneInputs) -> None:
        self._run("etcd", etcd_args(inputs))
        client = etcd_client_url(inputs.ports)

        def healthy() -> bool:
            with urllib.request.urlopen(f"{client}/health", timeout=2) as resp:
                return bool(json.loads(resp.read()).get("health") == "true")

        self.components.wait("etcd", "etcd /health", healthy)

    def _start_kube_proxy(self, inputs: ControlPlaneInputs, config_dir: Path) -> None:
        gpu, cpu = self.node_names()
        path = config_dir / "kube-proxy.yaml"
        config = kube_proxy_config(inputs, node=cpu[0] if cpu else gpu[0])
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        self._run("kube-proxy", kube_proxy_args(inputs, path))
        service_ip = str(self.plan.kubernetes_service_ip)

        def kubernetes_service_routed() -> bool:
            if ("ip", "kube-proxy") not in nft_tables():
                return False
            return service_ip in run("nft", "list", "table", "ip", "kube-proxy").stdout

        self.components.wait(
            "kube-proxy", f"kube-proxy's rules for {service_ip}", kubernetes_service_routed
        )

    def restart(self, name: str, *, down_s: float = 0.0) -> ManagedProcess:
        """Kill the component ``name`` (SIGKILL: a crash) and start it again with the same command
        line ``down_s`` later, as its supervisor would (systemd's RestartSec, the kubelet of a
        static pod). Returns once it runs; waiting until it serves is the caller's. The fault
        tests use it."""
        assert self.state is not None, "the cluster is not started"
        return self.components.restart(name, down_s=down_s)

    def _record(self, record: ProcessRecord) -> None:
        """Write down a component that now runs (in place of its earlier run, if any)."""
        assert self.state is not None
        names = [p.name for p in self.state.processes]
        if record.name in names:
            self.state.processes[names.index(record.name)] = record
        else:
            self.state.processes.append(record)
        self._save_state()

    def _save_state(self) -> None:
        assert self.state is not None
        write_state(self.work_dir, self.state)

    # ---- stop --------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop everything this cluster started (also one started by another process), leave nothing."""
        with machine_lock(self.settings.state_root):
            self._stop()

    def _stop(self) -> None:
        if self.state is None:
            self.state = read_state(self.work_dir)
        if self.state is None:
            return
        for record in self.state.processes:
            if record.name not in self.processes:
                self.components.adopt(record)
        failed: RuntimeError | None = None
        # The settings it was started with (``down`` from another process knows only its name).
        started = ClusterSettings.from_json(self.state.settings) if self.state.settings else None
        if started is not None:
            # In order, while the apiserver runs: pods, kubelet, containers, containerd.
            try:
                stop_real_nodes(started, components=self.components, api=self.api)
            except RuntimeError as exc:
                failed = exc  # the rest of the teardown still runs
        teardown(self.state, self.settings.stop_grace_s, list(reversed(self.processes.values())))
        (self.work_dir / STATE_FILE).unlink(missing_ok=True)
        self.processes.clear()
        self.state = None
        self._api = None
        if failed is not None:
            raise failed

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- looking at it -----------------------------------------------------------------

    def running(self) -> bool:
        """True while the recorded processes run."""
        state = self.state or read_state(self.work_dir)
        return bool(state and state.alive())

    def log_tails(self, lines: int = 30) -> str:
        """The end of every component's log, for a failure report."""
        parts = []
        for log in sorted(self.logs_dir.glob("*.log")):
            parts.append(f"---- {log} (last {lines} lines)\n{tail(log, lines)}")
        return "\n".join(parts)

    def memory(self) -> dict[str, int]:
        """Resident memory (bytes) of each running component."""
        state = self.state or read_state(self.work_dir)
        usage: dict[str, int] = {}
        for record in state.alive() if state else []:
            with contextlib.suppress(FileNotFoundError):
                for line in Path(f"/proc/{record.pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        usage[record.name] = int(line.split()[1]) * 1024
        return usage
