"""``conveyor image build``: the project's image without a container engine.

The layers ``image_plan`` names are built one on another, each only when the cache lacks its
key: the base with debootstrap into a plain directory; the deps and src layers by running
their step of cluster/image-steps.sh in a chroot on an overlay of the layers below, whose
upper directory is the new layer. Every mount lives in a private mount namespace
(``unshare --mount``), so a build that dies leaves none behind. Each layer's tar is added,
uncompressed, to an OCI layout in the cache (tag = the layer's key; ``image_oci``), then the
configuration the Dockerfile states, and the image itself: an OCI layout directory whose blobs
are hardlinks to the cache's, which the real nodes' seed imports.

The cache, ``$CONVEYOR_CACHE/images`` (``~/.cache/conveyor/images``), holds the layout, the
base's root file system and the deps' upper directory (the lower layers of the next build),
and pip's cache, which outlives every layer (where the package index lets pip cache its
answers: this machine's proxy sends no caching headers, so here a deps rebuild downloads
again). One build at a time: a lock file.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from conveyor.cluster.image_oci import (
    CANONICAL_REGISTRY,
    ImageBuildError,
    OciLayout,
    ToolRunner,
)
from conveyor.cluster.image_plan import (
    DEPS_INPUTS,
    STEPS_SCRIPT,
    VLLM_INSTALLER,
    VLLM_STEP,
    ImageSettings,
    Layer,
    dockerfile_config,
    plan_layers,
    source_paths,
)

TOOLS = {
    "debootstrap": "debootstrap",
    "unshare": "util-linux",
    "chroot": "coreutils",
    "tar": "tar",
}
"""Each tool the build runs and the Debian package that has it (install-system-deps.sh)."""

IN_IMAGE_STEPS = "/opt/conveyor/image-steps.sh"
_HOST_CA = "/etc/ssl/certs/ca-certificates.crt"
_PIP_PASSED = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST", "PIP_DEFAULT_TIMEOUT")
"""This machine's package-index settings, which the steps' pip uses too."""
_CHROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class LayerReport:
    """How one layer of a build came about."""

    layer: Layer
    cached: bool
    seconds: float
    tar_bytes: int
    """Size of the layer unpacked (its uncompressed tar)."""
    blob_bytes: int
    """Size of the layer as stored in the image: the same plain tar (gzip in a cache from
    before layers were stored uncompressed)."""


@dataclass(frozen=True)
class BuildResult:
    name: str
    image: Path
    """The OCI layout directory (or archive, for a ``.tar`` output) written."""
    layers: list[LayerReport]
    seconds: float


def images_cache() -> Path:
    """``$CONVEYOR_CACHE/images``, ``~/.cache/conveyor/images`` by default."""
    root = os.environ.get("CONVEYOR_CACHE") or os.path.join(Path.home(), ".cache", "conveyor")
    return Path(root) / "images"


def default_image(version: str, cache: Path | None = None, repository: str = "conveyor") -> Path:
    """Where ``conveyor image build`` writes the image ``repository:version`` unless told
    otherwise: an OCI layout directory whose blobs are hardlinks to the cache's."""
    return (cache or images_cache()) / f"{repository}-{version}.oci"


def _legacy_archive(image: Path) -> Path:
    """Where builds before ``default_image`` wrote the same image as an OCI archive (a full
    copy, gigabytes): removed when the directory is written."""
    return image.with_name(image.name + ".tar")


def missing_tools() -> dict[str, str]:
    """The build's tools this machine lacks, each with the Debian package that has it."""
    return {tool: pkg for tool, pkg in TOOLS.items() if shutil.which(tool) is None}


class ImageBuilder:
    """Builds one image from ``settings`` into the cache and writes it out (``build``)."""

    def __init__(
        self,
        settings: ImageSettings,
        *,
        cache: Path,
        no_cache: bool = False,
        progress: Callable[[str], None] = print,
    ) -> None:
        self.settings = settings
        self.cache = cache
        self.no_cache = no_cache
        self.say = progress
        self.dirs = cache / "dirs"
        self.logs = cache / "logs"
        self.pip_cache = cache / "pip"
        self._sizes_file = cache / "layers.json"
        self._run = ToolRunner(self.logs)
        self.oci = OciLayout(cache / "oci")

    def build(self, output: Path | None = None) -> BuildResult:
        """Build what the cache lacks and write the image: an OCI layout directory (default:
        ``default_image``, beside the cache) or, to a ``.tar`` ``output``, an OCI archive."""
        missing = missing_tools()
        if missing:
            raise ImageBuildError(
                f"missing tools: {', '.join(missing)} (Debian packages "
                f"{' '.join(sorted(set(missing.values())))}); install them with "
                "cluster/install-system-deps.sh (as root)"
            )
        if os.geteuid() != 0:
            raise ImageBuildError(
                "building the image needs root (debootstrap, mounts, chroot): run it as root"
            )
        if not self.settings.dockerfile.is_file():
            raise ImageBuildError(
                f"{self.settings.repo} is not a Conveyor checkout (no "
                f"{self.settings.dockerfile.name}): pass --repo"
            )
        started = time.monotonic()
        version = self.settings.version()
        repository = self.settings.repository
        name = f"{repository}:{version}"
        image = output or default_image(version, self.cache, repository)
        for d in (self.dirs, self.logs, self.pip_cache):
            d.mkdir(parents=True, exist_ok=True)
        with self._locked():
            self.oci.ensure()
            layers = plan_layers(self.settings)
            reports = [self._layer(layer, top=layer is layers[-1]) for layer in layers]
            top = reports[-1].layer
            self._finish(top, version, image)
            self.oci.prune_siblings(keep=top.tag, prefix=f"{top.kind}-")
            self._prune_other_bases(reports[0].layer)
            self.oci.collect_garbage()  # what a rebuilt tag (--no-cache) no longer holds
        return BuildResult(name, image, reports, time.monotonic() - started)

    # -- one layer ---------------------------------------------------------------------------

    def _layer(self, layer: Layer, *, top: bool) -> LayerReport:
        """``layer`` from the cache, or built and packed. The ``top`` layer's directory is
        dropped once packed: nothing is built on it, and only its blob is kept."""
        sizes = self._sizes()
        if not self.no_cache and self._cached(layer, top=top) and layer.tag in sizes:
            self.say(f"{layer.kind}: cached ({layer.tag})")
            return LayerReport(layer, True, 0.0, *sizes[layer.tag])
        self.say(f"{layer.kind}: building ({layer.tag})")
        started = time.monotonic()
        if layer.kind == "base":
            upper = self._build_base(layer)
        else:
            upper = self._build_on_overlay(layer)
        self.say(f"{layer.kind}: built in {time.monotonic() - started:.1f} s; packing")
        tar_bytes = self._append(layer, upper)
        if top:
            shutil.rmtree(upper.parent)
        blob_bytes = self.oci.top_layer_size(layer.tag)
        sizes[layer.tag] = (tar_bytes, blob_bytes)
        self._sizes_file.write_text(json.dumps(sizes))
        seconds = time.monotonic() - started
        self.say(f"{layer.kind}: done in {seconds:.1f} s, {tar_bytes / 1e6:.0f} MB")
        return LayerReport(layer, False, seconds, tar_bytes, blob_bytes)

    def _cached(self, layer: Layer, *, top: bool) -> bool:
        """Its tag is in the layout and, for a layer others build on, its directory is kept."""
        if layer.tag not in self.oci.tags():
            return False
        return top or (self.dirs / layer.tag).is_dir()

    def _build_base(self, layer: Layer) -> Path:
        final = self.dirs / layer.tag
        work = self.dirs / f"{layer.tag}.partial"
        shutil.rmtree(final, ignore_errors=True)
        if self.no_cache:
            shutil.rmtree(work, ignore_errors=True)
        rootfs = work / "rootfs"
        # A build that failed after debootstrap (minutes) resumes from its root file system:
        # the steps after it are idempotent.
        debootstrapped = work / "debootstrapped"
        if not debootstrapped.exists():
            shutil.rmtree(work, ignore_errors=True)
            self._debootstrap(rootfs)
            debootstrapped.touch()
        (rootfs / IN_IMAGE_STEPS.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.settings.repo / STEPS_SCRIPT, rootfs / IN_IMAGE_STEPS.lstrip("/"))
        (rootfs / "etc/resolv.conf").unlink(missing_ok=True)
        (rootfs / "etc/resolv.conf").write_text("")  # the runtime mounts its own
        self._chroot_step(lowers=[], upper=rootfs, step="user")
        # What a container runtime provides, and what apt only needs at install time.
        for junk in ("dev", "var/lib/apt/lists", "var/cache/apt", "var/log", "tmp"):
            for entry in (rootfs / junk).glob("*"):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
        debootstrapped.unlink()
        work.rename(final)
        return final / "rootfs"

    def _debootstrap(self, rootfs: Path) -> None:
        s = self.settings
        packages = self._run(["bash", str(s.repo / STEPS_SCRIPT), "packages"]).strip()
        self.say(f"base: debootstrap {s.suite} from {s.mirror} with {packages}")
        started = time.monotonic()
        self._run(
            [
                "debootstrap", "--variant=minbase", f"--arch={s.arch}",
                f"--include={packages.replace(' ', ',')}", s.suite, str(rootfs), s.mirror,
            ],
            log="debootstrap",
        )  # fmt: skip
        self.say(f"base: debootstrap done in {time.monotonic() - started:.1f} s")

    def _build_on_overlay(self, layer: Layer) -> Path:
        assert layer.parent is not None
        final = self.dirs / layer.tag
        shutil.rmtree(final, ignore_errors=True)
        work = self.dirs / f"{layer.tag}.partial"
        shutil.rmtree(work, ignore_errors=True)
        upper = work / "upper"
        build = upper / "opt/conveyor/build"
        command = None
        if layer.kind == "vllm":
            build.mkdir(parents=True)
            shutil.copy(self.settings.repo / VLLM_INSTALLER, build / "vllm_env.py")
            command = VLLM_STEP
        elif layer.kind == "deps":
            build.mkdir(parents=True)
            for rel in DEPS_INPUTS:
                shutil.copy(self.settings.repo / rel, build / Path(rel).name)
        else:
            for path in source_paths(self.settings.repo):
                dest = build / "src" / path.relative_to(self.settings.repo)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, dest)
        try:
            self._chroot_step(
                lowers=self._lowers(layer.parent), upper=upper, step=layer.kind, command=command
            )
            _check_no_whiteouts(upper, self._lowers(layer.parent))
        except BaseException:
            # Half a layer is of no use to the next build (which starts it anew), and vLLM's
            # or the deps' is gigabytes; the step's log says what happened.
            shutil.rmtree(work, ignore_errors=True)
            raise
        work.rename(final)
        return final / "upper"

    def _lowers(self, layer: Layer) -> list[Path]:
        """The directories of ``layer`` and those below it, top first (overlay's order)."""
        out: list[Path] = []
        at: Layer | None = layer
        while at is not None:
            out.append(self.dirs / at.tag / ("rootfs" if at.kind == "base" else "upper"))
            at = at.parent
        return out

    def _chroot_step(
        self, *, lowers: list[Path], upper: Path, step: str, command: str | None = None
    ) -> None:
        """Run one step of image-steps.sh (or the shell ``command`` for it) as root in a
        chroot: on ``upper`` itself (no lowers), or on an overlay whose writes land in
        ``upper``; mounts die with the namespace."""
        work = upper.parent / "overlay-work"
        merged = upper.parent / "merged"
        lines = ["set -eu"]
        if lowers:
            work.mkdir(exist_ok=True)
            merged.mkdir(exist_ok=True)
            options = f"lowerdir={':'.join(map(str, lowers))},upperdir={upper},workdir={work}"
            lines.append(
                f"mount -t overlay overlay -o {shlex.quote(options)} {shlex.quote(str(merged))}"
            )
            root = merged
        else:
            root = upper
        r = shlex.quote(str(root))
        lines += [
            f"mount --rbind /dev {r}/dev",
            f"mount -t proc proc {r}/proc",
            f"mount --bind /etc/resolv.conf {r}/etc/resolv.conf",
            # /mnt holds what the step uses and the layer must not: pip's download cache and
            # the certificates this machine trusts (a package-index proxy's CA among them).
            f"mount -t tmpfs tmpfs {r}/mnt",
            f"mkdir {r}/mnt/pip && mount --bind {shlex.quote(str(self.pip_cache))} {r}/mnt/pip",
        ]
        env = {
            "PATH": _CHROOT_PATH,
            "HOME": "/root",
            "LANG": "C.UTF-8",
            "PIP_CACHE_DIR": "/mnt/pip",
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "EXTRAS": ",".join(self.settings.extras),
        }
        env |= {k: v for k, v in os.environ.items() if k in _PIP_PASSED}
        ca = Path(os.environ.get("PIP_CERT") or _HOST_CA)
        if ca.is_file():
            lines.append(
                f"touch {r}/mnt/ca.crt && mount --bind {shlex.quote(str(ca))} {r}/mnt/ca.crt"
            )
            env["PIP_CERT"] = "/mnt/ca.crt"
        env_args = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
        run = shlex.quote(command) if command else shlex.quote(f"bash {IN_IMAGE_STEPS} {step}")
        lines.append(f"chroot {r} /usr/bin/env -i {env_args} bash -c {run}")
        script = "\n".join(lines)
        self._run(
            ["unshare", "--mount", "--propagation", "private", "bash", "-c", script], log=step
        )
        for leftover in (work, merged):
            shutil.rmtree(leftover, ignore_errors=True)

    # -- the OCI layout ----------------------------------------------------------------------

    def _append(self, layer: Layer, upper: Path) -> int:
        """Tar ``upper`` and append it to the parent's image as ``layer``'s tag; its size."""
        tar = self.dirs / f"{layer.tag}.tar"
        self._run(
            [
                "tar",
                "--create",
                "--file",
                str(tar),
                "--numeric-owner",
                "--directory",
                str(upper),
                ".",
            ]
        )
        size = tar.stat().st_size
        try:
            parent = layer.parent.tag if layer.parent else None
            created_by = f"image-steps.sh {layer.kind}"
            self.oci.append(tar, parent=parent, tag=layer.tag, created_by=created_by)
        finally:
            tar.unlink(missing_ok=True)  # moved into the layout unless append failed
        return size

    def _finish(self, top: Layer, version: str, image: Path) -> None:
        """The Dockerfile's configuration on the top layer, then the image written out."""
        tag = f"{self.settings.repository}-{version}"
        self.oci.configure(top.tag, tag, dockerfile_config(self.settings.dockerfile))
        started = time.monotonic()
        ref = f"{CANONICAL_REGISTRY}/{self.settings.repository}:{version}"
        self.oci.export(tag, image, ref)
        if image == default_image(version, self.cache, self.settings.repository):
            _legacy_archive(image).unlink(missing_ok=True)
        self.say(f"image: {image} in {time.monotonic() - started:.1f} s")

    def _prune_other_bases(self, base: Layer) -> None:
        """Drop what was built on an earlier base, tags and kept directories (gigabytes)."""
        stale = self.oci.on_other_bases(base.tag)
        for tag in stale:
            shutil.rmtree(self.dirs / tag, ignore_errors=True)
        if stale:
            self.say(f"removed {len(stale)} layers built on an earlier base: {', '.join(stale)}")
        self.oci.drop(stale)

    def _sizes(self) -> dict[str, tuple[int, int]]:
        try:
            recorded = json.loads(self._sizes_file.read_text())
            return {tag: (int(v[0]), int(v[1])) for tag, v in recorded.items()}
        except (OSError, ValueError):
            return {}

    # -- processes ---------------------------------------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.cache / ".lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.say(f"waiting for another image build (lock {self.cache / '.lock'})")
                fcntl.flock(lock, fcntl.LOCK_EX)
            yield


def _check_no_whiteouts(upper: Path, lowers: list[Path]) -> None:
    """A step that deletes what a lower layer holds leaves overlay whiteouts, which an OCI
    layer spells differently; the steps never do, and a build that starts to is stopped. A
    directory marked opaque hides a lower one of the same path, if there is one: the kernel
    also marks directories new to every lower layer (apt's package folders), which hide
    nothing and are fine."""
    for root, dirs, files in os.walk(upper):
        for name in files:
            st = os.lstat(os.path.join(root, name))
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                raise ImageBuildError(
                    f"{os.path.join(root, name)}: a step deleted a file of a lower layer; "
                    "image-steps.sh must only add files"
                )
        for name in dirs:
            path = os.path.join(root, name)
            try:
                opaque = os.getxattr(path, "trusted.overlay.opaque")
            except OSError:
                continue
            below = Path(path).relative_to(upper)
            if opaque == b"y" and any((lower / below).is_dir() for lower in lowers):
                raise ImageBuildError(f"{path}: a step replaced a directory of a lower layer")
