"""A seed containerd root for real nodes: the images imported and unpacked once, cloned into
every node by hardlinks.

``ctr images import`` of the project's image (6.7 GB of plain tar layers) takes minutes per
node, almost all of it writing the blobs and unpacking the layers. A seed root holds the content blobs
and the unpacked overlayfs snapshots of every image the nodes get; it is made once per set of
images (keyed by each image's ``index.json``, which names its manifest by digest, and by
containerd's version) under ``~/.cache/conveyor/node-seed/<key>`` and kept, like the image
cache. A node's containerd root is then ``clone_root``: its directories made anew, every file
hardlinked (``cp -al``), except the bolt databases (containerd's metadata and the overlayfs
snapshotter's), which a running containerd writes in place and so are copied.

Why hardlinks are safe: content blobs are written once and verified by digest; a committed
snapshot is an overlay lower layer, which overlayfs never writes (a container's writes go to
its own upper directory, made by its own containerd, copying a file up before changing it).
Garbage collection in one node unlinks its own names only.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from conveyor.cluster.image_oci import image_index as read_image_index
from conveyor.cluster.kubelet_config import (
    CRI_NAMESPACE,
    HARD_CODED_DIRS,
    NodeLayout,
    containerd_config,
    namespace_argv,
)
from conveyor.cluster.node_images import PAUSE_IMAGE, import_image, share_blobs

BOLT_DATABASES = (
    "io.containerd.metadata.v1.bolt/meta.db",
    "io.containerd.snapshotter.v1.overlayfs/metadata.db",
)
"""containerd's metadata (``io.containerd.metadata.v1.bolt/meta.db``) and the overlayfs
snapshotter's (``io.containerd.snapshotter.v1.overlayfs/metadata.db``): written in place by
a running containerd, so each node gets its own copy."""

PID_FILE = "containerd.pid"
"""The seed build's containerd, written while it runs (a build killed mid-import leaves it)."""
SEED_DONE = "seed.json"
"""Written last into a seed's directory: the seed is complete (and what made it, how fast)."""
KEEP_SEEDS = 2
"""Seeds kept, the most recently used first: a source edit makes a new image and so a new seed
(cloned from the last, so the two share all but the image's top layer on disk); the one before
stays for a quick switch back. A running node's root is a hardlink clone, so removing its seed
frees nothing it still uses."""


def seed_cache() -> Path:
    """Where seeds are kept (shared by every cluster of this user; a cache, never removed)."""
    return Path.home() / ".cache" / "conveyor" / "node-seed"


def image_index(image: Path) -> bytes:
    """The ``index.json`` of an OCI layout directory or archive (it names the image's manifest
    by digest)."""
    index = read_image_index(image)
    if index is None:
        raise ValueError(f"{image} has no index.json: not an OCI layout or archive")
    return index


def containerd_version() -> str:
    return subprocess.run(
        ["containerd", "--version"], capture_output=True, text=True, check=True
    ).stdout.strip()


def seed_key(indexes: Sequence[bytes], version: str) -> str:
    """The seed's name: the images' indexes in order, and containerd's version."""
    digest = hashlib.sha256(version.encode())
    for index in indexes:
        digest.update(hashlib.sha256(index).digest())
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def _locked(cache: Path) -> Iterator[None]:
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@dataclass(frozen=True)
class Seed:
    root: Path
    """The containerd root that nodes clone."""
    import_s: float
    """How long its import took when it was made."""
    cached: bool
    """Found in the cache (not made by this call)."""


def seed_root(images: Sequence[Path], *, cache: Path | None = None) -> Seed:
    """The seed's containerd root holding ``images`` (the pause image first), made if it is
    not in the cache: a containerd of its own imports and unpacks them, then stops.

    A new seed starts as a clone of the newest one the same containerd made (``clone_root``:
    hardlinks), so what the images share with it is neither written nor unpacked again: after
    a source edit only the image's thin top layer is new, and the two seeds share the rest on
    disk. What the clone held that no image of the new seed uses is collected before it is
    kept.

    A build that fails leaves nothing behind (a half-imported root is gigabytes), nor do
    builds that were killed: every ``.partial`` found under the lock is one's."""
    cache = cache or seed_cache()
    version = containerd_version()
    raw = [image_index(a) for a in images]
    key = seed_key(raw, version)
    indexes = [_digest(index) for index in raw]
    seed = cache / key
    with _locked(cache):
        if (seed / SEED_DONE).exists():
            os.utime(seed / SEED_DONE)  # used now: the last to be pruned
            _share_layouts(cache, images)
            return Seed(seed / "containerd", _import_s(seed), cached=True)
        sweep_partials(cache)
        work = cache / f"{key}.partial"
        t0 = time.monotonic()
        layout = NodeLayout("seed", key, work)
        paths = [str(a) for a in images]
        base = base_seed(cache, version, indexes, paths)
        try:
            try:
                if base is not None:
                    clone_root(base / "containerd", layout.containerd_root)
                _import_into(layout, images)
            except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
                if base is None:
                    raise
                # Growing from a kept seed is an optimisation: whatever went wrong in it (a
                # clone that disagrees with its databases, say), an import from nothing is the
                # same seed, minutes slower.
                print(
                    f"[seed] growing from {base.name} failed ({exc}); importing from nothing",
                    file=sys.stderr,
                    flush=True,
                )
                _stop_orphan(work)
                shutil.rmtree(work, ignore_errors=True)
                base = None
                _import_into(layout, images)
        except BaseException as exc:
            short = _short_of_space(cache)  # before the partial root's space is freed
            _stop_orphan(work)
            shutil.rmtree(work, ignore_errors=True)
            if isinstance(exc, Exception) and short:
                raise RuntimeError(f"making the nodes' seed {key} failed ({exc}); {short}") from exc
            raise
        record = {
            "images": paths,
            "indexes": indexes,
            "import_s": round(time.monotonic() - t0, 1),
            "containerd": version,
            "based_on": base.name if base else None,
        }
        for stale in ("containerd-state", "run-containerd", "device-plugins", "container-logs"):
            shutil.rmtree(work / stale, ignore_errors=True)
        (work / "containerd.sock.ttrpc").unlink(missing_ok=True)
        (work / PID_FILE).unlink(missing_ok=True)
        (work / SEED_DONE).write_text(json.dumps(record, indent=2))
        if seed.exists():
            shutil.rmtree(seed)
        work.rename(seed)
        prune_seeds(cache, keep=KEEP_SEEDS)
        _share_layouts(cache, images)
    return Seed(seed / "containerd", _import_s(seed), cached=False)


def _content(root: Path) -> Path:
    """A containerd root's blob directory."""
    return root / "io.containerd.content.v1.content/blobs/sha256"


def _share_layouts(cache: Path, images: Sequence[Path]) -> None:
    """The blobs of the layout directories among ``images`` and those of every kept seed made
    one file each (a seed imported from archives holds its own copies: gigabytes, freed once
    no seed holds them)."""
    for seed in _complete_seeds(cache):
        for image in images:
            if image.is_dir():
                freed = share_blobs(image, _content(seed / "containerd"))
                if freed:
                    print(f"[seed] {seed.name}: {freed / 1e6:.0f} MB of blobs now shared with "
                          f"{image.name}", file=sys.stderr, flush=True)  # fmt: skip


def _digest(index: bytes) -> str:
    return hashlib.sha256(index).hexdigest()


def base_seed(
    cache: Path, version: str, indexes: Sequence[str], images: Sequence[str]
) -> Path | None:
    """The kept seed a new one grows from: of the complete seeds made by containerd
    ``version`` (another version's databases may not be this one's), the one holding the most
    of the new seed's images (by ``index.json`` digest, then by path: after a source edit the
    project's image is at the same path with a new index), the most recently used among equals;
    None when there is none.

    Shared images are neither written nor unpacked again; the newest seed alone may be a test's
    one-image seed, from which growing the project's images writes all of their gigabytes."""
    best: tuple[int, int] | None = None
    chosen = None
    for seed in _complete_seeds(cache):  # most recently used first: ties keep the first
        try:
            record = json.loads((seed / SEED_DONE).read_text())
        except (OSError, ValueError):
            continue
        if record.get("containerd") != version:
            continue
        shared = (
            len(set(indexes) & set(record.get("indexes", []))),
            len(set(images) & set(record.get("images", []))),
        )
        if best is None or shared > best:
            best, chosen = shared, seed
    return chosen


def sweep_partials(cache: Path) -> list[Path]:
    """Remove every ``.partial`` build in the cache (its containerd stopped first); the removed
    ones. Called under the cache's lock, which a build holds from start to end: a ``.partial``
    seen then is a killed build's, gigabytes that no later build of another set of images
    would reuse."""
    swept = sorted(cache.glob("*.partial"))
    for work in swept:
        _stop_orphan(work)
        shutil.rmtree(work, ignore_errors=True)
    return swept


def _short_of_space(cache: Path) -> str | None:
    """What to do when the disk under ``cache`` is nearly full (the likely cause of a failed
    import), or None when it is not."""
    free = shutil.disk_usage(cache).free
    if free > 2 * 1024**3:
        return None
    return (
        f"only {free / 1024**3:.1f} GiB is free on the disk of {cache}. A seed holds its images "
        "twice (their blobs and the unpacked layers); free some space (old checkouts and their "
        ".venv, ~/.cache/pip) and run it again"
    )


def _complete_seeds(cache: Path) -> list[Path]:
    """The complete seeds, the most recently used first."""
    return sorted(
        (d for d in cache.iterdir() if (d / SEED_DONE).exists()),
        key=lambda d: (d / SEED_DONE).stat().st_mtime,
        reverse=True,
    )


def prune_seeds(cache: Path, *, keep: int) -> list[Path]:
    """Remove all but the ``keep`` most recently used complete seeds; the removed ones. Builds
    in progress (``.partial``) are left to the build that owns them."""
    seeds = _complete_seeds(cache)
    for old in seeds[keep:]:
        shutil.rmtree(old)
    return seeds[keep:]


def _import_s(seed: Path) -> float:
    return float(json.loads((seed / SEED_DONE).read_text())["import_s"])


def _import_into(layout: NodeLayout, images: Sequence[Path]) -> None:
    """Start a containerd on ``layout``'s directories (as a node's: its own mount namespace),
    import every image into the CRI namespace, stop it."""
    for d in (layout.root, *layout.own_dirs(), layout.cni_conf_dir):
        d.mkdir(parents=True, exist_ok=True)
    for d in HARD_CODED_DIRS:
        d.mkdir(parents=True, exist_ok=True)
    config = layout.root / "containerd.toml"
    config.write_text(containerd_config(layout, sandbox_image=PAUSE_IMAGE))
    log = (layout.root / "containerd.log").open("w")
    proc = subprocess.Popen(
        namespace_argv(layout, ["containerd", "--config", str(config)]),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    (layout.root / PID_FILE).write_text(str(proc.pid))
    try:
        deadline = time.monotonic() + 30
        while not _answers(layout.containerd_socket):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the seed's containerd did not start: see {log.name}")
            time.sleep(0.05)
        content = _content(layout.containerd_root)
        for image in images:
            import_image(layout.containerd_socket, image, content=content)
        keep = {m["digest"] for a in images for m in json.loads(image_index(a))["manifests"]}
        _collect_garbage(layout.containerd_socket, keep)
        _check_unpacked(layout.containerd_socket)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _stop_orphan(work: Path) -> None:
    """SIGKILL the containerd of a seed build that was itself killed (``up`` SIGKILLed mid
    import leaves it running), and its process group (the import's ``ctr``): the pid in
    ``PID_FILE``, if that process still runs on ``work``'s config (a pid can be reused)."""
    try:
        pid = int((work / PID_FILE).read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return
    if str(work).encode() in cmdline:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.waitpid(pid, 0)


def _ctr(argv: list[str]) -> str:
    """Run a ``ctr`` command; its stdout. A failure raises with what ``ctr`` said (a bare
    CalledProcessError says only the exit status)."""
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout).strip()
        raise RuntimeError(f"{' '.join(argv[3:])} failed (exit {proc.returncode}): {said}")
    return proc.stdout


def _answers(socket: Path) -> bool:
    if not socket.exists():
        return False
    argv = ["ctr", "-a", str(socket), "version"]
    return subprocess.run(argv, capture_output=True, timeout=10).returncode == 0


def _collect_garbage(socket: Path, keep: set[str]) -> None:
    """Remove every image whose manifest is not in ``keep`` (a cloned seed's: the image the
    import replaced, and the ``sha256:ID`` names the CRI plugin gives each image), then run
    containerd's garbage collection and wait for it, so that their blobs and snapshots go.
    ``images rm --sync`` of a throwaway tag is how ``ctr`` asks for a collection now."""
    ctr = ["ctr", "-a", str(socket), "-n", CRI_NAMESPACE, "images"]
    listed = _ctr([*ctr, "ls"])
    rows = [line.split() for line in listed.splitlines()[1:] if line.strip()]
    stale = [row[0] for row in rows if row[2] not in keep]  # REF TYPE DIGEST ...
    throwaway = "conveyor.local/seed-gc:collect"
    _ctr([*ctr, "tag", "--force", PAUSE_IMAGE, throwaway])
    _ctr([*ctr, "rm", "--sync", *stale, throwaway])


def _check_unpacked(socket: Path) -> None:
    """Every image's layers are unpacked into the overlayfs snapshotter (else each node would
    unpack at its first container, which is the cost the seed is for)."""
    ctr = ["ctr", "-a", str(socket), "-n", CRI_NAMESPACE]
    for name in _ctr([*ctr, "images", "ls", "-q"]).split():
        out = _ctr([*ctr, "images", "check", f"name=={name}"])
        # REF TYPE DIGEST STATUS SIZE UNPACKED, the last column "true" or "false"
        rows = out.strip().splitlines()[1:]
        if not rows or any(row.split()[-1] != "true" for row in rows):
            raise RuntimeError(f"{name} is not unpacked in the seed: {out.strip()}")


def clone_root(seed: Path, root: Path) -> None:
    """``root`` made a containerd root equal to ``seed``: directories new, files hardlinked,
    the bolt databases copied (see the module's docstring)."""
    if root.exists():
        shutil.rmtree(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-al", str(seed), str(root)], check=True)
    for name in BOLT_DATABASES:
        db = root / name
        copy = db.with_name(db.name + ".copy")
        shutil.copy2(db, copy)
        copy.replace(db)
