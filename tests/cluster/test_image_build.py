"""A real ``conveyor image build`` of a small image (no extras: no torch), then the image runs.

Minutes and root: skipped unless CONVEYOR_IMAGE_TESTS=1 and the tools are installed
(cluster/install-system-deps.sh). The base layer is shared with the user's image cache
($CONVEYOR_CACHE/images), so only the first run pays for debootstrap.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from conveyor.cluster.image_build import ImageBuilder, images_cache, missing_tools
from conveyor.cluster.image_oci import LAYER_TAR
from conveyor.cluster.image_plan import ImageSettings

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("CONVEYOR_IMAGE_TESTS") != "1",
        reason="builds a real image (minutes, root): set CONVEYOR_IMAGE_TESTS=1",
    ),
    pytest.mark.skipif(
        bool(missing_tools()) or shutil.which("runc") is None,
        reason="image tools missing: run cluster/install-system-deps.sh",
    ),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (debootstrap, mounts, runc)"),
]


def _run(*cmd: str | Path) -> str:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout}{proc.stderr}"
    return proc.stdout


def _unpack_archive(archive: Path, into: Path) -> tuple[dict, dict]:
    """Unpack the OCI archive into ``into``; the manifest and configuration of its one image."""
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")

    def blob(digest: str) -> dict:
        return dict(json.loads((into / "blobs" / Path(*digest.split(":"))).read_text()))

    (entry,) = json.loads((into / "index.json").read_text())["manifests"]
    manifest = blob(entry["digest"])
    return manifest, blob(manifest["config"]["digest"])


def run_in_image(archive: Path, work: Path, args: list[str]) -> str:
    """Unpack the archive's layers into a bundle and run ``args`` in it with runc, as the
    image's configuration says (user, environment, working directory); its stdout."""
    rootfs = work / "bundle" / "rootfs"
    rootfs.mkdir(parents=True)
    manifest, image = _unpack_archive(archive, work / "layout")
    for layer in manifest["layers"]:
        blob = work / "layout" / "blobs" / Path(*layer["digest"].split(":"))
        with tarfile.open(blob) as layer_tar:
            layer_tar.extractall(rootfs, numeric_owner=True, filter="fully_trusted")
    _run("runc", "spec", "--bundle", work / "bundle")
    config_path = work / "bundle" / "config.json"
    config = json.loads(config_path.read_text())
    uid, _, gid = image["config"].get("User", "0").partition(":")
    config["process"].update(
        args=args,
        terminal=False,
        env=image["config"].get("Env", []),
        cwd=image["config"].get("WorkingDir") or "/",
        user={"uid": int(uid), "gid": int(gid or uid)},
    )
    config["root"]["readonly"] = False
    config_path.write_text(json.dumps(config))
    name = f"conveyor-image-test-{os.getpid()}"
    try:
        return _run("runc", "--root", work / "runc", "run", "--bundle", work / "bundle", name)
    finally:
        subprocess.run(
            ["runc", "--root", str(work / "runc"), "delete", "--force", name],
            check=False,
            capture_output=True,
        )


def test_a_small_image_builds_in_layers_and_runs(image_repo: Path, tmp_path: Path) -> None:
    lines: list[str] = []
    builder = ImageBuilder(
        ImageSettings(repo=image_repo, extras=()), cache=images_cache(), progress=lines.append
    )
    first = builder.build(tmp_path / "first.oci.tar")
    assert [r.layer.kind for r in first.layers] == ["base", "deps", "src"]
    assert first.name == "conveyor:0.1.0"

    manifest, config = _unpack_archive(first.image, tmp_path / "first")
    # Three plain-tar layers (nothing gzips them), each its own diff ID.
    assert [layer["mediaType"] for layer in manifest["layers"]] == [LAYER_TAR] * 3
    assert config["rootfs"]["diff_ids"] == [layer["digest"] for layer in manifest["layers"]]
    assert config["config"]["Entrypoint"] == ["conveyor"]
    assert config["config"]["User"] == "1000:1000"

    # One line of source changed: the base and the dependencies come from the cache.
    routing = image_repo / "gateway" / "routing.py"
    routing.write_text(routing.read_text() + "\n# one more line\n")
    second = builder.build(tmp_path / "second.oci.tar")
    assert [r.cached for r in second.layers] == [True, True, False]
    assert second.layers[-1].layer.key != first.layers[-1].layer.key

    out = run_in_image(second.image, tmp_path / "run", ["conveyor", "--help"])
    assert "usage: conveyor COMMAND" in out and "image" in out
    out = run_in_image(
        second.image,
        tmp_path / "run2",
        ["python", "-c", "import conveyor.runtime, os; print('uid', os.getuid())"],
    )
    assert out.strip() == "uid 1000"
