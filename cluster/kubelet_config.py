"""A real node's configuration (the opt-in node runtime ``kubelet``): pure builders, no I/O.

Each node runs its own containerd (a kubelet removes the containers it does not know in its
runtime's namespace, so nodes cannot share one) and its own kubelet, with a root directory,
ports, cgroup root, client certificate and CNI configuration of its own. What the kubelet
hard-codes (the device-plugin directory ``/var/lib/kubelet/device-plugins``, the container log
links in ``/var/log/containers``; containerd's shims ``/run/containerd``) is made per node by a private mount namespace that the
node's containerd starts in and its kubelet joins (``namespace_argv``): the node's own
directories are bind-mounted over those paths there, and every mount the kubelet makes
(its root directory, the pods' volumes) stays in that namespace and ends with it.
"""

from __future__ import annotations

import ipaddress
import shlex
from dataclasses import dataclass
from pathlib import Path

from conveyor.cluster.dns import DOMAIN
from conveyor.cluster.nodes import GPU_RESOURCE, MachineShare

HARD_CODED_DIRS = (
    Path("/var/lib/kubelet/device-plugins"),
    Path("/var/log/containers"),
    Path("/run/containerd"),
)
"""Paths the kubelet (the first two) and containerd 1.6's shims (their sockets, runc's state)
use whatever they are configured with; each node gets its own in its namespace. The empty
directories are made on the host once, as mount points, and left there."""

CNI_BIN_DIR = Path("/usr/lib/cni")
"""Where Debian's ``containernetworking-plugins`` puts bridge, host-local and loopback."""

CRI_NAMESPACE = "k8s.io"
"""The containerd namespace of the CRI plugin (what ``ctr -n`` names at teardown)."""

DEVICE_PLUGIN_SOCKET = "conveyor-fake-gpu.sock"


@dataclass(frozen=True)
class NodeLayout:
    """Where one real node keeps everything, and its names on the host."""

    cluster: str
    name: str
    root: Path
    """The node's directory, inside the cluster's work directory."""

    @property
    def kubelet_root(self) -> Path:
        return self.root / "kubelet"

    @property
    def containerd_root(self) -> Path:
        return self.root / "containerd"

    @property
    def containerd_state(self) -> Path:
        return self.root / "containerd-state"

    @property
    def containerd_socket(self) -> Path:
        return self.root / "containerd.sock"

    @property
    def cni_conf_dir(self) -> Path:
        return self.root / "cni"

    @property
    def ipam_dir(self) -> Path:
        return self.root / "cni-ipam"

    @property
    def device_plugins(self) -> Path:
        """Mounted over ``/var/lib/kubelet/device-plugins`` in the node's namespace."""
        return self.root / "device-plugins"

    @property
    def container_logs(self) -> Path:
        """Mounted over ``/var/log/containers`` in the node's namespace."""
        return self.root / "container-logs"

    @property
    def pod_logs(self) -> Path:
        return self.root / "pod-logs"

    @property
    def cgroup_root(self) -> str:
        """The kubelet's ``cgroupRoot``: one flat directory per node in every v1 hierarchy."""
        return f"/conveyor-{self.cluster}-{self.name}"

    def own_dirs(self) -> tuple[Path, ...]:
        """The node's directories bind-mounted over ``HARD_CODED_DIRS``, in that order."""
        return (self.device_plugins, self.container_logs, self.root / "run-containerd")


def node_subnet(
    pod_cidr: ipaddress.IPv4Network, index: int, prefix: int = 24
) -> ipaddress.IPv4Network:
    """The ``index``-th node's slice of the pod range, counted from the top (the bottom holds
    the bridge's host address, where the apiserver and CoreDNS listen)."""
    subnets = list(pod_cidr.subnets(new_prefix=prefix))
    if index >= len(subnets) - 1:
        raise ValueError(f"{pod_cidr} has no room for node {index} (/{prefix} each)")
    return subnets[-1 - index]


def cni_config(
    *,
    bridge: str,
    pod_cidr: ipaddress.IPv4Network,
    subnet: ipaddress.IPv4Network,
    gateway: ipaddress.IPv4Address,
    ipam_dir: Path,
) -> dict:
    """A CNI conflist: the pod joins the cluster's existing bridge with an address from the
        node's slice (``subnet``) and the mask of the whole pod range, so that every other pod is
        on-link; its gateway is the bridge's host address (the bridge is not made a gateway again:
        it has that address already); host-local keeps its leases in the node's ``ipam_dir`` (not
    the shared ``/var/lib/cni``). Then loopback."""
    allocation = {
        "subnet": str(pod_cidr),
        "rangeStart": str(subnet.network_address + 1),
        "rangeEnd": str(subnet.broadcast_address - 1),
        "gateway": str(gateway),
    }
    return {
        "cniVersion": "0.4.0",
        "name": "conveyor",
        "plugins": [
            {
                "type": "bridge",
                "bridge": bridge,
                "isGateway": False,
                "isDefaultGateway": False,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "dataDir": str(ipam_dir),
                    "ranges": [[allocation]],
                    "routes": [{"dst": "0.0.0.0/0", "gw": str(gateway)}],
                },
            },
            {"type": "loopback"},
        ],
    }


def containerd_config(layout: NodeLayout, *, sandbox_image: str) -> str:
    """containerd 1.6's ``config.toml`` (version 2) for one node.

    ``restrict_oom_score_adj``: without CAP_SYS_RESOURCE runc fails ("can't get final child's
    PID from pipe") when asked to lower a score. The pods' network namespaces are kept in the
    node's state directory (not ``/var/run/netns``). The CRI streaming server takes a free port on
    loopback (its default, 10010, would be shared by every node). Plugins that would write
    outside the node's directories or probe for other filesystems are off.
    """
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{layout.containerd_root}"
state = "{layout.containerd_state}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{layout.containerd_socket}"

[plugins."io.containerd.internal.v1.opt"]
  path = "{layout.containerd_root / "opt"}"

[{cri}]
  sandbox_image = "{sandbox_image}"
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  netns_mounts_under_state_dir = true
  enable_selinux = false
  disable_apparmor = true

[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false

[{cri}.cni]
  bin_dir = "{CNI_BIN_DIR}"
  conf_dir = "{layout.cni_conf_dir}"
  max_conf_num = 1
"""


@dataclass(frozen=True)
class KubeletInputs:
    """What a node's kubelet configuration is made from."""

    layout: NodeLayout
    address: str
    """The bridge's host address: the node's InternalIP, where its kubelet API listens."""
    port: int
    healthz_port: int
    client_ca: Path
    share: MachineShare
    machine: MachineShare
    """The whole machine (the kubelet's capacity); what is not the node's share is reserved."""
    max_pods: int
    gpus: int = 0


def kubelet_config(i: KubeletInputs) -> dict:
    """The KubeletConfiguration of one node.

    cgroup v1 hosts need ``failCgroupV1: false``; ``cgroupfs`` because there is no systemd
    here; ``makeIPTablesUtilChains: false`` (the kubelet's chains would outlive it, and
    kube-proxy runs in nftables mode). The node's slice of the machine is what remains after
    ``systemReserved``, enforced on the pods' cgroup. Eviction thresholds are tiny: a
    development machine's nearly full disk must not taint every node.
    """
    lay = i.layout
    reserved_cpu = max(i.machine.cpu_millis - i.share.cpu_millis, 0)
    reserved_mem = max(i.machine.memory_bytes - i.share.memory_bytes, 0)
    config: dict = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": lay.cgroup_root,
        "cgroupsPerQOS": True,
        "enforceNodeAllocatable": ["pods"],
        "systemReserved": {"cpu": f"{reserved_cpu}m", "memory": str(reserved_mem)},
        "address": i.address,
        "port": i.port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": i.healthz_port,
        "authentication": {
            "x509": {"clientCAFile": str(i.client_ca)},
            "webhook": {"enabled": False},
            "anonymous": {"enabled": False},
        },
        "authorization": {"mode": "AlwaysAllow"},
        "makeIPTablesUtilChains": False,
        "containerRuntimeEndpoint": f"unix://{lay.containerd_socket}",
        "podLogsDir": str(lay.pod_logs),
        "volumePluginDir": str(lay.kubelet_root / "volume-plugins"),
        "maxPods": i.max_pods,
        "failSwapOn": False,
        "registerNode": True,
        "staticPodPath": "",
        "serializeImagePulls": False,
        # The cluster's DNS (``dns.py``) on the bridge's host address; no host resolv.conf:
        # pods reach nothing outside, so the host's name servers and search path stay out.
        "resolvConf": "",
        "clusterDNS": [i.address],
        "clusterDomain": DOMAIN,
        "evictionHard": {
            "memory.available": "1Mi",
            "nodefs.available": "1Mi",
            "imagefs.available": "1Mi",
            "nodefs.inodesFree": "1",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        # The device plugin's GPUs show in the node's status at the next status sync: every
        # 2 s rather than 10 s, so that a GPU node offers them soon after it is Ready; a
        # status that did not change is still reported only once a minute.
        "nodeStatusUpdateFrequency": "2s",
        "nodeStatusReportFrequency": "1m",
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
    }
    if i.gpus:
        config["registerWithTaints"] = [{"key": GPU_RESOURCE, "effect": "NoSchedule"}]
    return config


def kubelet_argv(
    kubelet: Path,
    i: KubeletInputs,
    *,
    config: Path,
    kubeconfig: Path,
    labels: dict[str, str],
    log_level: int,
) -> list[str]:
    """The kubelet's command line (what its configuration file cannot say)."""
    lay = i.layout
    return [
        str(kubelet),
        f"--config={config}",
        f"--kubeconfig={kubeconfig}",
        f"--root-dir={lay.kubelet_root}",
        f"--cert-dir={lay.kubelet_root / 'pki'}",
        f"--hostname-override={lay.name}",
        f"--node-ip={i.address}",
        "--node-labels=" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())),
        f"-v={log_level}",
    ]


def namespace_argv(layout: NodeLayout, argv: list[str]) -> list[str]:
    """``argv`` started in a new private mount namespace with the node's own directories
    mounted over the paths the kubelet hard-codes (the node's containerd starts this way)."""
    binds = " && ".join(
        f"mount --bind {shlex.quote(str(own))} {shlex.quote(str(fixed))}"
        for own, fixed in zip(layout.own_dirs(), HARD_CODED_DIRS, strict=True)
    )
    script = f'{binds} && exec "$@"'
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "--",
        "/bin/sh",
        "-c",
        script,
        "node-namespace",
        *argv,
    ]


def join_namespace_argv(namespace_pid: int, argv: list[str]) -> list[str]:
    """``argv`` started in the mount namespace of ``namespace_pid`` (the node's containerd)."""
    return ["nsenter", f"--mount=/proc/{namespace_pid}/ns/mnt", "--", *argv]


def device_plugin_argv(plugin: Path, layout: NodeLayout, gpus: int) -> list[str]:
    """The fake GPU device plugin: serves in, and registers through, the node's own directory."""
    return [
        str(plugin),
        f"-dir={layout.device_plugins}",
        f"-count={gpus}",
        f"-resource={GPU_RESOURCE}",
        f"-socket={DEVICE_PLUGIN_SOCKET}",
    ]
