"""The one-machine cluster's settings: one dataclass, parsed once by the CLI or built by a caller.

These are the settings of the cluster as a whole (nodes, address ranges, where its work
directory is, the images its nodes hold, timeouts of its components).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path


def default_state_root() -> Path:
    """Where clusters keep their work directories (certificates, data, logs)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "conveyor" / "clusters"


@dataclass(frozen=True)
class ClusterSettings:
    """How the one-machine cluster is laid out. Values derived at start live in ``ClusterState``."""

    name: str = "conveyor"
    """Name of the cluster; its work directory is ``state_root/name``. One cluster runs per machine
    (kube-proxy owns a fixed nftables table), so the name only separates work directories."""

    state_root: Path = field(default_factory=default_state_root)
    """Root of the work directories (default ``$XDG_STATE_HOME/conveyor/clusters``), outside the
    checkout so that logs of a failed run survive a ``git clean``."""

    tools_dir: Path | None = None
    """Directory holding the built binaries; ``None`` runs ``cluster/build-tools.sh`` (which exits at
    once when the pinned tools are already built, and waits for a build that is running)."""

    gpu_nodes: int = 2
    """GPU nodes (their GPUs are fake devices); two, so that scheduling across nodes is exercised."""

    gpus_per_node: int = 8
    """``nvidia.com/gpu`` each GPU node advertises; 8, as on the common 8-GPU cloud machines."""

    gpu_product: str = "NVIDIA-H100-80GB-HBM3"
    """Value of the ``nvidia.com/gpu.product`` label, spelled as GPU feature discovery writes it."""

    gpu_memory_mib: int = 81559
    """Value of the ``nvidia.com/gpu.memory`` label, in MiB, as GPU feature discovery reports an H100."""

    cpu_nodes: int = 1
    """Untainted nodes without GPUs, for the gateway, the operator and Prometheus."""

    node_images: tuple[str, ...] = ()
    """OCI layouts or archives imported into each node's containerd at start (pods name them
    with ``imagePullPolicy: Never``; nothing is pulled). The pause image is always there."""

    max_pods_per_node: int = 110
    """Pods each node accepts; 110 is the kubelet's default."""

    pod_cidr: str = "198.18.0.0/20"
    """This cluster's slice of the pod network 198.18.0.0/16; its first address is the bridge's
    host address, where the apiserver listens. A /20 gives 4093 pod addresses."""

    service_cidr: str = "198.19.0.0/20"
    """Service ClusterIP range, inside 198.19.0.0/16; a /20 is the most the apiserver allows by
    default and far more than a test needs."""

    guard_cidr: str = "198.18.0.0/15"
    """Covered by an ``unreachable`` route before anything else, so that traffic to a pod or
    Service address that does not exist fails here instead of leaving the machine."""

    bridge: str = "conveyor0"
    """Name of the host bridge the pods' veth pairs join (at most 15 characters)."""

    start_timeout_s: float = 120.0
    """Seconds each component may take to become ready; generous because the two cores of a
    build machine may be busy compiling when the cluster starts."""

    stop_grace_s: float = 10.0
    """Seconds between SIGTERM and SIGKILL when stopping a component."""

    log_level: int = 1
    """``-v`` of the Kubernetes components; 1 keeps the logs useful and small."""

    def work_dir(self) -> Path:
        """This cluster's work directory."""
        return self.state_root / self.name

    def to_json(self) -> dict:
        """The settings as JSON values (kept in the cluster's state, so others can attach)."""
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict) -> ClusterSettings:
        """Settings written by ``to_json`` (unknown keys ignored)."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        if "node_images" in values:
            values["node_images"] = tuple(values["node_images"])
        for key in ("state_root", "tools_dir"):
            if values.get(key) is not None:
                values[key] = Path(values[key])
        return cls(**values)
