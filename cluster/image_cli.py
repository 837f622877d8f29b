"""``conveyor image build``: the project's image as an OCI layout, without a container engine.

For a real cluster, build the Dockerfile with Docker or BuildKit and push it to your registry
(README.md, "Building the image"); this command builds the same layers here, on a Debian base.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from conveyor.cluster.image_build import ImageBuilder, images_cache
from conveyor.cluster.image_oci import ImageBuildError, image_bytes
from conveyor.cluster.image_plan import ENGINES, ImageSettings, host_debian_mirror


def _parser() -> argparse.ArgumentParser:
    defaults = ImageSettings(repo=Path("."))
    parser = argparse.ArgumentParser(prog="conveyor image", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser(
        "build",
        help="build the image (only the layers whose inputs changed) and write it out as an "
        "OCI layout directory",
    )
    build.add_argument(
        "--output",
        type=Path,
        default=None,
        help="where to write the image: an OCI layout directory (default: "
        "$CONVEYOR_CACHE/images/conveyor-VERSION.oci, its blobs hardlinks to the cache's) or, "
        "for a path ending in .tar, an OCI archive (a full copy, to move elsewhere)",
    )
    build.add_argument(
        "--engine",
        choices=ENGINES,
        default="conveyor",
        help="whose image: the project's (conveyor, default) or vLLM for CPU's (vllm: "
        "Dockerfile.vllm-cpu, named vllm-cpu:VERSION, for LLMServices with engine vllm on the "
        "real nodes; about 6 GB)",
    )
    build.add_argument(
        "--extras",
        default=",".join(defaults.extras),
        help="the project's extras to install, comma-separated (gateway,operator: no torch)",
    )
    build.add_argument(
        "--base",
        default=defaults.suite,
        help="Debian release that debootstrap makes the base from",
    )
    build.add_argument(
        "--mirror",
        default=None,
        help="Debian archive for debootstrap (default: the one this machine's apt uses)",
    )
    build.add_argument(
        "--repo",
        type=Path,
        default=Path(__file__).resolve().parent.parent,
        help="the checkout to build from (default: the one this command runs from)",
    )
    build.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="the image cache (default: $CONVEYOR_CACHE/images, ~/.cache/conveyor/images)",
    )
    build.add_argument(
        "--seed",
        action="store_true",
        help="then import every image the cluster's nodes get (the project's, the control image "
        "and vLLM for CPU's, those built), with the pause image, into the nodes' seed (the "
        "containerd root that `conveyor cluster up` clones into each node): a minute or two "
        "the first time, seconds after a source edit; needs containerd and the node tools' Go "
        "module (cluster/build-tools.sh --set node)",
    )
    build.add_argument(
        "--no-cache",
        action="store_true",
        help="rebuild every layer (pip's download cache is still used)",
    )
    return parser


def _say(message: str) -> None:
    print(f"[image {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    """Entry point of ``conveyor image``."""
    args = _parser().parse_args(argv)
    settings = ImageSettings(
        repo=args.repo.resolve(),
        extras=tuple(e.strip() for e in args.extras.split(",") if e.strip()),
        suite=args.base,
        mirror=args.mirror or host_debian_mirror() or ImageSettings.mirror,
        engine=args.engine,
    )
    if args.seed and args.output is not None:
        print(
            "conveyor image build: --seed imports the images at their default paths; "
            "drop --output (or seed with `conveyor cluster up --node-image PATH`)",
            file=sys.stderr,
        )
        return 2
    builder = ImageBuilder(
        settings, cache=args.cache or images_cache(), no_cache=args.no_cache, progress=_say
    )
    try:
        result = builder.build(args.output)
    except (ImageBuildError, ValueError) as exc:
        print(f"conveyor image build: {exc}", file=sys.stderr)
        return 1
    for r in result.layers:
        print(
            f"layer {r.layer.kind:<5} {r.layer.key}  "
            f"{'cached' if r.cached else f'{r.seconds:7.1f} s'}  "
            f"{r.tar_bytes / 1e6:8.0f} MB unpacked  {r.blob_bytes / 1e6:8.0f} MB stored"
        )
    size = image_bytes(result.image)
    print(f"image {result.name}: {result.image} ({size / 1e6:.0f} MB) in {result.seconds:.1f} s")
    if not args.seed:
        kind = "oci-archive" if result.image.is_file() else "oci"
        print(f"push it: skopeo copy {kind}:{result.image} docker://REGISTRY/{result.name}")
        return 0
    # real nodes' code only when asked
    from conveyor.cluster.real_nodes import default_node_images, node_seed

    images = default_node_images(args.cache)
    _say(f"seed: importing {', '.join(i.name for i in images)} into the real nodes' seed")
    try:
        seed = node_seed(images)
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"conveyor image build --seed: {exc}", file=sys.stderr)
        return 1
    how = "cached" if seed.cached else f"imported in {seed.import_s:.1f} s"
    print(f"seed for real nodes: {seed.root} ({how})")
    return 0
