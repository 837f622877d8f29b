"""Real nodes' configuration builders (``kubelet_config``), settings and certificate: no processes."""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from conveyor.cluster.certs import generate_pki
from conveyor.cluster.kubelet_config import (
    HARD_CODED_DIRS,
    KubeletInputs,
    NodeLayout,
    cni_config,
    containerd_config,
    kubelet_argv,
    kubelet_config,
    namespace_argv,
    node_subnet,
)
from conveyor.cluster.kubelet_node import NodeCgroups, issue_node_certificate
from conveyor.cluster.nodes import MachineShare, node_labels
from conveyor.cluster.real_nodes import node_layouts
from conveyor.cluster.settings import ClusterSettings
from conveyor.cluster.tools import BUILD_SCRIPT, GO_MODULES

POD_CIDR = ipaddress.IPv4Network("198.18.0.0/20")
GATEWAY = ipaddress.IPv4Address("198.18.0.1")


def layout(tmp_path: Path, name: str = "gpu-node-0") -> NodeLayout:
    return NodeLayout("realnode", name, tmp_path / "nodes" / name)


def inputs(tmp_path: Path, *, gpus: int = 8) -> KubeletInputs:
    return KubeletInputs(
        layout=layout(tmp_path),
        address=str(GATEWAY),
        port=10250,
        healthz_port=10248,
        client_ca=tmp_path / "pki" / "ca.crt",
        share=MachineShare(cpu_millis=1000, memory_bytes=4 * 2**30),
        machine=MachineShare(cpu_millis=4000, memory_bytes=16 * 2**30),
        max_pods=110,
        gpus=gpus,
    )


def test_each_node_gets_its_own_slice_of_the_pod_range_from_the_top() -> None:
    subnets = [node_subnet(POD_CIDR, i) for i in range(4)]
    assert [str(s) for s in subnets[:2]] == ["198.18.15.0/24", "198.18.14.0/24"]
    assert len(set(subnets)) == 4
    assert all(s.subnet_of(POD_CIDR) for s in subnets)
    # The bottom /24 stays for the bridge's host address.
    with pytest.raises(ValueError, match="no room"):
        node_subnet(POD_CIDR, 15)


def test_cni_joins_the_existing_bridge_with_the_node_range_and_the_cluster_gateway(
    tmp_path: Path,
) -> None:
    subnet = node_subnet(POD_CIDR, 0)
    conf = cni_config(
        bridge="conveyor0",
        pod_cidr=POD_CIDR,
        subnet=subnet,
        gateway=GATEWAY,
        ipam_dir=tmp_path / "ipam",
    )
    bridge, loopback = conf["plugins"]
    assert (bridge["type"], bridge["bridge"], bridge["isGateway"]) == ("bridge", "conveyor0", False)
    assert bridge["ipMasq"] is False
    (allocation,) = bridge["ipam"]["ranges"][0]
    assert allocation["subnet"] == str(POD_CIDR)  # every pod on-link over the bridge
    assert ipaddress.IPv4Address(allocation["rangeStart"]) in subnet
    assert ipaddress.IPv4Address(allocation["rangeEnd"]) in subnet
    assert allocation["gateway"] == str(GATEWAY)
    assert bridge["ipam"]["dataDir"] == str(tmp_path / "ipam")  # not the shared /var/lib/cni
    assert loopback == {"type": "loopback"}


def test_containerd_config_is_the_nodes_own_and_restricts_oom_score_adj(tmp_path: Path) -> None:
    lay = layout(tmp_path)
    config = tomllib.loads(containerd_config(lay, sandbox_image="registry.k8s.io/pause:3.10.1"))
    assert config["version"] == 2
    assert (config["root"], config["state"]) == (
        str(lay.containerd_root),
        str(lay.containerd_state),
    )
    assert config["grpc"]["address"] == str(lay.containerd_socket)
    cri = config["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["restrict_oom_score_adj"] is True  # runc fails without CAP_SYS_RESOURCE otherwise
    assert cri["sandbox_image"] == "registry.k8s.io/pause:3.10.1"
    assert cri["stream_server_port"] == "0"  # not 10010, shared by every node
    assert cri["netns_mounts_under_state_dir"] is True  # not the host's /var/run/netns
    assert cri["containerd"]["snapshotter"] == "overlayfs"
    assert cri["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"] is False
    assert cri["cni"]["conf_dir"] == str(lay.cni_conf_dir)
    assert config["plugins"]["io.containerd.internal.v1.opt"]["path"].startswith(str(lay.root))


def test_containerd_socket_paths_fit_a_unix_socket() -> None:
    for lay in node_layouts(ClusterSettings(name="realnode", gpu_nodes=8)):
        assert len(str(lay.containerd_socket)) < 100  # sun_path is 108 bytes; shims add a suffix


def test_kubelet_config_for_a_cgroup_v1_host_without_systemd(tmp_path: Path) -> None:
    i = inputs(tmp_path)
    config = kubelet_config(i)
    assert config["failCgroupV1"] is False
    assert config["cgroupDriver"] == "cgroupfs"
    assert config["cgroupRoot"] == "/conveyor-realnode-gpu-node-0"
    assert config["makeIPTablesUtilChains"] is False  # its chains would outlive it
    assert config["authentication"]["x509"]["clientCAFile"] == str(i.client_ca)
    assert config["authentication"]["anonymous"]["enabled"] is False
    assert config["authorization"]["mode"] == "AlwaysAllow"
    assert config["containerRuntimeEndpoint"] == f"unix://{i.layout.containerd_socket}"
    assert (config["port"], config["healthzPort"], config["readOnlyPort"]) == (10250, 10248, 0)
    assert config["staticPodPath"] == ""
    # Pods ask the cluster's DNS on the bridge's host address, never the host's resolvers.
    assert config["clusterDNS"] == [i.address] and config["clusterDomain"] == "cluster.local"
    assert config["resolvConf"] == ""
    # The node's slice: what is not its share of the machine is reserved.
    assert config["systemReserved"] == {"cpu": "3000m", "memory": str(12 * 2**30)}
    assert config["enforceNodeAllocatable"] == ["pods"]
    assert config["registerWithTaints"] == [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]
    paths = [config["podLogsDir"], config["volumePluginDir"]]
    assert all(p.startswith(str(i.layout.root)) for p in paths)


def test_cpu_nodes_are_untainted(tmp_path: Path) -> None:
    assert "registerWithTaints" not in kubelet_config(inputs(tmp_path, gpus=0))


def test_node_labels_name_the_pool_and_the_gpus_as_gpu_feature_discovery_does() -> None:
    gpu = node_labels(gpus=8, gpu_product="NVIDIA-H100-80GB-HBM3", gpu_memory_mib=81559)
    assert gpu == {
        "conveyor.dev/node-pool": "gpu",
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "nvidia.com/gpu.memory": "81559",
        "nvidia.com/gpu.count": "8",
    }
    # None of the labels a kubelet sets itself (it refuses to register with those).
    assert not any(k.startswith("kubernetes.io/") for k in gpu)
    assert node_labels(gpus=0) == {"conveyor.dev/node-pool": "cpu"}


def test_kubelet_argv_keeps_every_directory_under_the_node(tmp_path: Path) -> None:
    i = inputs(tmp_path)
    argv = kubelet_argv(
        Path("/bin/kubelet"),
        i,
        config=tmp_path / "k.yaml",
        kubeconfig=tmp_path / "k.kubeconfig",
        labels={"b": "2", "a": "1"},
        log_level=1,
    )
    flags = dict(a.split("=", 1) for a in argv[1:])
    assert flags["--root-dir"] == str(i.layout.kubelet_root)
    assert flags["--cert-dir"].startswith(str(i.layout.root))  # default: /var/lib/kubelet/pki
    assert flags["--hostname-override"] == "gpu-node-0"
    assert flags["--node-labels"] == "a=1,b=2"


def test_the_namespace_puts_the_nodes_directories_over_the_hard_coded_paths(
    tmp_path: Path,
) -> None:
    lay = layout(tmp_path)
    argv = namespace_argv(lay, ["containerd", "--config", "x"])
    assert argv[:5] == ["unshare", "--mount", "--propagation", "private", "--"]
    script = argv[7]
    for own, fixed in zip(lay.own_dirs(), HARD_CODED_DIRS, strict=True):
        assert f"mount --bind {own} {fixed}" in script
    assert argv[-3:] == ["containerd", "--config", "x"]


def test_node_images_survive_the_state_file() -> None:
    s = ClusterSettings(name="realnode", node_images=("/a.tar", "/b.oci"))
    assert ClusterSettings.from_json(s.to_json()) == s
    # A state file written before the node agent was removed still reads.
    assert ClusterSettings.from_json({**s.to_json(), "node_runtime": "agent"}) == s


def test_node_certificate_names_the_node_and_is_signed_by_the_cluster_ca(tmp_path: Path) -> None:
    pki = generate_pki(
        tmp_path / "pki",
        host_address=GATEWAY,
        service_ip=ipaddress.IPv4Address("198.19.0.1"),
        clients=[],
    )
    pair = issue_node_certificate(pki.ca, "gpu-node-0", tmp_path / "node")
    cert = x509.load_pem_x509_certificate(pair.cert.read_bytes())
    ca = x509.load_pem_x509_certificate(pki.ca.cert.read_bytes())
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == (
        "system:node:gpu-node-0"
    )
    assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "system:nodes"
    cert.verify_directly_issued_by(ca)
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    assert oct(pair.key.stat().st_mode & 0o777) == "0o600"


def test_node_cgroups_are_made_in_every_hierarchy_and_removed_deepest_first(
    tmp_path: Path,
) -> None:
    for h in ("cpu", "memory", "pids", "systemd", "unified"):
        (tmp_path / h).mkdir()
        (tmp_path / h / "cgroup.procs").write_text("")
    (tmp_path / "not-a-hierarchy").mkdir()
    cgroups = NodeCgroups("/conveyor-realnode-gpu-node-0", root=tmp_path)
    cgroups.create()
    assert len(cgroups.existing()) == 5
    (tmp_path / "pids" / "conveyor-realnode-gpu-node-0" / "kubepods" / "burstable").mkdir(
        parents=True
    )
    cgroups.remove()
    assert cgroups.existing() == []


@pytest.mark.skipif(shutil.which("go") is None, reason="the Go toolchain is not installed")
def test_the_node_tools_have_a_key_of_their_own(tmp_path: Path) -> None:
    copy = tmp_path / "cluster"
    copy.mkdir()
    shutil.copy(BUILD_SCRIPT, copy / BUILD_SCRIPT.name)
    shutil.copytree(GO_MODULES, copy / "go")
    env = {**os.environ, "CONVEYOR_TOOLS_CACHE": str(tmp_path / "cache")}
    script = str(copy / BUILD_SCRIPT.name)

    def print_dir(*args: str) -> str:
        return subprocess.run(
            [script, *args, "--print-dir"], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()

    cluster, node = print_dir(), print_dir("--set", "node")
    assert Path(node).name.startswith("node-") and node != cluster
    plugin = copy / "go" / "node" / "cmd" / "fake-gpu-plugin" / "main.go"
    plugin.write_text(plugin.read_text() + "\n// changed\n")
    assert print_dir("--set", "node") != node  # the plugin's source is part of its key
    assert print_dir() == cluster  # and never part of the control plane's
    node_sum = copy / "go" / "node" / "go.sum"
    node_sum.write_text(node_sum.read_text() + "example.com/x v1.0.0 h1:x=\n")
    assert print_dir() == cluster
