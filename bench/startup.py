"""``conveyor bench startup``: how long ``conveyor serve`` takes from exec to ``/ready`` under
a pod's CPU limit, and where the time goes.

Each run starts ``conveyor serve --model MODEL`` in a cgroup of its own capped at
``--cpu-limit`` cores (a pod's ``limits.cpu``; default 0.25, the runtime pods' limit), waits
for ``/ready`` to answer 200 and reads the server's own start-up line (``ready in X s (CPU Y
s): process start ..., engine imports (torch) ..., tokenizer ...``). With ``--baseline REV``
the same runs are made, alternated, with the code of git revision REV (``git archive``, run from
a temporary directory), and the two are printed side by side: the machine's load moves
both alike.

With ``--importtime DIR`` one more start per model and code runs with ``python -X importtime``
(under the same limit); its import lines are written to ``DIR/MODEL[-baseline].importtime.txt``
and the packages whose imports took longest are printed. A benchmark: it prints what it
measured and never fails on a time.

    conveyor bench startup --runs 3 --baseline HEAD~2 --importtime docs/profiles/replica-start
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import tomllib
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from conveyor.bench.procs import conveyor_serve
from conveyor.bench.wait import wait_until

READY_LINE = re.compile(
    r"ready in (?P<total>[\d.]+) s(?: \(CPU (?P<cpu>[\d.]+) s\))?: (?P<steps>[^\n]*)"
)
"""The server's start-up line (runtime/server/app.py ``startup_line``)."""
STEP = re.compile(r"(?P<label>.+?) (?P<seconds>[\d.]+) s$")
IMPORT_LINE = re.compile(r"import time:\s+(?P<self>\d+) \|\s+(?P<cumulative>\d+) \| (?P<name>.*)$")
SHORT_STEPS = {
    "process start (interpreter + server imports)": "process",
    "engine imports (torch)": "torch",
    "model resolve": "resolve",
    "engine set-up (runner + KV cache)": "set-up",
}
"""Column names for the start-up line's longer labels."""
MODELS = ("conveyor-tiny", "smollm2-135m-instruct")


@dataclass
class Start:
    """One start: seconds from exec to /ready 200, and the server's own line."""

    ready_s: float
    server_s: float
    cpu_s: float | None
    steps: dict[str, float] = field(default_factory=dict)


def parse_ready_line(log: str) -> Start | None:
    """The start-up line in a server's log as a ``Start`` (ready_s left at the server's own
    figure); None where the log has none yet."""
    found = READY_LINE.search(log)
    if found is None:
        return None
    steps: dict[str, float] = {}
    for part in found.group("steps").split(", "):
        if (step := STEP.match(part.strip())) is not None:
            label = step.group("label")
            steps[SHORT_STEPS.get(label, label)] = float(step.group("seconds"))
    cpu = found.group("cpu")
    total = float(found.group("total"))
    return Start(total, total, float(cpu) if cpu is not None else None, steps)


def import_times(log: str) -> dict[str, float]:
    """Seconds of ``-X importtime``'s own ("self") time per top-level package, largest first:
    what each library costs a start, wherever in the import tree it was pulled in."""
    per_package: dict[str, float] = defaultdict(float)
    for line in log.splitlines():
        if (found := IMPORT_LINE.search(line)) is None:
            continue
        package = found.group("name").strip().split(".")[0]
        per_package[package] += int(found.group("self")) / 1e6
    return dict(sorted(per_package.items(), key=lambda kv: -kv[1]))


@dataclass(frozen=True)
class Code:
    """Which code a server runs: this environment's (``pythonpath`` None) or a revision's."""

    name: str
    pythonpath: str | None = None

    def env(self) -> dict[str, str]:
        """The environment that imports ``conveyor`` from ``pythonpath``: first on the path, and
        the working directory (a checkout's root holds ``conveyor/``) not on it at all."""
        if self.pythonpath is None:
            return {}
        return {"PYTHONPATH": self.pythonpath, "PYTHONSAFEPATH": "1"}


@contextmanager
def revision_code(rev: str) -> Iterator[Code]:
    """The package tree of git revision ``rev`` in a temporary directory, laid out as the
    installed ``conveyor`` package (pyproject's package-dir: ``runtime/`` is
    ``conveyor.runtime``, ...), to be put first on ``PYTHONPATH``."""
    repo = subprocess.run(
        ["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True
    ).stdout.strip()
    commit = subprocess.run(
        ["git", "-C", repo, "rev-parse", "--short", rev], capture_output=True, text=True, check=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-startup-") as tmp:
        tree = Path(tmp)
        archive = subprocess.run(
            ["git", "-C", repo, "archive", "--format=tar", commit],
            capture_output=True,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        package_dir = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"][
            "package-dir"
        ]
        for package, folder in package_dir.items():
            if package.count(".") == 1:  # conveyor.runtime -> runtime/, inside conveyor/
                (tree / "conveyor" / package.split(".")[1]).symlink_to(tree / folder)
        yield Code(commit, str(tree))


def start_once(
    model: str,
    code: Code,
    cpu_limit: float | None,
    server_args: list[str],
    importtime: bool = False,
) -> tuple[Start, str]:
    """Start a server, wait for /ready and its start-up line, stop it: the start and its log."""
    env: dict[str, str | None] = {**code.env()}
    if importtime:
        env["PYTHONPROFILEIMPORTTIME"] = "1"  # python -X importtime
    server = conveyor_serve(
        ["--model", model, *server_args],
        name=f"startup-{model}",
        ready_timeout=900,
        cpu_limit=cpu_limit,
        env=env,
    )
    with server:
        assert server.startup_s is not None
        start = wait_until(lambda: parse_ready_line(server.logs()), 120, f"{model}'s start-up line")
        log = server.logs()
    start.ready_s = server.startup_s
    return start, log


def format_start(start: Start) -> str:
    cpu = f"{start.cpu_s:5.1f}" if start.cpu_s is not None else "    -"
    steps = ", ".join(f"{k} {v:.1f}" for k, v in start.steps.items())
    return f"{start.ready_s:6.1f} {start.server_s:6.1f} {cpu}   {steps}"


def median_start(starts: list[Start]) -> Start:
    """Medians of every figure over ``starts``."""
    steps = {k: statistics.median(s.steps.get(k, 0.0) for s in starts) for k in starts[0].steps}
    cpus = [s.cpu_s for s in starts if s.cpu_s is not None]
    return Start(
        statistics.median(s.ready_s for s in starts),
        statistics.median(s.server_s for s in starts),
        statistics.median(cpus) if cpus else None,
        steps,
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="conveyor bench startup",
        description="Seconds from exec to /ready of `conveyor serve` under a CPU limit, with "
        "the server's own split; optionally side by side with a git revision's code.",
    )
    parser.add_argument(
        "--models",
        default=",".join(MODELS),
        help=f"models to start, comma-separated (default {','.join(MODELS)})",
    )
    parser.add_argument("--runs", type=int, default=3, help="starts per model and code (default 3)")
    parser.add_argument(
        "--cpu-limit",
        type=float,
        default=0.25,
        help="CPU cores each server may use, as a pod's limits.cpu (default 0.25; 0: no limit)",
    )
    parser.add_argument(
        "--baseline",
        default=None,
        metavar="REV",
        help="also start the code of this git revision, alternated with this code's starts",
    )
    parser.add_argument(
        "--importtime",
        type=Path,
        default=None,
        metavar="DIR",
        help="one more start per model and code under -X importtime; its lines go to DIR",
    )
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra flag for every server, e.g. --server-arg=--max-total-tokens=4096 (repeatable)",
    )
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    cpu_limit = args.cpu_limit or None
    with revision_code(args.baseline) if args.baseline else nullcontext() as baseline:
        # The baseline first in each pair of starts.
        codes = [Code("this")] if baseline is None else [baseline, Code("this")]
        return run(models, codes, args.runs, cpu_limit, args.server_arg, args.importtime)


def run(
    models: list[str],
    codes: list[Code],
    runs: int,
    cpu_limit: float | None,
    server_args: list[str],
    importtime: Path | None,
) -> int:
    limit = f"{cpu_limit:g} CPU" if cpu_limit else "no CPU limit"
    print(f"conveyor serve, exec to /ready 200, {limit}, {runs} run(s) per model and code")
    print("code        run  ready server   CPU   the server's split (s)")
    medians: dict[tuple[str, str], Start] = {}
    for model in models:
        print(f"-- {model}")
        starts: dict[str, list[Start]] = {c.name: [] for c in codes}
        for i in range(runs):
            for code in codes:
                start, _ = start_once(model, code, cpu_limit, server_args)
                starts[code.name].append(start)
                print(f"{code.name:<10} {i + 1:>4} {format_start(start)}", flush=True)
        for code in codes:
            medians[(model, code.name)] = median_start(starts[code.name])
            print(f"{code.name:<10}  med {format_start(medians[(model, code.name)])}")
        if importtime is not None:
            profile_imports(model, codes, cpu_limit, server_args, importtime)
    if len(codes) == 2:
        print_comparison(models, codes, medians)
    return 0


def profile_imports(
    model: str, codes: list[Code], cpu_limit: float | None, server_args: list[str], out: Path
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for code in codes:
        start, log = start_once(model, code, cpu_limit, server_args, importtime=True)
        suffix = "" if code.pythonpath is None else "-baseline"
        path = out / f"{model}{suffix}.importtime.txt"
        lines = [line for line in log.splitlines() if IMPORT_LINE.search(line)]
        path.write_text(
            f"# conveyor serve --model {model} ({code.name}), python -X importtime, "
            f"{cpu_limit or 'no'} CPU limit; ready line: {format_start(start)}\n"
            + "\n".join(lines)
            + "\n"
        )
        top = list(import_times(log).items())[:8]
        print(
            f"{code.name:<10} imports (self s, -X importtime, {path}): "
            + ", ".join(f"{name} {s:.2f}" for name, s in top)
        )


def print_comparison(
    models: list[str], codes: list[Code], medians: dict[tuple[str, str], Start]
) -> None:
    before, after = codes
    print(f"\nmedians, {before.name} -> {after.name} (ratio after/before)")
    for model in models:
        b, a = medians[(model, before.name)], medians[(model, after.name)]
        figures = [("ready", b.ready_s, a.ready_s), ("server", b.server_s, a.server_s)]
        if b.cpu_s is not None and a.cpu_s is not None:
            figures.append(("CPU", b.cpu_s, a.cpu_s))
        figures += [(k, b.steps[k], a.steps.get(k, 0.0)) for k in b.steps]
        print(f"-- {model}")
        for name, x, y in figures:
            ratio = f"{y / x:.2f}x" if x > 0 else "-"
            print(f"  {name:<14} {x:6.1f} -> {y:6.1f}  {ratio}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
