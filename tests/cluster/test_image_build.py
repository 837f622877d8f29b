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
from pathlib import Path

import pytest

from conveyor.cluster.image_build import ImageBuilder, images_cache, missing_tools
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


def run_in_image(archive: Path, work: Path, args: list[str]) -> str:
    """Unpack the archive into a bundle and run ``args`` in it with runc; its stdout."""
    work.mkdir()
    _run("skopeo", "copy", "--quiet", f"oci-archive:{archive}", f"oci:{work / 'layout'}:image")
    _run("umoci", "unpack", "--image", f"{work / 'layout'}:image", work / "bundle")
    config_path = work / "bundle" / "config.json"
    config = json.loads(config_path.read_text())
    config["process"]["args"] = args
    config["process"]["terminal"] = False
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

    inspect = json.loads(_run("skopeo", "inspect", f"oci-archive:{first.archive}"))
    assert len(inspect["Layers"]) == 3
    config = json.loads(_run("skopeo", "inspect", "--config", f"oci-archive:{first.archive}"))
    assert config["config"]["Entrypoint"] == ["conveyor"]
    assert config["config"]["User"] == "1000:1000"

    # One line of source changed: the base and the dependencies come from the cache.
    routing = image_repo / "gateway" / "routing.py"
    routing.write_text(routing.read_text() + "\n# one more line\n")
    second = builder.build(tmp_path / "second.oci.tar")
    assert [r.cached for r in second.layers] == [True, True, False]
    assert second.layers[-1].layer.key != first.layers[-1].layer.key

    out = run_in_image(second.archive, tmp_path / "run", ["conveyor", "--help"])
    assert "usage: conveyor COMMAND" in out and "image" in out
    out = run_in_image(
        second.archive,
        tmp_path / "run2",
        ["python", "-c", "import conveyor.runtime, os; print('uid', os.getuid())"],
    )
    assert out.strip() == "uid 1000"
