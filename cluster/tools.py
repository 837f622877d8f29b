"""The built tools: find them, or build them with ``build-tools.sh`` (which waits on a running build)."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = HERE / "build-tools.sh"
GO_MODULES = HERE / "go"

BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kube-proxy",
    "kubectl",
    "coredns",
    "helm",
    "prometheus",
    "promtool",
)

CLUSTER_BINARIES = BINARIES[:7]
"""What the cluster itself runs (helm and Prometheus are for the stack on top of it)."""


@dataclass(frozen=True)
class Tools:
    """Paths of the built binaries."""

    directory: Path

    def path(self, name: str) -> Path:
        """The binary called ``name``."""
        if name not in BINARIES:
            raise KeyError(f"{name} is not one of the cluster's tools {BINARIES}")
        return self.directory / name

    def missing(self, names: tuple[str, ...] = BINARIES) -> list[str]:
        """Binaries (of ``names``) that are not there."""
        return [b for b in names if not (self.directory / b).exists()]


def pinned_version(module: str, folder: str = "kubernetes") -> str:
    """The version of ``module`` required by ``cluster/go/<folder>/go.mod`` (stated once, there)."""
    text = (GO_MODULES / folder / "go.mod").read_text()
    match = re.search(rf"^\s*(?:require\s+)?{re.escape(module)}\s+(v\S+)", text, re.MULTILINE)
    if not match:
        raise LookupError(f"{module} is not required in cluster/go/{folder}/go.mod")
    return match.group(1)


def tools_directory() -> Path:
    """Where the binaries for the current pins are (or will be) cached."""
    out = subprocess.run(
        [str(BUILD_SCRIPT), "--print-dir"], capture_output=True, text=True, check=True
    )
    return Path(out.stdout.strip().splitlines()[-1])


def build_tools(names: tuple[str, ...] = BINARIES, *, quiet: bool = False) -> Tools:
    """Build the binaries ``names`` if missing (progress on stderr) and return the tools.

    Exits at once when they are built. While another build runs (the test command starts
    one in the background), waits until the binaries asked for are there, not for the rest.
    """
    proc = subprocess.run(
        [str(BUILD_SCRIPT), *(() if names == BINARIES else names)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL if quiet else None,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{BUILD_SCRIPT} failed (exit {proc.returncode}); run it by hand to see the build's output"
        )
    tools = Tools(Path(proc.stdout.strip().splitlines()[-1]))
    if missing := tools.missing(names):
        raise RuntimeError(f"the build left out {missing} in {tools.directory}")
    return tools


def build_times(directory: Path) -> dict[str, int]:
    """Seconds each binary took to build, from the build's own record (``build-times.tsv``)."""
    times: dict[str, int] = {}
    try:
        lines = (directory / "build-times.tsv").read_text().splitlines()
    except FileNotFoundError:
        return times
    for line in lines:
        name, _, seconds = line.partition("\t")
        if name != "total" and seconds.isdigit():
            times[name] = times.get(name, 0) + int(seconds)
    return times
