"""Small images for real nodes, built here: the pause image (the pods' sandbox) and images of
one static binary (busybox, for tests), packed as OCI archives (``image_oci``, skopeo) that
``ctr images import`` loads into a node's containerd. Nothing is pulled from a registry.

The pause program is the Kubernetes module's own ``build/pause/linux/pause.c``, compiled
static, as upstream builds its ``registry.k8s.io/pause`` image.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from conveyor.cluster.image_oci import LAYER_TAR, OciLayout
from conveyor.cluster.image_plan import ImageConfig
from conveyor.cluster.tools import pinned_version

PAUSE_TAG = "3.10.1"
"""The tag of upstream's pause image of the pinned Kubernetes (its ``build/pause/Makefile``)."""

PAUSE_IMAGE = f"registry.k8s.io/pause:{PAUSE_TAG}"
"""The sandbox image's name: upstream's, so that nothing anywhere tries to pull another."""


def pause_source() -> Path:
    """``pause.c`` of the pinned Kubernetes module, from the Go module cache (``go mod
    download`` puts the module there if no build has yet)."""
    module = f"k8s.io/kubernetes@{pinned_version('k8s.io/kubernetes')}"
    go = shutil.which("go") or "/usr/local/go/bin/go"
    proc = subprocess.run(
        [go, "mod", "download", "-json", module], capture_output=True, text=True, cwd="/"
    )
    try:
        found = json.loads(proc.stdout)
    except ValueError:
        found = {}
    if proc.returncode != 0 or "Dir" not in found:
        why = found.get("Error") or proc.stderr.strip() or f"exit {proc.returncode}"
        raise FileNotFoundError(f"go mod download {module} (for the pause image) failed: {why}")
    return Path(found["Dir"]) / "build/pause/linux/pause.c"


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
    key = hashlib.sha256(layer + repr((entrypoint, ref, LAYER_TAR)).encode()).hexdigest()[:16]
    archive = cache / f"{ref.rsplit('/', 1)[-1].replace(':', '-')}-{key}.tar"
    if archive.exists():
        return archive
    work = cache / f".work-{key}"
    layout = OciLayout(work / "oci")
    layout.ensure()
    tar = work / "layer.tar"
    tar.write_bytes(layer)
    layout.append(tar, parent=None, tag="layer", created_by="conveyor node_images")
    config = ImageConfig(
        env={}, user="", workdir="", ports=(), entrypoint=tuple(entrypoint), cmd=()
    )
    layout.configure("layer", "image", config, created_by="conveyor node_images")
    layout.export("image", archive, ref)
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


def import_image(ctr_address: Path, image: Path, *, content: Path | None = None) -> None:
    """Load ``image`` (an OCI archive, or an OCI layout directory) into the CRI namespace of
    the containerd at ``ctr_address``.

    ``content``: that containerd's blob directory (``.../blobs/sha256``). Blobs already there
    are left out of what ``ctr`` reads: it learns a blob's digest only by sending all of it
    to containerd, so a 6 GB layer that a cloned seed already holds would cost a minute and a
    half for nothing. Unpacking then reads the blobs from the store. (containerd writes the
    blobs it is sent as its own files; ``share_blobs`` makes them one with the layout's.)"""
    argv = ["ctr", "-a", str(ctr_address), "-n", "k8s.io", "images", "import", "--all-platforms"]
    known = _stored(content) if content is not None else set()
    if image.is_dir():
        members = _layout_members(image)
        send = [(name, path) for name, path in members if name.rsplit("/", 1)[-1] not in known]
        proc = _stream_into(argv, lambda out: _add_files(out, send))
    else:
        with tarfile.open(image) as tar:
            entries = tar.getmembers()
            skip = {
                m.name for m in entries
                if m.isfile() and m.name.startswith("blobs/sha256/")
                and m.name.rsplit("/", 1)[-1] in known
            }  # fmt: skip
            if not skip:
                proc = subprocess.run([*argv, str(image)], capture_output=True, text=True)
            else:

                def write(out: tarfile.TarFile) -> None:
                    for m in entries:
                        if m.name not in skip:
                            out.addfile(m, tar.extractfile(m) if m.isfile() else None)

                proc = _stream_into(argv, write)
    if proc.returncode != 0:
        raise RuntimeError(f"ctr images import {image} failed: {proc.stderr.strip()}")


def share_blobs(layout: Path, content: Path) -> int:
    """Each blob of the OCI ``layout`` directory that containerd's ``content`` store
    (``.../blobs/sha256``) holds as its own copy (as an import writes it) made one file with
    the layout's: the copy replaced by a hardlink. Blobs are named by their digest and never
    written in place, so the two names are the same bytes. Blobs the store lacks stay out (it
    knows nothing of them). The bytes a replaced copy held, if no other name holds them."""
    freed = 0
    if not content.is_dir() or content.stat().st_dev != layout.stat().st_dev:
        return 0  # another file system ($CONVEYOR_CACHE elsewhere): no hardlink can join them
    for blob in (layout / "blobs" / "sha256").iterdir():
        there = content / blob.name
        try:
            st = there.stat()
        except FileNotFoundError:
            continue
        if st.st_ino != blob.stat().st_ino:
            link = there.with_name(f".{blob.name}.link")
            link.unlink(missing_ok=True)
            os.link(blob, link)
            link.replace(there)
            freed += st.st_size if st.st_nlink == 1 else 0
    return freed


def _stored(content: Path) -> set[str]:
    try:
        return {p.name for p in content.iterdir()}
    except FileNotFoundError:
        return set()


def _layout_members(layout: Path) -> list[tuple[str, Path]]:
    """The files of an OCI layout directory, named as in an archive of it."""
    blobs = sorted((layout / "blobs" / "sha256").iterdir())
    return [
        ("oci-layout", layout / "oci-layout"),
        ("index.json", layout / "index.json"),
        *((f"blobs/sha256/{b.name}", b) for b in blobs),
    ]


def _add_files(out: tarfile.TarFile, files: list[tuple[str, Path]]) -> None:
    for name, path in files:
        info = tarfile.TarInfo(name)
        info.size, info.mode = path.stat().st_size, 0o444
        with open(path, "rb") as f:
            out.addfile(info, f)


def _stream_into(
    argv: list[str], write: Callable[[tarfile.TarFile], None]
) -> subprocess.CompletedProcess[str]:
    """Run ``ctr ... import -`` with the tar that ``write`` makes on its stdin."""
    with tempfile.TemporaryFile() as err:  # a pipe could fill while stdin is written
        with subprocess.Popen(
            [*argv, "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err
        ) as ctr:
            assert ctr.stdin is not None
            try:
                with tarfile.open(fileobj=ctr.stdin, mode="w|") as out:
                    write(out)
            except BrokenPipeError:
                pass  # ctr stopped reading: its exit status and stderr say why
            ctr.stdin.close()
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    return subprocess.CompletedProcess(ctr.args, ctr.returncode, "", stderr)
