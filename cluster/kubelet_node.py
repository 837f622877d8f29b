"""One real node (the opt-in node runtime ``kubelet``): its containerd, kubelet and fake GPU
device plugin, started and stopped as one owner; the configurations come from ``kubelet_config``.

``start``: directories, client certificate and kubeconfig, cgroup root in every hierarchy,
containerd's root cloned from the seed that holds the images (``node_seed``), containerd (in
the node's private mount namespace), the kubelet (joining that namespace), the device plugin; then waits for
the Node to be Ready (and to offer its GPUs). ``stop`` undoes it in the order that leaves
nothing: the node's pods deleted (the kubelet stops their sandboxes, CNI DEL included), the
kubelet stopped, what containers remain killed and removed through ``ctr``, containerd
stopped, any mount under the node's directory unmounted, the cgroup trees removed deepest
first, the node's directory removed (its containerd root with it), the Node object deleted.
``sweep_real_node`` is the part of it that needs no process (after a crash).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from conveyor.cluster.api import ApiClient, ApiError, kubeconfig, wait_for, write_kubeconfig
from conveyor.cluster.certs import KeyPair
from conveyor.cluster.cgroups import CGROUP_ROOT, ClusterCgroup
from conveyor.cluster.components import Components
from conveyor.cluster.kubelet_config import (
    CRI_NAMESPACE,
    HARD_CODED_DIRS,
    KubeletInputs,
    NodeLayout,
    containerd_config,
    device_plugin_argv,
    join_namespace_argv,
    kubelet_argv,
    kubelet_config,
    namespace_argv,
)
from conveyor.cluster.node_images import PAUSE_IMAGE
from conveyor.cluster.node_seed import clone_root
from conveyor.cluster.nodes import GPU_RESOURCE, node_labels, node_ready
from conveyor.cluster.tools import BUILD_SCRIPT

NODE_BINARIES = ("kubelet", "fake-gpu-plugin")


def build_node_tools() -> Path:
    """Build (or find) the real nodes' binaries (``build-tools.sh --set node``); their directory."""
    proc = subprocess.run([str(BUILD_SCRIPT), "--set", "node"], stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{BUILD_SCRIPT} --set node failed (exit {proc.returncode})")
    directory = Path(proc.stdout.strip().splitlines()[-1])
    if missing := [b for b in NODE_BINARIES if not (directory / b).exists()]:
        raise RuntimeError(f"the node build left out {missing} in {directory}")
    return directory


HOST_TOOLS = ("containerd", "ctr", "runc", "unshare", "nsenter")
"""What real nodes run on the host (Debian packages: cluster/install-system-deps.sh)."""
CNI_BRIDGE = Path("/usr/lib/cni/bridge")


def missing_host_tools() -> str | None:
    """Why this machine cannot run real nodes (not root, a tool or the CNI plugins missing),
    as a message that says how to fix it; None when it can (the node tools are built on
    first use)."""
    if os.geteuid() != 0:
        return "real nodes need root (mounts, cgroups, network namespaces)"
    if missing := [t for t in HOST_TOOLS if shutil.which(t) is None]:
        return f"{', '.join(missing)} not installed: run cluster/install-system-deps.sh"
    if not CNI_BRIDGE.exists():
        return "the CNI plugins are not installed: run cluster/install-system-deps.sh"
    return None


def node_tools_built() -> Path | None:
    """The node binaries' directory when they are built, else ``None`` (builds nothing)."""
    proc = subprocess.run(
        [str(BUILD_SCRIPT), "--set", "node", "--print-dir"], capture_output=True, text=True
    )
    directory = Path(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
    if directory and all((directory / b).exists() for b in NODE_BINARIES):
        return directory
    return None


def issue_node_certificate(ca: KeyPair, node: str, directory: Path) -> KeyPair:
    """A client certificate for ``system:node:<node>`` (group ``system:nodes``) signed by ``ca``."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert.read_bytes())
    ca_key = serialization.load_pem_private_key(ca.key.read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:nodes"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"system:node:{node}"),
        ]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    pair = KeyPair(directory / "node.crt", directory / "node.key")
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pair.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    os.chmod(pair.key, 0o600)
    return pair


class NodeCgroups(ClusterCgroup):
    """The kubelet's ``cgroupRoot`` in every hierarchy (cgroup v1: each controller; v2: one);
    listed and removed as the cluster's own cgroup is."""

    def __init__(self, cgroup_root: str, *, root: Path = CGROUP_ROOT) -> None:
        self.root = root
        if (root / "cgroup.controllers").exists():
            hierarchies = [root]
        else:
            # v1 hybrid: every controller's hierarchy, the named ``systemd`` one and the
            # ``unified`` v2 one included (the kubelet makes its tree in each).
            hierarchies = sorted(h for h in root.iterdir() if (h / "cgroup.procs").exists())
        self.dirs = [h / cgroup_root.lstrip("/") for h in hierarchies]

    def create(self) -> None:
        """Make the directories; a v1 cpuset child starts empty, so it gets its parent's sets."""
        for d in self.dirs:
            d.mkdir(exist_ok=True)
            for name in ("cpuset.cpus", "cpuset.mems"):
                if (d / name).exists() and not (d / name).read_text().strip():
                    (d / name).write_text((d.parent / name).read_text())

    def existing(self) -> list[str]:
        return [str(d) for d in self.dirs if d.exists()]

    def remove(self, grace_s: float = 10.0) -> None:
        """SIGKILL what is left inside, then rmdir every directory, deepest first."""
        super().remove(grace_s)


def mounts_under(root: Path) -> list[str]:
    """Mount points of this mount namespace at or under ``root``, deepest first."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == str(root) or point.startswith(f"{root}/"):
            found.append(point)
    return sorted(found, key=lambda p: -len(p))


def sweep_real_node(layout: NodeLayout) -> None:
    """What needs no running process: kill and remove the node's cgroups, unmount its mounts,
    remove its directory (the containerd root cloned from the seed included)."""
    NodeCgroups(layout.cgroup_root).remove()
    for point in mounts_under(layout.root):
        subprocess.run(["umount", "-l", point], check=True)
    if layout.root.exists():
        shutil.rmtree(layout.root)


@dataclass(frozen=True)
class RealNodeInputs:
    """What one real node is started with, beyond its kubelet configuration."""

    kubelet: KubeletInputs
    server: str
    ca: KeyPair
    tools: Path
    """Directory of ``NODE_BINARIES``."""
    cni: dict
    seed: Path
    """A containerd root holding the images, the pause image among them (``node_seed``)."""
    gpu_product: str = ""
    gpu_memory_mib: int = 0
    log_level: int = 1


class KubeletNode:
    """One real node's processes, kept by the cluster's ``Components`` (so ``down`` finds them)."""

    def __init__(self, layout: NodeLayout, components: Components, api: ApiClient) -> None:
        self.layout = layout
        self.components = components
        self.api = api
        self.timings: dict[str, float] = {}

    def process_name(self, what: str) -> str:
        return f"{what}-{self.layout.name}"

    def start(self, i: RealNodeInputs) -> None:
        """Clone containerd's root from the seed, start containerd, the kubelet and the device
        plugin; wait Ready."""
        lay, t0 = self.layout, time.monotonic()
        sweep_real_node(lay)  # what a crashed run left; the directory is made anew
        clone_root(i.seed, lay.containerd_root)
        self.timings["clone_s"] = time.monotonic() - t0
        for d in (lay.root, lay.kubelet_root, lay.cni_conf_dir, *lay.own_dirs(), lay.pod_logs):
            d.mkdir(parents=True, exist_ok=True)
        for d in HARD_CODED_DIRS:  # mount points for the node's own directories
            d.mkdir(parents=True, exist_ok=True)
        cert = issue_node_certificate(i.ca, lay.name, lay.root / "pki")
        node_kubeconfig = lay.root / "kubelet.kubeconfig"
        write_kubeconfig(
            node_kubeconfig,
            kubeconfig(
                server=i.server,
                ca=i.ca.cert,
                user=f"system:node:{lay.name}",
                cert=cert.cert,
                key=cert.key,
                context=lay.name,
            ),
        )
        NodeCgroups(lay.cgroup_root).create()
        (lay.cni_conf_dir / "10-conveyor.conflist").write_text(json.dumps(i.cni, indent=2))
        config = lay.root / "containerd.toml"
        config.write_text(containerd_config(lay, sandbox_image=PAUSE_IMAGE))
        containerd = self.components.start(
            self.process_name("containerd"),
            namespace_argv(lay, ["containerd", "--config", str(config)]),
        )
        self.components.wait(containerd.name, "containerd's socket", self._ctr_ready)
        self.timings["containerd_s"] = time.monotonic() - t0

        kubelet_yaml = lay.root / "kubelet.yaml"
        kubelet_yaml.write_text(yaml.safe_dump(kubelet_config(i.kubelet), sort_keys=False))
        labels = node_labels(
            gpus=i.kubelet.gpus, gpu_product=i.gpu_product, gpu_memory_mib=i.gpu_memory_mib
        )
        argv = kubelet_argv(
            i.tools / "kubelet",
            i.kubelet,
            config=kubelet_yaml,
            kubeconfig=node_kubeconfig,
            labels=labels,
            log_level=i.log_level,
        )
        assert containerd.record is not None
        kubelet = self.components.start(
            self.process_name("kubelet"), join_namespace_argv(containerd.record.pid, argv)
        )
        if i.kubelet.gpus:
            self.components.start(
                self.process_name("gpu-plugin"),
                device_plugin_argv(i.tools / "fake-gpu-plugin", lay, i.kubelet.gpus),
            )
        self.components.wait(kubelet.name, f"node {lay.name} Ready", lambda: self._ready(i))
        self.timings["start_to_ready_s"] = time.monotonic() - t0

    def _ctr_ready(self) -> bool:
        if not self.layout.containerd_socket.exists():
            return False
        return self._ctr("version", namespaced=False).returncode == 0

    def _ready(self, i: RealNodeInputs) -> bool:
        node = self.api.get(f"/api/v1/nodes/{self.layout.name}")
        if not node_ready(node):
            return False
        gpus = node["status"].get("allocatable", {}).get(GPU_RESOURCE, "0")
        return int(gpus) == i.kubelet.gpus

    def _ctr(self, *args: str, namespaced: bool = True) -> subprocess.CompletedProcess[str]:
        ns = ("-n", CRI_NAMESPACE) if namespaced else ()
        argv = ["ctr", "-a", str(self.layout.containerd_socket), *ns, *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=30)

    def stop(self, grace_s: float) -> None:
        """Undo ``start`` in the order that leaves nothing (see the module's docstring)."""
        name = self.layout.name
        procs = self.components.processes
        kubelet = procs.get(self.process_name("kubelet"))
        if kubelet is not None and kubelet.alive() and self._api_up():
            self._delete_pods(grace_s)
        for what in ("gpu-plugin", "kubelet"):
            if (proc := procs.get(self.process_name(what))) is not None:
                proc.stop(grace_s)
        containerd = procs.get(self.process_name("containerd"))
        if containerd is not None and containerd.alive():
            self._remove_containers()
            containerd.stop(grace_s)
        sweep_real_node(self.layout)
        if self._api_up():
            with contextlib.suppress(ApiError):
                self.api.delete(f"/api/v1/nodes/{name}")

    def _api_up(self) -> bool:
        return self.api.readyz()[0]

    def _delete_pods(self, grace_s: float) -> None:
        """Delete the node's pods and wait (at most ``grace_s`` more) until its kubelet has
        stopped every sandbox, so that CNI gives their addresses and veths back."""
        selector = f"spec.nodeName={self.layout.name}"
        for pod in self.api.get("/api/v1/pods", fieldSelector=selector)["items"]:
            meta = pod["metadata"]
            with contextlib.suppress(ApiError):
                self.api.request(
                    "DELETE",
                    f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                    query={"gracePeriodSeconds": "0"},
                )
        with contextlib.suppress(TimeoutError):
            wait_for("the node's sandboxes to stop", self._no_running_tasks, timeout_s=grace_s)

    def _no_running_tasks(self) -> bool:
        out = self._ctr("tasks", "ls", "-q")
        return out.returncode == 0 and not out.stdout.strip()

    def _remove_containers(self) -> None:
        """Kill and remove what the kubelet left in containerd (sandboxes, containers)."""
        for task in self._ctr("tasks", "ls", "-q").stdout.split():
            self._ctr("tasks", "kill", "-s", "SIGKILL", task)
            self._ctr("tasks", "rm", "-f", task)
        for container in self._ctr("containers", "ls", "-q").stdout.split():
            self._ctr("containers", "rm", container)
