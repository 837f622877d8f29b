"""The engine's CPU kernels: ``ops.cpp`` and ``decoder.cpp``, built once per environment,
loaded in milliseconds.

The C++ ops (paged attention read in place from the KV cache, rotary, the KV write, RMSNorm
fused with the residual add, SiLU- and GELU-and-mul; ``moe.cpp``'s routed experts of a
mixture-of-experts layer) replace the torch reference on CPU, where a decode step is otherwise
dominated by copying K/V out of the cache and by hundreds of small ops; ``decoder_layers``
runs a Llama-family model's layers on them in one call.
``build()`` compiles them with torch's extension builder (g++ and ninja) for this machine's
CPU; the README's set-up runs it (``python -m conveyor.runtime.kernels.cpu build``). ``load()`` imports the built library, or returns None
(the engine then uses the plain-torch path) when it was not built, cannot build or was
built for another torch, CPU or source: changed sources get a new build directory.

``CONVEYOR_CPU_KERNELS=0`` turns them off (the torch reference runs instead).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

log = logging.getLogger("conveyor.runtime")

HERE = Path(__file__).parent
SOURCES = [HERE / "ops.cpp", HERE / "moe.cpp", HERE / "decoder.cpp"]
"""What is compiled; the build key also covers ``HEADERS``."""
HEADERS = [HERE / "ops.h", HERE / "simd.h"]
MODULE = "conveyor_cpu_ops"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-DNDEBUG"]
# OpenMP as torch's own (its wheel ships libgomp.so.1; the loader shares one copy by soname),
# so ATen's parallel_for in the kernels uses torch's thread pool.
LDFLAGS = ["-fopenmp"]

_loaded: ModuleType | None = None
_load_error: str | None = None


def enabled() -> bool:
    return os.environ.get("CONVEYOR_CPU_KERNELS", "1") not in ("0", "false", "no")


def build_key() -> str:
    """What the built library depends on: the source, torch, the compile flags, the CPU."""
    import torch

    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.read_bytes())
    digest.update(
        f"{torch.__version__} {sys.version_info[:2]} {' '.join(CFLAGS + LDFLAGS)}".encode()
    )
    digest.update(_cpu_signature().encode())
    return digest.hexdigest()[:16]


def _cpu_signature() -> str:
    """The CPU model and feature flags (``-march=native`` code runs only where they match)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().split("\n\n", 1)[0].splitlines()
    except OSError:
        return platform.machine() + " " + platform.processor()
    keep = ("vendor_id", "model name", "flags", "Features", "CPU part")
    return "\n".join(line for line in lines if line.split(":", 1)[0].strip() in keep)


def build_dir() -> Path:
    """Beside this environment's packages (one torch, one build), else the user's cache."""
    root = os.environ.get("CONVEYOR_KERNEL_DIR")
    if root:
        return Path(root) / build_key()
    base = Path(sys.prefix) / "lib" / "conveyor-kernels"
    if not os.access(base if base.exists() else Path(sys.prefix), os.W_OK):
        cache = os.environ.get("CONVEYOR_CACHE") or os.path.join(Path.home(), ".cache", "conveyor")
        base = Path(cache) / "kernels"
    return base / build_key()


def _library(directory: Path) -> Path:
    return directory / f"{MODULE}.so"


def _built_library() -> Path | None:
    """The build ``load()`` uses: ``build_dir()``'s, else (unless ``CONVEYOR_KERNEL_DIR``
    names the place) this environment's own, which a user who cannot write the environment
    (a runtime pod's) can still read."""
    candidates = [build_dir()]
    if not os.environ.get("CONVEYOR_KERNEL_DIR"):
        candidates.append(Path(sys.prefix) / "lib" / "conveyor-kernels" / build_key())
    return next((_library(d) for d in candidates if _library(d).exists()), None)


def build(verbose: bool = False) -> Path:
    """Compile the kernels for this environment and CPU (about a minute); returns the library."""
    from torch.utils import cpp_extension

    directory = build_dir()
    if _library(directory).exists():
        return _library(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # torch's builder runs `ninja` from PATH: the environment's own (the ninja wheel) first.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    cpp_extension.load(
        name=MODULE,
        sources=[str(path) for path in SOURCES],
        extra_cflags=CFLAGS,
        extra_ldflags=LDFLAGS,
        build_directory=str(directory),
        verbose=verbose,
    )
    for old in directory.parent.iterdir():  # builds of earlier sources or another torch
        if old != directory and old.is_dir() and (old / f"{MODULE}.so").exists():
            shutil.rmtree(old, ignore_errors=True)
    return _library(directory)


def load() -> ModuleType | None:
    """The built kernels, or None (and why, in ``load_error()``) when they cannot be used."""
    global _loaded, _load_error
    if _loaded is not None or _load_error is not None:
        return _loaded
    if not enabled():
        _load_error = "turned off by CONVEYOR_CPU_KERNELS=0"
        return None
    try:
        path = _built_library()
        if path is None:
            _load_error = (
                f"not built for this environment and CPU ({_library(build_dir())} is missing): run "
                "`python -m conveyor.runtime.kernels.cpu build` (scripts/bootstrap.sh does)"
            )
            return None
        import torch  # noqa: F401 - the library links against libtorch, loaded first

        loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
        spec = importlib.util.spec_from_file_location(MODULE, path, loader=loader)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except (ImportError, OSError) as exc:
        _load_error = f"cannot be loaded ({exc})"
        return None
    _loaded = module
    return module


def load_error() -> str | None:
    return _load_error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conveyor.runtime.kernels.cpu",
        description="Conveyor's CPU kernels (C++): build them for this environment, or say where.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile them if this environment has no build yet")
    b.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    b.add_argument(
        "--optional",
        action="store_true",
        help="exit 0 when the build fails (the engine then runs the plain-torch path)",
    )
    sub.add_parser("status", help="print whether they load, and from where")
    args = parser.parse_args(argv)
    if args.command == "status":
        module = load()
        print(f"{_built_library() or _library(build_dir())}: {'loads' if module else load_error()}")
        return 0 if module else 1
    started = time.monotonic()
    try:
        path = build(verbose=args.verbose)
    except Exception as exc:  # a compiler error, no compiler, no ninja: say so, maybe go on
        print(
            f"conveyor: the CPU kernels did not build ({type(exc).__name__}: {exc}); the engine "
            "will use its plain-torch path on CPU",
            file=sys.stderr,
        )
        return 0 if args.optional else 1
    print(f"CPU kernels: {path} ({time.monotonic() - started:.0f}s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
