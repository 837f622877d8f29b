"""The image cache's OCI layout and its archives, written here, and the runner of the build's
tools.

Each layer of ``image_plan`` is a tag of one OCI layout (the image up to and including that
layer), so whether a layer is cached is whether its tag is there; blobs are shared between
tags by their digests.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import tarfile
from datetime import UTC, datetime
from pathlib import Path

from conveyor.cluster.image_plan import ImageConfig

CANONICAL_REGISTRY = "docker.io/library"
"""Where the archive's reference puts the image: what a pod's ``image: conveyor:TAG`` means
to the kubelet and containerd (``ctr images import`` names the image after it; a short name
would not match)."""
_REF = "org.opencontainers.image.ref.name"
INDEX = "application/vnd.oci.image.index.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"


class ImageBuildError(RuntimeError):
    """The build cannot go on; the message says what to do."""


ARCHIVE_SLACK = 64 << 20
"""Room kept beyond an archive's blobs: its tar headers and whatever else writes meanwhile."""


def _make_room(archive: Path, size: int) -> None:
    """Make sure ``size`` bytes can be written beside ``archive``: when they cannot, the old
    archive goes first (the new one replaces it anyway, and nothing else reads it: the real
    nodes' seed holds its own copy); when they still cannot, say so."""
    need = size + ARCHIVE_SLACK
    if shutil.disk_usage(archive.parent).free < need and archive.exists():
        archive.unlink()
    free = shutil.disk_usage(archive.parent).free
    if free < need:
        raise ImageBuildError(
            f"not enough disk space for the image's archive: it needs {need / 1e9:.1f} GB and "
            f"{free / 1e9:.1f} GB are free on {archive.parent}; free some (the real nodes' "
            "seeds in ~/.cache/conveyor/node-seed can go: the next build makes one again) or "
            "write it elsewhere with --output"
        )


class ToolRunner:
    """Runs the build's tools, each one's output into a log under ``logs``."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs

    def __call__(self, cmd: list[str], *, log: str | None = None) -> str:
        """Run ``cmd``; its output (stdout too, unless it is the answer) goes to the log as it
        comes, and the log's tail into the error."""
        self.logs.mkdir(parents=True, exist_ok=True)
        log_path = self.logs / f"{log or Path(cmd[0]).name}.log"
        with open(log_path, "w") as out:
            proc = subprocess.run(
                cmd, stdout=out if log else subprocess.PIPE, stderr=out, text=True, check=False
            )
        if proc.returncode != 0:
            tail = "\n".join(log_path.read_text().splitlines()[-15:])
            raise ImageBuildError(
                f"{' '.join(cmd[:3])} ... failed (exit {proc.returncode}); "
                f"the end of {log_path}:\n{tail}"
            )
        return proc.stdout or ""


class OciLayout:
    """One OCI layout directory whose tags are images, one per layer key.

    Written here, not by umoci: umoci gzips every layer it adds, on one core (about 7 minutes
    for the 6 GB dependency layer), and a layer that only ever travels from this cache into
    the nodes' containerd on the same disk gains nothing from it. Layers are stored as plain
    tar (``application/vnd.oci.image.layer.v1.tar``), so a layer's digest is also its diff ID
    and containerd unpacks it without decompressing; a push to a registry (``skopeo copy
    oci-archive:... docker://...``) gzips them on the way.
    """

    def __init__(self, path: Path, *, architecture: str | None = None) -> None:
        self.path = path
        self.architecture = architecture or oci_architecture()

    def ensure(self) -> None:
        if (self.path / "index.json").exists():
            return
        (self.path / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
        (self.path / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
        self._write_index([])

    def tags(self) -> set[str]:
        return {m.get("annotations", {}).get(_REF, "") for m in self._index()}

    def append(self, tar: Path, *, parent: str | None, tag: str, created_by: str) -> None:
        """Move the uncompressed ``tar`` into the layout as a layer on top of ``parent`` (or of
        nothing), tagged ``tag``."""
        digest = _sha256_of(tar)
        size = tar.stat().st_size
        blob = self._blob(digest)
        if blob.exists():
            tar.unlink()
        else:
            tar.rename(blob)
        if parent is None:
            config: dict = {
                "architecture": self.architecture,
                "os": "linux",
                "config": {},
                "rootfs": {"type": "layers", "diff_ids": []},
                "history": [],
            }
            layers: list[dict] = []
        else:
            manifest = self._manifest(parent)
            config = json.loads(self._blob(manifest["config"]["digest"]).read_text())
            layers = list(manifest["layers"])
        config["created"] = _now()
        config["rootfs"]["diff_ids"].append(digest)
        config["history"].append({"created": config["created"], "created_by": created_by})
        layers.append({"mediaType": LAYER_TAR, "digest": digest, "size": size})
        self._tag(tag, config, layers)

    def configure(
        self, tag: str, new_tag: str, config: ImageConfig, *, created_by: str = "Dockerfile"
    ) -> None:
        """``tag`` with the runtime configuration ``config``, as ``new_tag``."""
        manifest = self._manifest(tag)
        image = json.loads(self._blob(manifest["config"]["digest"]).read_text())
        runtime: dict = {
            "Env": [f"{k}={v}" for k, v in config.env.items()],
            "Entrypoint": list(config.entrypoint),
            "Cmd": list(config.cmd),
        }
        if config.user:
            runtime["User"] = config.user
        if config.workdir:
            runtime["WorkingDir"] = config.workdir
        if config.ports:
            runtime["ExposedPorts"] = {f"{p}/tcp": {} for p in config.ports}
        image["config"] = runtime
        # The top layer's time, not now: the same layers and configuration make the same image
        # (and so the same node seed) however often the build is run.
        image["created"] = image["history"][-1]["created"] if image["history"] else _now()
        image["history"].append(
            {"created": image["created"], "created_by": f"{created_by} configuration",
             "empty_layer": True}
        )  # fmt: skip
        self._tag(new_tag, image, manifest["layers"])

    def top_layer_size(self, tag: str) -> int:
        """Bytes of ``tag``'s last layer as stored."""
        return int(self._manifest(tag)["layers"][-1]["size"])

    def export(self, tag: str, dest: Path, ref: str) -> None:
        """``tag`` as an image named ``ref`` (a full reference, which ``ctr images import``
        names it): an OCI layout directory holding only it, its blobs hardlinks to the cache's
        (no byte copied), or, when ``dest`` ends in ``.tar``, an OCI archive (a tar of that
        layout: a full copy, for moving the image elsewhere). Written here: skopeo would gzip
        every plain layer on the way."""
        entry = next(m for m in self._index() if m.get("annotations", {}).get(_REF) == tag)
        manifest = self._manifest(tag)
        digests = [entry["digest"], manifest["config"]["digest"]]
        digests += [layer["digest"] for layer in manifest["layers"]]
        index = {
            "schemaVersion": 2,
            "mediaType": INDEX,
            "manifests": [{**entry, "annotations": {_REF: ref}}],
        }
        if image_index(dest) == json.dumps(index).encode():
            return  # this very image (its manifest's digest names all of it)
        dest.parent.mkdir(parents=True, exist_ok=True)
        archive = dest.name.endswith(".tar")
        partial = dest.with_name(dest.name + ".partial")
        _remove(partial)  # a write that died
        # A directory of hardlinks to the blobs (beside them: one file system): the layout
        # itself, or what GNU tar packs, so that nothing is copied twice.
        staging = self.path / "archive.staging" if archive else partial
        shutil.rmtree(staging, ignore_errors=True)
        (staging / "blobs" / "sha256").mkdir(parents=True)
        try:
            shutil.copy(self.path / "oci-layout", staging / "oci-layout")
            for digest in dict.fromkeys(digests):
                os.link(self._blob(digest), staging / "blobs" / Path(*digest.split(":", 1)))
            (staging / "index.json").write_text(json.dumps(index))  # last: the layout is whole
            if archive:
                _make_room(dest, sum(self._blob(d).stat().st_size for d in dict.fromkeys(digests)))
                tar = subprocess.run(
                    ["tar", "--create", "--file", str(partial), "--directory", str(staging),
                     "oci-layout", "index.json", "blobs"],
                    capture_output=True, text=True,
                )  # fmt: skip
                if tar.returncode != 0:
                    partial.unlink(missing_ok=True)
                    raise ImageBuildError(f"writing {dest} failed: {tar.stderr.strip()}")
        finally:
            if archive:
                shutil.rmtree(staging, ignore_errors=True)
        _remove(dest)
        partial.rename(dest)

    def prune_siblings(self, keep: str, prefix: str) -> None:
        """Drop the ``prefix`` tags other than ``keep`` that sit on the same lower layers
        (earlier builds' top layers: nothing builds on them; another extras' stay), then
        the blobs no tag holds."""

        def lowers(tag: str) -> list[str]:
            return [layer["digest"] for layer in self._manifest(tag)["layers"][:-1]]

        below = lowers(keep)
        stale = [
            t for t in self.tags() if t.startswith(prefix) and t != keep and lowers(t) == below
        ]
        self.drop(stale)

    def on_other_bases(self, base: str) -> list[str]:
        """The tags not built on ``base``'s layer: garbage once the base changed (an edit of
        image-steps.sh, another suite), since every deps and src layer is keyed by its base."""

        def bottom(tag: str) -> str | None:
            layers = self._manifest(tag)["layers"]  # none: an empty image
            return str(layers[0]["digest"]) if layers else None

        mine = bottom(base)
        return sorted(t for t in self.tags() if bottom(t) != mine)

    def drop(self, tags: list[str]) -> None:
        """Remove ``tags`` from the layout, then the blobs no tag reaches any more."""
        if not tags:
            return
        self._write_index(
            [m for m in self._index() if m.get("annotations", {}).get(_REF) not in tags]
        )
        self.collect_garbage()

    def collect_garbage(self) -> None:
        """Delete the blobs no tag reaches (umoci gc reads every blob: minutes for torch)."""
        keep: set[str] = set()
        for entry in self._index():
            manifest = json.loads(self._blob(entry["digest"]).read_text())
            keep.add(entry["digest"])
            keep.add(manifest["config"]["digest"])
            keep.update(layer["digest"] for layer in manifest["layers"])
        for blob in (self.path / "blobs" / "sha256").iterdir():
            if f"sha256:{blob.name}" not in keep:
                blob.unlink()

    def _index(self) -> list[dict]:
        return list(json.loads((self.path / "index.json").read_text()).get("manifests") or [])

    def _manifest(self, tag: str) -> dict:
        entry = next(m for m in self._index() if m.get("annotations", {}).get(_REF) == tag)
        return dict(json.loads(self._blob(entry["digest"]).read_text()))

    def _blob(self, digest: str) -> Path:
        return self.path / "blobs" / Path(*digest.split(":", 1))

    def _put(self, data: bytes) -> dict:
        """``data`` as a blob; its descriptor's digest and size."""
        digest = f"sha256:{hashlib.sha256(data).hexdigest()}"
        blob = self._blob(digest)
        if not blob.exists():
            partial = blob.with_name(blob.name + ".partial")
            partial.write_bytes(data)
            partial.rename(blob)
        return {"digest": digest, "size": len(data)}

    def _tag(self, tag: str, config: dict, layers: list[dict]) -> None:
        """Write ``config`` and a manifest of it and ``layers``, and point ``tag`` at it."""
        manifest = {
            "schemaVersion": 2,
            "mediaType": MANIFEST,
            "config": {"mediaType": CONFIG, **self._put(_canonical(config))},
            "layers": layers,
        }
        entry = {
            "mediaType": MANIFEST,
            **self._put(_canonical(manifest)),
            "annotations": {_REF: tag},
        }
        others = [m for m in self._index() if m.get("annotations", {}).get(_REF) != tag]
        self._write_index([*others, entry])

    def _write_index(self, manifests: list[dict]) -> None:
        index = {"schemaVersion": 2, "mediaType": INDEX, "manifests": manifests}
        partial = self.path / "index.json.partial"
        partial.write_text(json.dumps(index))
        partial.replace(self.path / "index.json")


def image_index(archive: Path) -> bytes | None:
    """The ``index.json`` of an OCI layout directory or archive (it names the image's manifest
    by digest), or None when there is no such image."""
    if archive.is_dir():
        try:
            return (archive / "index.json").read_bytes()
        except OSError:
            return None
    try:
        with tarfile.open(archive) as tar:
            member = tar.extractfile("index.json")
            return member.read() if member is not None else None
    except (OSError, KeyError, tarfile.TarError):
        return None


def image_bytes(image: Path) -> int:
    """Bytes an image written by ``OciLayout.export`` holds: the archive's size, or the sum of
    the layout's files (its blobs are shared with the cache, so this is not disk used)."""
    if image.is_file():
        return image.stat().st_size
    return sum(f.stat().st_size for f in image.rglob("*") if f.is_file())


def _remove(path: Path) -> None:
    """``path`` gone, a file or a directory, if it was there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def oci_architecture() -> str:
    """This machine's architecture as OCI names it (``amd64``, ``arm64``, ...)."""
    machine = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def _sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return f"sha256:{h.hexdigest()}"


def _canonical(doc: dict) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
