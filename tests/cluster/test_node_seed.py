"""The seed containerd root's pure parts: its key, and a node's clone of it (no containerd)."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from collections import namedtuple
from pathlib import Path

import pytest

from conveyor.cluster.node_images import share_blobs
from conveyor.cluster.node_seed import (
    BOLT_DATABASES,
    PID_FILE,
    SEED_DONE,
    _stop_orphan,
    base_seed,
    clone_root,
    image_index,
    prune_seeds,
    seed_key,
    sweep_partials,
)
from conveyor.cluster.real_nodes import PROJECT_IMAGE, node_image_path


def _archive(path: Path, index: bytes) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in (("oci-layout", b"{}"), ("index.json", index)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_the_key_follows_each_archive_s_index_and_containerd_s_version(tmp_path: Path) -> None:
    a = image_index(_archive(tmp_path / "a.tar", b'{"manifests": ["sha256:a"]}'))
    b = image_index(_archive(tmp_path / "b.tar", b'{"manifests": ["sha256:b"]}'))
    assert a == b'{"manifests": ["sha256:a"]}'
    key = seed_key([a, b], "containerd 1.6.20")
    assert key == seed_key([a, b], "containerd 1.6.20")
    assert len({key, seed_key([b, a], "containerd 1.6.20"), seed_key([a, b], "2.0")}) == 3


def test_a_clone_shares_the_seed_s_files_but_not_its_databases(tmp_path: Path) -> None:
    seed = tmp_path / "seed"
    blob = seed / "io.containerd.content.v1.content/blobs/sha256/abc"
    layer = seed / "io.containerd.snapshotter.v1.overlayfs/snapshots/1/fs/etc/os-release"
    for f in (blob, layer, *(seed / db for db in BOLT_DATABASES)):
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(f.name)
    root = tmp_path / "node/containerd"
    root.mkdir(parents=True)
    (root / "stale").write_text("from a crashed run")

    clone_root(seed, root)

    assert not (root / "stale").exists()
    for f in (blob, layer):
        twin = root / f.relative_to(seed)
        assert twin.stat().st_ino == f.stat().st_ino  # hardlinked
    for db in BOLT_DATABASES:
        assert (root / db).read_text() == (seed / db).read_text()
        assert (root / db).stat().st_ino != (seed / db).stat().st_ino  # copied
    snapshots = root / "io.containerd.snapshotter.v1.overlayfs/snapshots"
    assert snapshots.stat().st_ino != (seed / snapshots.relative_to(root)).stat().st_ino


def test_node_image_names_a_layout_an_archive_or_the_project_s_image(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="conveyor image build"):
        node_image_path(PROJECT_IMAGE, cache=tmp_path)
    with pytest.raises(FileNotFoundError, match="no OCI archive or layout directory"):
        node_image_path(str(tmp_path / "missing.tar"))
    with pytest.raises(FileNotFoundError, match="no OCI archive or layout directory"):
        node_image_path(str(tmp_path))  # a directory, but no layout
    archive = _archive(tmp_path / "conveyor-0.0.tar", b"{}")
    assert node_image_path(str(archive)) == archive
    layout = tmp_path / "conveyor-0.0.oci"
    layout.mkdir()
    (layout / "index.json").write_text("{}")
    assert node_image_path(str(layout)) == layout


def test_a_layout_s_blobs_and_the_seed_s_become_one_file_each(tmp_path: Path) -> None:
    """The store's own copy of a blob (as an import writes it) is replaced by a link to the
    layout's, its bytes counted as freed unless another name still holds them; a blob the
    store lacks stays out (containerd knows nothing of it), and the store's others stay."""
    blobs = tmp_path / "image.oci/blobs/sha256"
    blobs.mkdir(parents=True)
    for name in ("a", "b", "c"):
        (blobs / name).write_bytes(name.encode() * 100)
    content = tmp_path / "seed/io.containerd.content.v1.content/blobs/sha256"
    content.mkdir(parents=True)
    (content / "b").write_bytes(b"b" * 100)  # a copy only the seed holds
    (content / "c").write_bytes(b"c" * 100)
    os.link(content / "c", tmp_path / "other-seed-c")  # a copy another seed shares
    (content / "other").write_bytes(b"not the image's")

    assert share_blobs(tmp_path / "image.oci", content) == 100

    for name in ("b", "c"):
        assert (content / name).stat().st_ino == (blobs / name).stat().st_ino
    assert (content / "other").read_bytes() == b"not the image's"
    assert sorted(p.name for p in content.iterdir()) == ["b", "c", "other"]
    assert share_blobs(tmp_path / "image.oci", content) == 0  # already one file each
    assert share_blobs(tmp_path / "image.oci", tmp_path / "no-store") == 0


def test_a_killed_builds_containerd_is_stopped_and_nothing_else(tmp_path: Path) -> None:
    work, other = tmp_path / "key.partial", tmp_path / "elsewhere"
    work.mkdir()
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    orphan = subprocess.Popen([*sleep, str(work)], start_new_session=True)
    bystander = subprocess.Popen([*sleep, str(other)], start_new_session=True)
    try:
        (work / PID_FILE).write_text(str(bystander.pid))  # a pid reused by another process
        _stop_orphan(work)
        assert bystander.poll() is None
        (work / PID_FILE).write_text(str(orphan.pid))
        _stop_orphan(work)
        assert orphan.wait(10) is not None  # gone (and reaped by the stop, its parent here)
        assert bystander.poll() is None
    finally:
        for proc in (orphan, bystander):
            proc.kill()
            proc.wait()


def test_only_the_most_recently_used_seeds_are_kept(tmp_path: Path) -> None:
    for age, name in enumerate(["newest", "older", "oldest"]):
        (tmp_path / name / "containerd").mkdir(parents=True)
        (tmp_path / name / SEED_DONE).write_text("{}")
        os.utime(tmp_path / name / SEED_DONE, (1e9 - age, 1e9 - age))
    (tmp_path / "building.partial").mkdir()  # another build's, in progress
    assert prune_seeds(tmp_path, keep=2) == [tmp_path / "oldest"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["building.partial", "newest", "older"]


def test_a_new_seed_grows_from_the_kept_seed_sharing_most_of_its_images(tmp_path: Path) -> None:
    """Of the same containerd's seeds, the one holding most of the new images (by index, then
    by path) wins over a newer one holding fewer: a test's one-image seed, used last, must not
    make the project's next seed import every image again."""
    v = "containerd 1.6.20"

    def seed(name: str, age: int, **record: object) -> None:
        (tmp_path / name / "containerd").mkdir(parents=True)
        (tmp_path / name / SEED_DONE).write_text(json.dumps(record))
        os.utime(tmp_path / name / SEED_DONE, (1e9 - age, 1e9 - age))

    seed("other-containerd", 0, containerd="containerd 2.0", indexes=["p", "c", "v"])
    seed("test-busybox", 1, containerd=v, indexes=["p", "b"], images=["pause", "busybox"])
    seed("project", 3, containerd=v, indexes=["p", "c", "v"], images=["pause", "conveyor", "vllm"])
    seed("before-indexes-were-kept", 4, containerd=v, images=["pause", "conveyor", "vllm"])
    seed("before-versions-were-kept", 2, import_s=200)
    (tmp_path / "building.partial").mkdir()

    # the project's image rebuilt after a source edit: a new index at the same path
    assert base_seed(tmp_path, v, ["p", "c2", "v"], ["pause", "conveyor", "vllm"]) == (
        tmp_path / "project"
    )
    # the same, but only paths to go by: the newer of two equal seeds
    assert base_seed(tmp_path, v, ["x"], ["pause", "conveyor", "vllm"]) == tmp_path / "project"
    # nothing shared: the most recently used of this containerd's
    assert base_seed(tmp_path, v, ["q"], ["elsewhere"]) == tmp_path / "test-busybox"
    assert base_seed(tmp_path, "containerd 1.7", ["p"], ["pause"]) is None


def test_killed_builds_are_swept_and_complete_seeds_kept(tmp_path: Path) -> None:
    for name in ("a.partial", "b.partial", "kept"):
        (tmp_path / name / "containerd").mkdir(parents=True)
    (tmp_path / "kept" / SEED_DONE).write_text("{}")
    assert sweep_partials(tmp_path) == [tmp_path / "a.partial", tmp_path / "b.partial"]
    assert [p.name for p in tmp_path.iterdir()] == ["kept"]


def test_a_seed_that_fails_to_grow_from_the_last_is_imported_from_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Growing from the last seed only saves time: when the clone or the import on it fails,
    the same seed is made from an empty root, and the first failure is said, not raised."""
    from conveyor.cluster import node_seed

    cache = tmp_path / "cache"
    for db in BOLT_DATABASES:
        (cache / "last" / "containerd" / db).parent.mkdir(parents=True)
        (cache / "last" / "containerd" / db).write_text("bolt")
    (cache / "last" / SEED_DONE).write_text('{"containerd": "containerd 1.6.20", "import_s": 3}')
    archive = _archive(tmp_path / "a.tar", b'{"manifests": [{"digest": "sha256:a"}]}')
    monkeypatch.setattr(node_seed, "containerd_version", lambda: "containerd 1.6.20")
    imports: list[bool] = []

    def import_into(layout: node_seed.NodeLayout, archives: object) -> None:
        grown = layout.containerd_root.exists()  # cloned from the last seed
        imports.append(grown)
        if grown:
            raise RuntimeError("ctr images import: content digest sha256:a: not found")
        layout.containerd_root.mkdir(parents=True)

    monkeypatch.setattr(node_seed, "_import_into", import_into)
    seed = node_seed.seed_root([archive], cache=cache)
    assert imports == [True, False]
    assert not seed.cached and seed.root.is_dir()
    done = seed.root.parent / SEED_DONE
    assert '"based_on": null' in done.read_text()


def test_a_failed_build_leaves_nothing_and_says_when_the_disk_is_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A half-imported root is gigabytes: a failed build removes it. When the disk is nearly
    full (the likely cause) the error says so and what to free; a killed build's leftovers are
    swept by the next build."""
    from conveyor.cluster import node_seed

    cache = tmp_path / "cache"
    (cache / "killed.partial" / "containerd").mkdir(parents=True)
    archive = _archive(tmp_path / "a.tar", b'{"manifests": [{"digest": "sha256:a"}]}')
    monkeypatch.setattr(node_seed, "containerd_version", lambda: "containerd 1.6.20")

    def import_into(layout: node_seed.NodeLayout, archives: object) -> None:
        (layout.containerd_root / "blobs").mkdir(parents=True)
        (layout.containerd_root / "blobs" / "half").write_bytes(b"x" * 1024)
        raise RuntimeError("ctr images import: write /blobs/half: no space left on device")

    monkeypatch.setattr(node_seed, "_import_into", import_into)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100 << 30, 99 << 30, 1 << 29))
    with pytest.raises(RuntimeError, match=r"only 0\.5 GiB is free .* free some space"):
        node_seed.seed_root([archive], cache=cache)
    assert [p.name for p in cache.iterdir()] == [".lock"]

    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100 << 30, 1 << 30, 99 << 30))
    with pytest.raises(RuntimeError, match=r"^ctr images import"):  # plenty of space: as it was
        node_seed.seed_root([archive], cache=cache)
    assert [p.name for p in cache.iterdir()] == [".lock"]
