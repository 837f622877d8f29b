"""The cluster's nodes, as pure values: their names, their labels, their share of the machine,
and when one is Ready.

GPU nodes advertise ``nvidia.com/gpu`` (the fake device plugin), carry the labels GPU feature
discovery writes (``nvidia.com/gpu.product``, ``.memory``, ``.count``) and the
``nvidia.com/gpu:NoSchedule`` taint of managed GPU node pools; CPU nodes are untainted. Every
node's CPU and memory is this machine's, shared out evenly, so requests and limits mean
something. The kubelets themselves are ``kubelet_node.py``'s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

GPU_RESOURCE = "nvidia.com/gpu"
POOL_LABEL = "conveyor.dev/node-pool"


@dataclass(frozen=True)
class MachineShare:
    """One node's share of this machine."""

    cpu_millis: int
    memory_bytes: int

    @classmethod
    def of_this_machine(cls, nodes: int) -> MachineShare:
        """This machine's CPUs and memory divided evenly among ``nodes``."""
        cpus = len(os.sched_getaffinity(0))
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return cls(cpu_millis=cpus * 1000 // nodes, memory_bytes=memory // nodes)


def node_names(gpu_nodes: int, cpu_nodes: int) -> tuple[list[str], list[str]]:
    """Names of the GPU nodes and the CPU nodes."""
    return [f"gpu-node-{i}" for i in range(gpu_nodes)], [f"cpu-node-{i}" for i in range(cpu_nodes)]


def node_labels(*, gpus: int, gpu_product: str = "", gpu_memory_mib: int = 0) -> dict[str, str]:
    """The labels of a node's pool and GPUs; a kubelet registers its node with them
    (``--node-labels``)."""
    labels = {POOL_LABEL: "gpu" if gpus else "cpu"}
    if gpus:
        labels |= {
            f"{GPU_RESOURCE}.present": "true",
            f"{GPU_RESOURCE}.product": gpu_product,
            f"{GPU_RESOURCE}.memory": str(gpu_memory_mib),
            f"{GPU_RESOURCE}.count": str(gpus),
        }
    return labels


def node_ready(node: dict[str, Any]) -> bool:
    """Ready, and the node lifecycle controller has lifted its not-ready taints (until then the
    scheduler would leave pods Pending)."""
    conditions = node["status"].get("conditions", [])
    taints = node["spec"].get("taints", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions) and not any(
        t["key"].startswith("node.kubernetes.io/") for t in taints
    )
