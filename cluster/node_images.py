"""Small images for real nodes, built here: the pause image (the pods' sandbox) and images of
one static binary (busybox, for tests), packed with umoci and skopeo as OCI archives that
``ctr images import`` loads into a node's containerd. Nothing is pulled from a registry.

The pause program is the Kubernetes module's own ``build/pause/linux/pause.c``, compiled
static, as upstream builds its ``registry.k8s.io/pause`` image.
"""

from __future__ import annotations

import hashlib
import io
import subprocess
import tarfile
from pathlib import Path

from conveyor.cluster.image_oci import OciLayout, ToolRunner
from conveyor.cluster.tools import pinned_version

PAUSE_TAG = "3.10.1"
"""The tag of upstream's pause image of the pinned Kubernetes (its ``build/pause/Makefile``)."""

PAUSE_IMAGE = f"registry.k8s.io/pause:{PAUSE_TAG}"
"""The sandbox image's name: upstream's, so that nothing anywhere tries to pull another."""


def pause_source() -> Path:
    """``pause.c`` of the pinned Kubernetes module, from the Go module cache."""
    version = pinned_version("k8s.io/kubernetes")
    cache = subprocess.run(
        ["go", "env", "GOMODCACHE"], capture_output=True, text=True, check=True
    ).stdout.strip()
    source = Path(cache) / f"k8s.io/kubernetes@{version}" / "build/pause/linux/pause.c"
    if not source.exists():
        raise FileNotFoundError(
            f"{source} is missing: build the node tools first (cluster/build-tools.sh --set node)"
        )
    return source


def _rootfs_tar(files: dict[str, Path]) -> bytes:
    """An uncompressed layer holding ``files`` (path in the image -> file here), mode 0755."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for dest, src in sorted(files.items()):
            data = src.read_bytes()
            info = tarfile.TarInfo(dest.lstrip("/"))
            info.size, info.mode, info.mtime = len(data), 0o755, 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def static_image(files: dict[str, Path], *, entrypoint: list[str], ref: str, cache: Path) -> Path:
    """An OCI archive of one layer holding ``files``, referenced as ``ref``; cached by content."""
    layer = _rootfs_tar(files)
    key = hashlib.sha256(layer + repr((entrypoint, ref)).encode()).hexdigest()[:16]
    archive = cache / f"{ref.rsplit('/', 1)[-1].replace(':', '-')}-{key}.tar"
    if archive.exists():
        return archive
    work = cache / f".work-{key}"
    run = ToolRunner(work / "logs")
    layout = OciLayout(work / "oci", run)
    layout.ensure()
    tar = work / "layer.tar"
    tar.write_bytes(layer)
    layout.append(tar, parent=None, tag="layer", created_by="conveyor node_images")
    args = ["umoci", "config", "--image", f"{layout.path}:layer", "--tag", "image"]
    args += [f"--config.entrypoint={a}" for a in entrypoint]
    run(args)
    partial = archive.with_name(archive.name + ".partial")
    partial.unlink(missing_ok=True)
    run(["skopeo", "copy", "--quiet", f"oci:{layout.path}:image", f"oci-archive:{partial}:{ref}"])
    partial.rename(archive)
    subprocess.run(["rm", "-rf", str(work)], check=True)
    return archive


def pause_image(cache: Path) -> Path:
    """The pause image's archive (``PAUSE_IMAGE``), compiled and packed once per cache."""
    cache.mkdir(parents=True, exist_ok=True)
    binary = cache / f"pause-{PAUSE_TAG}"
    if not binary.exists():
        partial = binary.with_name(binary.name + ".partial")
        subprocess.run(
            ["gcc", "-Os", "-Wall", "-static", f"-DVERSION=v{PAUSE_TAG}-conveyor",
             "-o", str(partial), str(pause_source())],
            check=True, capture_output=True,
        )  # fmt: skip
        partial.rename(binary)
    return static_image({"/pause": binary}, entrypoint=["/pause"], ref=PAUSE_IMAGE, cache=cache)


def import_image(ctr_address: Path, archive: Path) -> None:
    """Load ``archive`` into the CRI namespace of the containerd at ``ctr_address``."""
    proc = subprocess.run(
        ["ctr", "-a", str(ctr_address), "-n", "k8s.io", "images", "import",
         "--all-platforms", str(archive)],
        capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"ctr images import {archive} failed: {proc.stderr.strip()}")
