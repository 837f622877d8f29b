"""The images ``conveyor up`` gives the cluster's nodes, and which image each component runs from.

The pods run from images built here (``conveyor image build``): the project's full image for
the runtime, the torch-less ``conveyor-control`` for the operator and the gateway (as on a
real cluster), and for ``--engine vllm`` vLLM for CPU's.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from pathlib import Path

from conveyor.cluster.image_build import ImageBuilder, images_cache
from conveyor.cluster.image_oci import ImageBuildError
from conveyor.cluster.image_plan import (
    CONTROL_EXTRAS,
    VLLM_REPOSITORY,
    ImageSettings,
    host_debian_mirror,
)
from conveyor.cluster.real_nodes import CONTROL_IMAGE, default_node_images
from conveyor.cluster.settings import ClusterSettings

ROOT = Path(__file__).resolve().parent.parent


def build_node_images(engine: str, say: Callable[[str], None]) -> tuple[str, ...]:
    """Build (only the layers whose inputs changed, so the pods run this checkout's code) the
    images the nodes get: the project's, the control image, vLLM for CPU's for ``engine``
    ``vllm``; then any other image built here (``default_node_images``). Their paths."""
    mirror = host_debian_mirror() or ImageSettings.mirror
    builds = [
        ("the project's image", ImageSettings(repo=ROOT, mirror=mirror)),
        (
            "the gateway and operator's image (no torch)",
            ImageSettings(repo=ROOT, mirror=mirror, extras=CONTROL_EXTRAS),
        ),
    ]
    if engine == "vllm":
        builds.append(
            ("vLLM for CPU's image", ImageSettings(repo=ROOT, mirror=mirror, engine="vllm"))
        )
    images: list[Path] = []
    for what, settings in builds:
        say(f"building {what} for the real nodes (cold: minutes; cached by layer)")
        try:
            images.append(ImageBuilder(settings, cache=images_cache(), progress=say).build().image)
        except ImageBuildError as exc:
            raise RuntimeError(f"building {what} failed: {exc}") from exc
    images += [p for p in default_node_images() if p not in images]
    return tuple(map(str, images))


def holds_image(cluster: ClusterSettings, repository: str) -> bool:
    """Whether the cluster's nodes were given ``repository``'s image (``<repo>-<tag>.oci``)."""
    return any(Path(p).name.startswith(f"{repository}-") for p in cluster.node_images)


def check_engine_image(cluster: ClusterSettings, engine: str) -> None:
    """A reused cluster has the images it started with: vLLM's LLMService needs vLLM for CPU's
    among them."""
    if engine == "vllm" and not holds_image(cluster, VLLM_REPOSITORY):
        raise RuntimeError(
            f"cluster {cluster.name!r} runs nodes without vLLM for CPU's image: run "
            "`conveyor down`, then `conveyor up --engine vllm` again (it builds the image "
            "and gives it to the new nodes)"
        )


def chart_images(cluster: ClusterSettings | None) -> list[str]:
    """``helm --set`` flags for the images: on nodes that hold the torch-less image, the
    operator and gateway run from it and the runtime from the project's full image (as on a
    real cluster); elsewhere the chart's one image (an existing cluster's registry, or nodes
    given only the project's image)."""
    if cluster is None or not holds_image(cluster, CONTROL_IMAGE):
        return []
    version = importlib.metadata.version("conveyor")
    return [
        "--set",
        f"image.repository={CONTROL_IMAGE}",
        "--set",
        f"runtime.image=conveyor:{version}",
    ]
