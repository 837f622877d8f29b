"""The one-machine cluster: one owner object with ``start()``/``stop()`` for everything it runs.

Order of ``start``: the pod network (guard route first), the cluster's cgroup, certificates,
etcd, kube-apiserver on the bridge's host address, kube-controller-manager, kube-scheduler,
the simulated nodes and kwok (nodes Ready before any pod), kube-proxy (ClusterIPs route),
the node agent (pods run). ``stop`` ends them in reverse, SIGTERM then SIGKILL (the agent's
SIGTERM stops every pod first), and removes every network namespace, link, route, rule,
mount and cgroup the cluster made. What was done is written to ``state.json``
in the work directory as it happens, so ``conveyor cluster down`` (another process) can stop
a cluster, and a later start can clean up after a crashed one, never touching a cluster
whose processes still run.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from conveyor.cluster.api import ApiClient, kubeconfig, wait_for, write_kubeconfig
from conveyor.cluster.certs import ClientIdentity, Pki, generate_pki
from conveyor.cluster.cgroups import ClusterCgroup
from conveyor.cluster.kwok_logs import KWOK_CRDS, install_crds
from conveyor.cluster.network import HostNetwork, NetworkPlan, NetworkState, nft_tables, run
from conveyor.cluster.node_agent import AGENT_NAME, agent_argv, agent_ready, sweep_node_agent
from conveyor.cluster.nodes import MachineShare, kwok_stages, node_manifest, node_names
from conveyor.cluster.podnet import PodNetworks
from conveyor.cluster.process import ManagedProcess, ProcessRecord, tail
from conveyor.cluster.settings import ClusterSettings
from conveyor.cluster.tools import CLUSTER_BINARIES, Tools, build_tools, pinned_version

STATE_FILE = "state.json"
TIMINGS_FILE = "timings.json"

# Client certificates: (name, user, groups). RBAC's bootstrap policy binds the component users.
CLIENTS = [
    ClientIdentity("admin", "conveyor-admin", ("system:masters",)),
    ClientIdentity("controller-manager", "system:kube-controller-manager"),
    ClientIdentity("scheduler", "system:kube-scheduler"),
    ClientIdentity("kube-proxy", "system:kube-proxy"),
    ClientIdentity("kwok", "conveyor-kwok", ("system:masters",)),
    ClientIdentity("apiserver-kubelet", "kube-apiserver-kubelet-client", ("system:masters",)),
    # The aggregation layer's client; only this name may assert users through request headers.
    ClientIdentity("front-proxy", "front-proxy-client"),
]

PROXY_VARIABLES = (
    "http_proxy",
    "https_proxy",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "all_proxy",
    "ALL_PROXY",
    "KUBECONFIG",
)


class ClusterAlreadyRunning(RuntimeError):
    """Another cluster's processes are alive on this machine (one cluster per machine)."""


def free_port(host: str) -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class ClusterState:
    """What a running (or crashed) cluster did, as written to ``state.json``."""

    name: str
    bridge: str
    pod_cidr: str
    service_cidr: str
    guard_cidr: str
    network: NetworkState = field(default_factory=NetworkState)
    processes: list[ProcessRecord] = field(default_factory=list)
    server: str = ""
    kubeconfig: str = ""
    owner_pid: int = field(default_factory=os.getpid)
    settings: dict = field(default_factory=dict)
    tools_dir: str = ""

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "bridge": self.bridge,
            "pod_cidr": self.pod_cidr,
            "service_cidr": self.service_cidr,
            "guard_cidr": self.guard_cidr,
            "network": self.network.to_json(),
            "processes": [vars(p) for p in self.processes],
            "server": self.server,
            "kubeconfig": self.kubeconfig,
            "owner_pid": self.owner_pid,
            "settings": self.settings,
            "tools_dir": self.tools_dir,
        }

    @classmethod
    def from_json(cls, data: dict) -> ClusterState:
        return cls(
            name=data["name"],
            bridge=data["bridge"],
            pod_cidr=data["pod_cidr"],
            service_cidr=data["service_cidr"],
            guard_cidr=data["guard_cidr"],
            network=NetworkState.from_json(data.get("network", {})),
            processes=[ProcessRecord(**p) for p in data.get("processes", [])],
            server=data.get("server", ""),
            kubeconfig=data.get("kubeconfig", ""),
            owner_pid=data.get("owner_pid", 0),
            settings=data.get("settings", {}),
            tools_dir=data.get("tools_dir", ""),
        )

    def plan(self) -> NetworkPlan:
        return NetworkPlan.from_strings(
            self.pod_cidr, self.service_cidr, self.guard_cidr, self.bridge
        )

    def alive(self) -> list[ProcessRecord]:
        """The recorded processes that still run."""
        return [p for p in self.processes if p.alive()]


def read_state(work_dir: Path) -> ClusterState | None:
    """The state of the cluster in ``work_dir``, if one is recorded."""
    path = work_dir / STATE_FILE
    if not path.is_file():
        return None
    return ClusterState.from_json(json.loads(path.read_text()))


@contextlib.contextmanager
def machine_lock(state_root: Path) -> Iterator[None]:
    """Held while a cluster starts or stops: starts and stops on one machine never interleave."""
    state_root.mkdir(parents=True, exist_ok=True)
    with (state_root / ".lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class Cluster:
    """The one-machine cluster. ``with Cluster(settings) as c:`` or ``start()`` then ``stop()``."""

    def __init__(self, settings: ClusterSettings | None = None) -> None:
        self.settings = settings or ClusterSettings()
        s = self.settings
        self.work_dir = s.work_dir()
        self.plan = NetworkPlan.from_strings(s.pod_cidr, s.service_cidr, s.guard_cidr, s.bridge)
        self.pod_networks = PodNetworks(self.plan)
        self.cgroup = ClusterCgroup(s.name)
        self.state: ClusterState | None = None
        self.processes: dict[str, ManagedProcess] = {}
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
                log = cluster.logs_dir / f"{record.name}.log"
                cluster.processes[record.name] = ManagedProcess.adopt(record, log)
            return cluster
        return None

    # ---- paths -------------------------------------------------------------------------

    @property
    def kubeconfig_path(self) -> Path:
        """The admin kubeconfig for users and tests."""
        return self.work_dir / "kubeconfig"

    @property
    def logs_dir(self) -> Path:
        """One log file per component (appended to at each start)."""
        return self.work_dir / "logs"

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
        self.logs_dir.mkdir(exist_ok=True)
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
        ports = {
            "etcd": free_port("127.0.0.1"),
            "etcd-peer": free_port("127.0.0.1"),
            "apiserver": free_port(host),
            "controller-manager": free_port("127.0.0.1"),
            "scheduler": free_port("127.0.0.1"),
            "proxy-healthz": free_port("127.0.0.1"),
            "proxy-metrics": free_port("127.0.0.1"),
            "kwok": free_port(host),
        }
        self.state.server = f"https://{host}:{ports['apiserver']}"
        self.state.kubeconfig = str(self.kubeconfig_path)
        config_dir = self.work_dir / "config"
        config_dir.mkdir(exist_ok=True)
        kubeconfigs = self._write_kubeconfigs(config_dir)

        self._start_etcd(ports)
        self._start_apiserver(ports)
        self.timings["start_to_readyz_s"] = time.monotonic() - t0
        self._run(
            "kube-controller-manager",
            [
                f"--kubeconfig={kubeconfigs['controller-manager']}",
                f"--authentication-kubeconfig={kubeconfigs['controller-manager']}",
                f"--authorization-kubeconfig={kubeconfigs['controller-manager']}",
                "--bind-address=127.0.0.1",
                f"--secure-port={ports['controller-manager']}",
                f"--cert-dir={self.work_dir / 'controller-manager'}",
                f"--service-account-private-key-file={self.pki.service_account_key}",
                f"--root-ca-file={self.pki.ca.cert}",
                "--use-service-account-credentials=true",
                f"--cluster-signing-cert-file={self.pki.ca.cert}",
                f"--cluster-signing-key-file={self.pki.ca.key}",
                "--leader-elect=false",
                "--controllers=*",
                f"--v={s.log_level}",
            ],
        )
        self._run(
            "kube-scheduler",
            [
                f"--kubeconfig={kubeconfigs['scheduler']}",
                f"--authentication-kubeconfig={kubeconfigs['scheduler']}",
                f"--authorization-kubeconfig={kubeconfigs['scheduler']}",
                "--bind-address=127.0.0.1",
                f"--secure-port={ports['scheduler']}",
                f"--cert-dir={self.work_dir / 'scheduler'}",
                "--leader-elect=false",
                f"--v={s.log_level}",
            ],
        )
        self._start_nodes(ports, kubeconfigs["kwok"], config_dir)
        self.timings["start_to_nodes_ready_s"] = time.monotonic() - t0
        self._start_kube_proxy(ports, kubeconfigs["kube-proxy"], config_dir)
        self._start_node_agent()
        self.api.wait_for(
            "the default ServiceAccount",
            lambda: self.api.get("/api/v1/namespaces/default/serviceaccounts/default"),
            timeout_s=s.start_timeout_s,
        )
        self.timings["start_to_ready_s"] = time.monotonic() - t0

    def _start_node_agent(self) -> None:
        """The node agent (``node_agent.py``): runs the pods bound to the simulated nodes."""
        assert self.state is not None
        proc = ManagedProcess(
            AGENT_NAME,
            agent_argv(self.work_dir),
            self.logs_dir / f"{AGENT_NAME}.log",
            env=self._env(),
            cgroup_procs=self.cgroup.procs_files(),
        )
        self.processes[AGENT_NAME] = proc
        record = proc.start()
        self.state.processes.append(record)
        self._save_state()
        self._wait(AGENT_NAME, "the node agent", lambda: agent_ready(self.work_dir, record.pid))

    def _write_kubeconfigs(self, config_dir: Path) -> dict[str, Path]:
        assert self.pki is not None and self.state is not None
        paths = {}
        for client in CLIENTS:
            if client.name == "front-proxy":
                continue
            pair = self.pki.clients[client.name]
            path = (
                self.kubeconfig_path
                if client.name == "admin"
                else config_dir / f"{client.name}.kubeconfig"
            )
            write_kubeconfig(
                path,
                kubeconfig(
                    server=self.state.server,
                    ca=self.pki.ca.cert,
                    user=client.user,
                    cert=pair.cert,
                    key=pair.key,
                    context=self.settings.name,
                ),
            )
            paths[client.name] = path
        return paths

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in PROXY_VARIABLES}
        path = env.get("PATH", "/usr/bin:/bin")
        for d in ("/usr/sbin", "/sbin"):
            if d not in path.split(":"):
                path = f"{path}:{d}"
        env["PATH"] = path
        return env

    def _run(self, name: str, args: list[str]) -> ManagedProcess:
        assert self.tools is not None and self.state is not None
        proc = ManagedProcess(
            name,
            [str(self.tools.path(name)), *args],
            self.logs_dir / f"{name}.log",
            env=self._env(),
            cgroup_procs=self.cgroup.procs_files(),
        )
        self.processes[name] = proc
        self.state.processes.append(proc.start())
        self._save_state()
        return proc

    def _wait(self, name: str, what: str, check: Callable[[], Any]) -> Any:
        """Wait for ``check`` while the component ``name`` runs; its log tail comes with a failure."""
        proc = self.processes[name]

        def still_running() -> None:
            if not proc.alive():
                raise RuntimeError(
                    f"{name} exited (code {proc.exit_code()}) before {what}; "
                    f"log {proc.log_path}:\n{proc.tail()}"
                )

        return wait_for(
            what,
            check,
            timeout_s=self.settings.start_timeout_s,
            interval_s=0.1,
            guard=still_running,
            context=lambda: f"; log {proc.log_path}:\n{proc.tail()}",
        )

    def _start_etcd(self, ports: dict[str, int]) -> None:
        client = f"http://127.0.0.1:{ports['etcd']}"
        peer = f"http://127.0.0.1:{ports['etcd-peer']}"
        self._run(
            "etcd",
            [
                "--name=conveyor",
                f"--data-dir={self.work_dir / 'etcd'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=conveyor={peer}",
                # The data is thrown away at each start: no fsync, far quicker on a busy disk.
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
        )

        def healthy() -> bool:
            with urllib.request.urlopen(f"{client}/health", timeout=2) as resp:
                return json.loads(resp.read()).get("health") == "true"

        self._wait("etcd", "etcd /health", healthy)

    def _start_apiserver(self, ports: dict[str, int]) -> None:
        assert self.pki is not None
        host = self.host_address
        kubelet = self.pki.clients["apiserver-kubelet"]
        front_proxy = self.pki.clients["front-proxy"]
        self._run(
            "kube-apiserver",
            [
                f"--etcd-servers=http://127.0.0.1:{ports['etcd']}",
                f"--bind-address={host}",
                f"--advertise-address={host}",
                f"--secure-port={ports['apiserver']}",
                f"--tls-cert-file={self.pki.apiserver.cert}",
                f"--tls-private-key-file={self.pki.apiserver.key}",
                f"--client-ca-file={self.pki.ca.cert}",
                f"--kubelet-client-certificate={kubelet.cert}",
                f"--kubelet-client-key={kubelet.key}",
                "--authorization-mode=Node,RBAC",
                # Reach the simulated nodes' kubelet API (kwok: logs, port-forward) at their
                # InternalIP, the bridge's host address; their hostnames resolve nowhere.
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                f"--requestheader-client-ca-file={self.pki.ca.cert}",
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={front_proxy.cert}",
                f"--proxy-client-key-file={front_proxy.key}",
                # In addition to the default plugins: NodeRestriction as kubeadm enables it, and
                # ExtendedResourceToleration so that pods requesting nvidia.com/gpu tolerate the
                # GPU nodes' taint, as on managed GPU clusters.
                "--enable-admission-plugins=NodeRestriction,ExtendedResourceToleration",
                f"--service-cluster-ip-range={self.plan.service_cidr}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={self.pki.service_account_pub}",
                f"--service-account-signing-key-file={self.pki.service_account_key}",
                "--allow-privileged=true",
                "--profiling=false",
                f"--cert-dir={self.work_dir / 'apiserver'}",
                f"--v={self.settings.log_level}",
            ],
        )
        self._wait("kube-apiserver", "/readyz", lambda: self.api.readyz()[0])

    def _start_nodes(self, ports: dict[str, int], kwok_kubeconfig: Path, config_dir: Path) -> None:
        assert self.pki is not None
        s = self.settings
        stages = config_dir / "kwok-stages.yaml"
        stages.write_text(yaml.safe_dump_all(kwok_stages(), sort_keys=False))
        install_crds(self.api)  # kwok serves `kubectl logs`/`port-forward` from these (node agent)
        self._run(
            "kwok",
            [
                f"--kubeconfig={kwok_kubeconfig}",
                f"--config={stages}",
                "--manage-all-nodes=false",
                "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                f"--node-ip={self.host_address}",
                f"--node-port={ports['kwok']}",
                f"--server-address={self.host_address}:{ports['kwok']}",
                # Serves the kubelet API (logs, port-forward) on the same address as the
                # apiserver, so its certificate fits.
                f"--tls-cert-file={self.pki.apiserver.cert}",
                f"--tls-private-key-file={self.pki.apiserver.key}",
                "--node-lease-duration-seconds=40",
                f"--enable-crds={','.join(KWOK_CRDS)}",
            ],
        )
        gpu, cpu = self.node_names()
        share = MachineShare.of_this_machine(len(gpu) + len(cpu))
        version = pinned_version("k8s.io/kubernetes")
        common = {
            "share": share,
            "address": self.host_address,
            "kubelet_port": ports["kwok"],
            "max_pods": s.max_pods_per_node,
            "kubernetes_version": version,
        }
        for name in gpu:
            self.api.create(
                "/api/v1/nodes",
                node_manifest(
                    name,
                    gpus=s.gpus_per_node,
                    gpu_product=s.gpu_product,
                    gpu_memory_mib=s.gpu_memory_mib,
                    **common,
                ),
            )
        for name in cpu:
            self.api.create("/api/v1/nodes", node_manifest(name, **common))

        def ready(node: dict) -> bool:
            conditions = node["status"].get("conditions", [])
            taints = node["spec"].get("taints", [])
            return any(
                c["type"] == "Ready" and c["status"] == "True" for c in conditions
            ) and not any(t["key"].startswith("node.kubernetes.io/") for t in taints)

        def all_ready() -> bool:
            # Ready, and the node lifecycle controller has lifted its not-ready taint (until
            # then the scheduler would leave pods Pending).
            nodes = self.api.get("/api/v1/nodes")["items"]
            return {n["metadata"]["name"] for n in nodes if ready(n)} >= set(gpu + cpu)

        self._wait("kwok", "every node Ready and without not-ready taints", all_ready)

    def _start_kube_proxy(
        self, ports: dict[str, int], proxy_kubeconfig: Path, config_dir: Path
    ) -> None:
        _, cpu = self.node_names()
        config = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "mode": "nftables",
            "clientConnection": {"kubeconfig": str(proxy_kubeconfig)},
            "hostnameOverride": cpu[0] if cpu else self.node_names()[0][0],
            "bindAddress": self.host_address,
            "healthzBindAddress": f"127.0.0.1:{ports['proxy-healthz']}",
            "metricsBindAddress": f"127.0.0.1:{ports['proxy-metrics']}",
            "clusterCIDR": str(self.plan.pod_cidr),
            "detectLocalMode": "ClusterCIDR",
            "nodePortAddresses": [f"{self.host_address}/32"],
            # Zero leaves the host's conntrack sysctls as they are.
            "conntrack": {
                "maxPerCore": 0,
                "min": 0,
                "tcpEstablishedTimeout": "0s",
                "tcpCloseWaitTimeout": "0s",
                "udpTimeout": "0s",
                "udpStreamTimeout": "0s",
            },
        }
        path = config_dir / "kube-proxy.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        self._run("kube-proxy", [f"--config={path}", f"--v={self.settings.log_level}"])
        service_ip = str(self.plan.kubernetes_service_ip)

        def kubernetes_service_routed() -> bool:
            if ("ip", "kube-proxy") not in nft_tables():
                return False
            return service_ip in run("nft", "list", "table", "ip", "kube-proxy").stdout

        self._wait("kube-proxy", f"kube-proxy's rules for {service_ip}", kubernetes_service_routed)

    def _save_state(self) -> None:
        assert self.state is not None
        path = self.work_dir / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state.to_json(), indent=2))
        tmp.replace(path)

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
                self.processes[record.name] = ManagedProcess.adopt(
                    record, self.logs_dir / f"{record.name}.log"
                )
        teardown(self.state, self.settings.stop_grace_s, list(reversed(self.processes.values())))
        (self.work_dir / STATE_FILE).unlink(missing_ok=True)
        self.processes.clear()
        self.state = None
        self._api = None

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


def teardown(state: ClusterState, grace_s: float, processes: list[ManagedProcess]) -> None:
    """End the processes, then remove pod networks, the cgroup and the host network."""
    errors = []
    for proc in processes:
        try:
            proc.stop(grace_s)
        except RuntimeError as exc:
            errors.append(str(exc))
    plan = state.plan()
    if state.settings:  # the node agent's pods: mounts, cgroups, files
        sweep_node_agent(ClusterSettings.from_json(state.settings).work_dir(), state.name)
    PodNetworks(plan).sweep()
    ClusterCgroup(state.name).remove()
    HostNetwork(plan, state.network).stop()
    if errors:
        raise RuntimeError("; ".join(errors))


def clean_leftovers(state_root: Path) -> None:
    """Undo what crashed clusters left; refuse to start beside a cluster that still runs."""
    for state_file in sorted(state_root.glob(f"*/{STATE_FILE}")):
        state = ClusterState.from_json(json.loads(state_file.read_text()))
        if alive := state.alive():
            names = ", ".join(f"{p.name} (pid {p.pid})" for p in alive)
            raise ClusterAlreadyRunning(
                f"cluster {state.name!r} is running ({names}); one cluster runs per machine. "
                f"Use it (export KUBECONFIG={state.kubeconfig}) or stop it: conveyor cluster down --name {state.name}"
            )
        teardown(state, 0.0, [])
        state_file.unlink()


def kubectl(
    cluster: Cluster, *args: str, check: bool = True, input_: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the built kubectl against the cluster."""
    assert cluster.tools is not None
    return subprocess.run(
        [str(cluster.tools.path("kubectl")), f"--kubeconfig={cluster.kubeconfig_path}", *args],
        capture_output=True,
        text=True,
        check=check,
        input=input_,
    )
