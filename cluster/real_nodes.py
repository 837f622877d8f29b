"""The cluster's nodes: real kubelets, each with its own containerd and runc.

Used by ``Cluster``: ``start_real_nodes`` starts one
``KubeletNode`` per GPU and CPU node, each with its own slice of the pod range and of the
machine; ``stop_real_nodes`` stops them in order while the apiserver still runs;
``sweep_real_nodes`` is what ``teardown`` does after a crash.
"""

from __future__ import annotations

import importlib.metadata
import ipaddress
from collections.abc import Callable
from pathlib import Path

from conveyor.bench.peers import vllm_env
from conveyor.cluster.api import ApiClient
from conveyor.cluster.certs import KeyPair
from conveyor.cluster.components import Components
from conveyor.cluster.image_build import default_image
from conveyor.cluster.image_plan import VLLM_REPOSITORY
from conveyor.cluster.kubelet_config import KubeletInputs, NodeLayout, cni_config, node_subnet
from conveyor.cluster.kubelet_node import (
    KubeletNode,
    RealNodeInputs,
    build_node_tools,
    sweep_real_node,
)
from conveyor.cluster.network import NetworkPlan
from conveyor.cluster.node_images import pause_image
from conveyor.cluster.node_seed import Seed, seed_root
from conveyor.cluster.nodes import MachineShare, node_names
from conveyor.cluster.settings import ClusterSettings


def node_layouts(settings: ClusterSettings) -> list[NodeLayout]:
    """Every real node's layout, GPU nodes first (their index picks their pod range)."""
    gpu, cpu = node_names(settings.gpu_nodes, settings.cpu_nodes)
    root = settings.work_dir() / "nodes"
    return [NodeLayout(settings.name, name, root / name) for name in gpu + cpu]


def image_cache() -> Path:
    """Where the pause image is built (shared by every cluster of this user)."""
    return Path.home() / ".cache" / "conveyor" / "node-images"


PROJECT_IMAGE = "conveyor"
"""What ``--node-image`` takes for the project's own image (``conveyor image build``'s)."""


def node_image_path(arg: str, *, cache: Path | None = None) -> Path:
    """The image ``--node-image ARG`` names: ``PROJECT_IMAGE``, or a path to an OCI layout
    directory or OCI archive."""
    if arg == PROJECT_IMAGE:
        image = default_image(importlib.metadata.version("conveyor"), cache)
        if not (image / "index.json").is_file():
            raise FileNotFoundError(
                f"{image} is missing: build the project's image first (conveyor image build)"
            )
        return image
    image = Path(arg).resolve()
    if not (image.is_file() or (image / "index.json").is_file()):
        raise FileNotFoundError(f"--node-image {arg}: no OCI archive or layout directory there")
    return image


CONTROL_IMAGE = "conveyor-control"
"""The gateway and operator's image, without torch (``conveyor image build --extras
gateway,operator``): what ``conveyor up`` runs them from on real nodes."""
VLLM_CPU_IMAGE = f"{VLLM_REPOSITORY}:{vllm_env.VERSION}"
"""vLLM for CPU's image as the real nodes' containerd knows it (``conveyor image build
--engine vllm``): what an LLMService with ``engine: vllm`` names in ``spec.runtime.image``."""


def default_node_images(cache: Path | None = None) -> list[Path]:
    """The images real nodes get unless told otherwise, those built here: the project's
    (``conveyor image build``); the gateway and operator's, without torch (``--extras
    gateway,operator``); vLLM for CPU's (``--engine vllm``), which an LLMService with
    ``engine: vllm`` runs here (``spec.runtime.image: vllm-cpu:VER``)."""
    version = importlib.metadata.version("conveyor")
    images = [
        default_image(version, cache),
        default_image(version, cache, CONTROL_IMAGE),
        default_image(vllm_env.VERSION, cache, VLLM_REPOSITORY),
    ]
    return [image for image in images if (image / "index.json").is_file()]


def node_seed(images: list[Path]) -> Seed:
    """The seed containerd root every real node clones: the pause image and ``images``
    (made once per set of images; a few seconds after a source edit, ``node_seed``)."""
    return seed_root((pause_image(image_cache()), *images))


def start_real_nodes(
    settings: ClusterSettings,
    *,
    plan: NetworkPlan,
    ca: KeyPair,
    server: str,
    components: Components,
    api: ApiClient,
    free_port: Callable[[str], int],
) -> dict[str, float]:
    """Make (or find) the seed holding the images, start every node from it and wait until
    each is Ready; the seconds each took (all of it, the clone of the seed, containerd up),
    keyed ``<node>_<what>_s``, and the seed's import (``seed_import_s``, 0 when cached)."""
    tools = build_node_tools()
    seed = node_seed([Path(p) for p in settings.node_images])
    timings = {"seed_import_s": 0.0 if seed.cached else seed.import_s}
    layouts = node_layouts(settings)
    machine = MachineShare.of_this_machine(1)
    share = MachineShare.of_this_machine(len(layouts))
    gpu_names = set(node_names(settings.gpu_nodes, 0)[0])
    for index, layout in enumerate(layouts):
        gpus = settings.gpus_per_node if layout.name in gpu_names else 0
        kubelet = KubeletInputs(
            layout=layout,
            address=str(plan.host_address),
            port=free_port(str(plan.host_address)),
            healthz_port=free_port("127.0.0.1"),
            client_ca=ca.cert,
            share=share,
            machine=machine,
            max_pods=settings.max_pods_per_node,
            gpus=gpus,
        )
        cni = cni_config(
            bridge=plan.bridge,
            pod_cidr=plan.pod_cidr,
            subnet=node_subnet(plan.pod_cidr, index),
            gateway=ipaddress.IPv4Address(plan.host_address),
            ipam_dir=layout.ipam_dir,
        )
        node = KubeletNode(layout, components, api)
        node.start(
            RealNodeInputs(
                kubelet=kubelet,
                server=server,
                ca=ca,
                tools=tools,
                cni=cni,
                seed=seed.root,
                gpu_product=settings.gpu_product,
                gpu_memory_mib=settings.gpu_memory_mib,
                log_level=settings.log_level,
            )
        )
        timings[f"{layout.name}_start_to_ready_s"] = node.timings["start_to_ready_s"]
        timings[f"{layout.name}_clone_s"] = node.timings["clone_s"]
        timings[f"{layout.name}_containerd_s"] = node.timings["containerd_s"]
    return timings


def stop_real_nodes(settings: ClusterSettings, *, components: Components, api: ApiClient) -> None:
    """Stop every node (pods, kubelet, containers, containerd, mounts, cgroups, Node object)."""
    errors = []
    for layout in reversed(node_layouts(settings)):
        try:
            KubeletNode(layout, components, api).stop(settings.stop_grace_s)
        except (RuntimeError, OSError) as exc:
            errors.append(f"{layout.name}: {exc}")
    if errors:
        raise RuntimeError("; ".join(errors))


def sweep_real_nodes(settings: ClusterSettings) -> None:
    """After the processes are gone: the nodes' cgroups and mounts."""
    for layout in node_layouts(settings):
        sweep_real_node(layout)
