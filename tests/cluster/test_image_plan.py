"""The image's layers and their content keys: what a change rebuilds, and nothing else.

Pure functions on a copy of this checkout; no tool runs (tests/cluster/test_image_build.py
builds a real image when asked to).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tomllib
from pathlib import Path

import pytest

from conveyor.cluster import image_build, image_cli, image_oci
from conveyor.cluster.image_build import default_image
from conveyor.cluster.image_oci import ImageBuildError, OciLayout
from conveyor.cluster.image_plan import (
    DEPS_INPUTS,
    STEPS_SCRIPT,
    VLLM_DOCKERFILE,
    VLLM_INSTALLER,
    VLLM_STEP,
    ImageSettings,
    dockerfile_config,
    host_debian_mirror,
    plan_layers,
)
from conveyor.cluster.image_requirements import requirements

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def repo(image_repo: Path) -> Path:
    return image_repo


def _keys(repo: Path, **kw: object) -> dict[str, str]:
    return {layer.kind: layer.key for layer in plan_layers(ImageSettings(repo=repo, **kw))}  # type: ignore[arg-type]


def _append(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


def test_layers_are_base_deps_src_each_on_the_one_below(repo: Path) -> None:
    base, deps, src = plan_layers(ImageSettings(repo=repo))
    assert [base.kind, deps.kind, src.kind] == ["base", "deps", "src"]
    assert (base.parent, deps.parent, src.parent) == (None, base, deps)
    assert src.tag == f"src-{src.key}"
    assert _keys(repo) == _keys(repo)  # a key is a function of the content alone


def test_a_source_edit_changes_only_the_last_layers_key(repo: Path) -> None:
    before = _keys(repo)
    _append(repo / "gateway" / "routing.py", "\n# one line\n")
    after = _keys(repo)
    assert after["base"] == before["base"] and after["deps"] == before["deps"]
    assert after["src"] != before["src"]


def test_a_pyproject_edit_changes_the_deps_layer_and_what_is_built_on_it(repo: Path) -> None:
    before = _keys(repo)
    _append(repo / "pyproject.toml", "\n# a comment\n")
    after = _keys(repo)
    assert after["base"] == before["base"]
    assert after["deps"] != before["deps"] and after["src"] != before["src"]
    pins = _keys(repo)
    _append(repo / "runtime" / "model" / "packaged.py", "\n# pins\n")
    assert _keys(repo)["deps"] != pins["deps"]  # the built-in model's wheel is in that layer


def test_the_extras_and_the_base_recipe_key_their_layers(repo: Path) -> None:
    full = _keys(repo)
    control = _keys(repo, extras=("gateway", "operator"))
    assert control["base"] == full["base"] and control["deps"] != full["deps"]
    assert _keys(repo, suite="trixie")["base"] != full["base"]
    _append(repo / STEPS_SCRIPT, "\n# a new step\n")
    changed = _keys(repo)
    assert all(changed[k] != full[k] for k in full)


def test_the_torchless_image_has_its_own_name_and_path(tmp_path: Path) -> None:
    """As the README's ``docker build`` lines name them: building the gateway and operator
    alone must not overwrite the full image, which the real nodes load."""
    full = ImageSettings(repo=REPO)
    control = ImageSettings(repo=REPO, extras=("gateway", "operator"))
    assert (full.repository, control.repository) == ("conveyor", "conveyor-control")
    assert default_image("1.2.3", tmp_path, full.repository) == tmp_path / "conveyor-1.2.3.oci"
    assert default_image("1.2.3", tmp_path, control.repository) == (
        tmp_path / "conveyor-control-1.2.3.oci"
    )


def test_vllm_s_image_is_the_project_s_base_and_one_layer_of_vllm(repo: Path) -> None:
    """The base is shared with the project's image (one copy on disk); the vllm layer is keyed
    by the installer, which pins vLLM's release, and by nothing of the project's source."""
    settings = ImageSettings(repo=repo, engine="vllm")
    base, vllm = plan_layers(settings)
    assert (base.kind, vllm.kind, vllm.parent) == ("base", "vllm", base)
    assert base == plan_layers(ImageSettings(repo=repo))[0]
    assert (settings.repository, settings.version()) == ("vllm-cpu", "0.32.0")
    assert settings.dockerfile == repo / VLLM_DOCKERFILE
    before = _keys(repo, engine="vllm")
    _append(repo / "gateway" / "routing.py", "\n# one line\n")
    assert _keys(repo, engine="vllm") == before
    _append(repo / VLLM_INSTALLER, "\n# another pin\n")
    assert _keys(repo, engine="vllm")["vllm"] != before["vllm"]


def test_vllm_s_dockerfile_runs_the_step_the_builder_runs() -> None:
    text = (REPO / VLLM_DOCKERFILE).read_text()
    assert f"RUN export PIP_NO_CACHE_DIR=1 && {VLLM_STEP}\n" in text
    assert f"COPY {VLLM_INSTALLER} /opt/conveyor/build/vllm_env.py\n" in text
    config = dockerfile_config(REPO / VLLM_DOCKERFILE)
    assert config.entrypoint == ("vllm", "serve") and config.user == "1000:1000"
    assert config.env["PATH"].startswith("/opt/vllm/venv/bin:/usr/local/sbin:")
    assert config.env["VLLM_TARGET_DEVICE"] == "cpu"


def test_build_litter_does_not_change_the_source_key(repo: Path) -> None:
    before = _keys(repo)
    (repo / "runtime" / "__pycache__").mkdir(exist_ok=True)
    (repo / "runtime" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    (repo / "runtime" / "kernels" / "cpu" / "stray.so").write_bytes(b"\0")
    (repo / "cluster" / "conveyor.egg-info").mkdir()
    (repo / "cluster" / "conveyor.egg-info" / "PKG-INFO").write_text("x")
    assert _keys(repo) == before


def test_the_dockerfile_copies_every_folder_the_wheel_is_built_from() -> None:
    package_dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    copied = set(
        re.findall(
            r"^COPY (\w+)/ /opt/conveyor/build/src/", (REPO / "Dockerfile").read_text(), re.M
        )
    )
    assert copied == set(package_dirs.values())
    deps_copy = re.search(
        r"^COPY (.+) /opt/conveyor/build/$", (REPO / "Dockerfile").read_text(), re.M
    )
    assert deps_copy and tuple(deps_copy.group(1).split()) == DEPS_INPUTS


def test_the_image_configuration_is_the_dockerfiles() -> None:
    config = dockerfile_config(REPO / "Dockerfile")
    assert config.entrypoint == ("conveyor",) and config.cmd == ("--help",)
    assert config.user == "1000:1000"
    assert config.ports == ("8000", "8080", "8081")
    assert config.env["PATH"].startswith("/opt/conveyor/venv/bin:/usr/local/sbin:")
    assert config.env["CONVEYOR_CACHE"] == "/var/cache/conveyor"
    assert config.env["HF_HOME"] == "/var/cache/conveyor/hf"


def test_a_dockerfile_form_the_builder_cannot_read_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "Dockerfile").write_text("FROM x\nENTRYPOINT conveyor serve\n")
    with pytest.raises(ValueError, match="ENTRYPOINT as a JSON array"):
        dockerfile_config(tmp_path / "Dockerfile")


def test_requirements_expand_the_projects_own_extras() -> None:
    pyproject = REPO / "pyproject.toml"
    control = requirements(pyproject, ["gateway", "operator"])
    assert control[0] == "pyyaml>=6" and "kopf>=1.45" in control
    assert not any(r.startswith("torch") for r in control)
    assert len(control) == len(set(control))
    dev = requirements(pyproject, ["dev"])  # conveyor[runtime,...] expanded, never itself
    assert "torch>=2.6" in dev and "pytest>=8" in dev
    assert not any(r.startswith("conveyor") for r in dev)
    with pytest.raises(ValueError, match="unknown extra"):
        requirements(pyproject, ["gpu"])


def test_the_mirror_is_read_from_this_machines_apt_sources(tmp_path: Path) -> None:
    deb822 = tmp_path / "debian.sources"
    deb822.write_text(
        "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n\n"
        "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm\n"
    )
    assert host_debian_mirror((deb822,)) == "http://mirror.example/debian"
    one_line = tmp_path / "sources.list"
    one_line.write_text("# comment\ndeb [arch=amd64] http://m.example/debian bookworm main\n")
    assert host_debian_mirror((tmp_path / "absent", one_line)) == "http://m.example/debian"
    assert host_debian_mirror((tmp_path / "absent",)) is None


def test_a_missing_tool_names_the_script_that_installs_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no tool is found
    code = image_cli.main(["build", "--repo", str(REPO), "--cache", str(tmp_path / "cache")])
    err = capsys.readouterr().err
    assert code == 1
    assert "debootstrap" in err and "unshare" in err and "cluster/install-system-deps.sh" in err
    assert not (tmp_path / "cache").exists()  # nothing was started


def _layout(path: Path, images: dict[str, list[str]]) -> OciLayout:
    """An OCI layout whose tags name images made of the given layer digests (blobs of text)."""
    blobs = path / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def blob(data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return f"sha256:{digest}"

    manifests = []
    for tag, layers in images.items():
        manifest = {
            "config": {"digest": blob(f"config of {tag}".encode())},
            "layers": [{"digest": blob(layer.encode()), "size": len(layer)} for layer in layers],
        }
        manifests.append(
            {
                "digest": blob(json.dumps(manifest).encode()),
                "annotations": {"org.opencontainers.image.ref.name": tag},
            }
        )
    (path / "index.json").write_text(json.dumps({"manifests": manifests}))
    return OciLayout(path)


def test_the_cache_drops_what_no_build_can_use_and_the_blobs_only_it_held(tmp_path: Path) -> None:
    layout = _layout(
        tmp_path / "oci",
        {
            "base-old": ["os v1"],
            "deps-old": ["os v1", "venv"],
            "base-new": ["os v2"],
            "deps-full": ["os v2", "venv"],
            "src-1": ["os v2", "venv", "source 1"],
            "src-2": ["os v2", "venv", "source 2"],
            "deps-control": ["os v2", "venv without torch"],
            "src-control": ["os v2", "venv without torch", "source 1"],
        },
    )
    layout.prune_siblings(keep="src-2", prefix="src-")  # src-1 sat on the same layers
    assert "src-1" not in layout.tags() and {"src-2", "src-control"} <= layout.tags()
    assert layout.on_other_bases("base-new") == ["base-old", "deps-old"]
    layout.drop(layout.on_other_bases("base-new"))
    assert layout.tags() == {"base-new", "deps-full", "src-2", "deps-control", "src-control"}
    stored = {p.read_bytes() for p in (tmp_path / "oci" / "blobs" / "sha256").iterdir()}
    assert b"os v1" not in stored and b"source 1" in stored and b"source 2" in stored
    assert layout.top_layer_size("src-2") == len("source 2")


def test_an_image_is_written_out_as_a_layout_of_hardlinks_or_as_an_archive(
    tmp_path: Path,
) -> None:
    """The default output copies no byte (its blobs are the cache's, by hardlink) and holds
    only the one image, named by its full reference; a ``.tar`` output is an archive of the
    same; writing the same image again leaves it as it is."""
    layout = _layout(tmp_path / "oci", {"src-1": ["os", "venv", "source"], "src-2": ["other"]})
    (tmp_path / "oci" / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    ref = "docker.io/library/conveyor:1.2.3"

    out = tmp_path / "conveyor-1.2.3.oci"
    layout.export("src-1", out, ref)
    (entry,) = json.loads((out / "index.json").read_text())["manifests"]
    assert entry["annotations"] == {"org.opencontainers.image.ref.name": ref}
    cache_blobs = tmp_path / "oci" / "blobs" / "sha256"
    written = list((out / "blobs" / "sha256").iterdir())
    assert len(written) == 5  # manifest, config, three layers; not src-2's
    assert all(b.stat().st_ino == (cache_blobs / b.name).stat().st_ino for b in written)
    assert image_oci.image_index(out) == (out / "index.json").read_bytes()
    stamp = (out / "index.json").stat().st_mtime_ns
    layout.export("src-1", out, ref)
    assert (out / "index.json").stat().st_mtime_ns == stamp  # the same image: untouched

    archive = tmp_path / "conveyor-1.2.3.oci.tar"
    layout.export("src-1", archive, ref)
    assert image_oci.image_index(archive) == (out / "index.json").read_bytes()
    assert image_oci.image_bytes(archive) == archive.stat().st_size
    assert image_oci.image_bytes(out) == sum(f.stat().st_size for f in written) + len(
        (out / "index.json").read_bytes()
    ) + len((out / "oci-layout").read_bytes())
    assert not (tmp_path / "oci" / "archive.staging").exists()


def test_the_old_archive_makes_room_for_the_new_one_and_a_full_disk_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writing an archive needs its size free beside it: when the disk is short, the archive
    it replaces goes first; when that is not enough either, the error gives both sizes."""

    archive = tmp_path / "conveyor.oci.tar"
    archive.write_bytes(b"x" * 1000)
    disk = {"free without the archive": 5000}

    class Usage:
        def __init__(self, _: object) -> None:
            held = archive.stat().st_size if archive.exists() else 0
            self.free = disk["free without the archive"] - held

    monkeypatch.setattr(image_oci.shutil, "disk_usage", Usage)
    monkeypatch.setattr(image_oci, "ARCHIVE_SLACK", 0)
    image_oci._make_room(archive, 4000)
    assert archive.exists()  # room enough: the old archive stays until the new replaces it
    disk["free without the archive"] = 4500
    image_oci._make_room(archive, 4000)
    assert not archive.exists()  # its 1000 bytes made the difference
    disk["free without the archive"] = 3500
    with pytest.raises(image_oci.ImageBuildError, match=r"needs 0\.0 GB and 0\.0 GB are free"):
        image_oci._make_room(archive, 4000)


def test_an_opaque_directory_is_refused_only_where_it_hides_a_lower_one(tmp_path: Path) -> None:
    """The kernel marks a directory new to every lower layer opaque too (apt made
    /usr/share/doc/libnuma1 so in vLLM's layer): that hides nothing and passes."""
    upper, lower = tmp_path / "upper", tmp_path / "lower"
    (upper / "usr/share/doc/libnuma1").mkdir(parents=True)
    (lower / "usr/share/doc/apt").mkdir(parents=True)
    try:
        os.setxattr(upper / "usr/share/doc/libnuma1", "trusted.overlay.opaque", b"y")
    except OSError as exc:
        pytest.skip(f"trusted.* extended attributes cannot be set here: {exc}")
    image_build._check_no_whiteouts(upper, [lower])
    (upper / "usr/share/doc/apt").mkdir()
    os.setxattr(upper / "usr/share/doc/apt", "trusted.overlay.opaque", b"y")
    with pytest.raises(ImageBuildError, match="replaced a directory of a lower layer"):
        image_build._check_no_whiteouts(upper, [lower])
