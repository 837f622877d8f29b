"""The one-machine Kubernetes cluster (``conveyor.cluster``).

Upstream control-plane binaries built from pinned Go modules (``build-tools.sh``), started
and stopped as one object (``Cluster``), and nodes that are upstream kubelets, each with its
own containerd and runc, running pods from OCI images on a bridge with fake GPUs
(``real_nodes``).
"""

from conveyor.cluster.cluster import Cluster
from conveyor.cluster.settings import ClusterSettings
from conveyor.cluster.teardown import ClusterAlreadyRunning

__all__ = ["Cluster", "ClusterAlreadyRunning", "ClusterSettings"]
