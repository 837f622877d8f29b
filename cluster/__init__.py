"""The one-machine Kubernetes cluster (``conveyor.cluster``).

Upstream control-plane binaries built from pinned Go modules (``build-tools.sh``), started
and stopped as one object (``Cluster``), simulated GPU nodes kept alive by kwok, and a pod
network of network namespaces on a bridge (``PodNetworks``), which the node agent uses.
"""

from conveyor.cluster.cluster import Cluster
from conveyor.cluster.podnet import PodNetwork, PodNetworks
from conveyor.cluster.settings import ClusterSettings
from conveyor.cluster.teardown import ClusterAlreadyRunning

__all__ = ["Cluster", "ClusterAlreadyRunning", "ClusterSettings", "PodNetwork", "PodNetworks"]
