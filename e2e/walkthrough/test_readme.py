"""The README's walk-through, run exactly as written, on a cluster of its own.

Blocks are marked in README.md with ``<!-- walkthrough: run -->`` (foreground,
must succeed), ``<!-- walkthrough: background NAME -->`` (started and left
running, like ``kubectl get -w``, until ``<!-- walkthrough: stop NAME -->``;
killed at a deadline in any case) and run in one bash session, so ``export``
and shell variables carry from block to block as they do for a reader.
``scripts/test.sh`` runs this last, after the other e2e tests stopped their
cluster; whatever happens, ``conveyor down`` runs at the end.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(
    r"<!-- walkthrough: (run|background|stop)(?: (\w+))? -->\n(?:\n*```bash\n(.*?)```)?", re.S
)
BACKGROUND_DEADLINE_S = 900
TOTAL_DEADLINE_S = 3600


def walkthrough_script(readme: str, logs: Path) -> str:
    lines = [
        "set -euo pipefail",
        f"cd {ROOT}",
        "__jobs=()",
        '__cleanup() { for p in "${__jobs[@]}"; do kill "$p" 2>/dev/null || true; done; '
        f"{ROOT}/.venv/bin/conveyor down || true; }}",
        "trap __cleanup EXIT",
    ]
    blocks = MARKER.findall(readme)
    assert blocks, "README.md has no walk-through blocks"
    for i, (kind, name, code) in enumerate(blocks):
        lines.append(f"echo '>>> walk-through block {i} ({kind} {name})'")
        if kind == "run":
            assert code, f"block {i}: a run marker must precede a bash block"
            lines.append(code)
        elif kind == "background":
            log = logs / f"{name}.log"
            quoted = code.replace("'", "'\\''")
            lines.append(f"timeout {BACKGROUND_DEADLINE_S} bash -c '{quoted}' > {log} 2>&1 &")
            lines.append(f"__bg_{name}=$!; __jobs+=($!)")
        else:
            lines.append(
                f"kill $__bg_{name} 2>/dev/null || true; wait $__bg_{name} 2>/dev/null || true"
            )
    return "\n".join(lines) + "\n"


def test_readme_walkthrough(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("the walk-through brings up the one-machine cluster, which needs root")
    script = tmp_path / "walkthrough.sh"
    script.write_text(walkthrough_script((ROOT / "README.md").read_text(), tmp_path))
    proc = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, timeout=TOTAL_DEADLINE_S, cwd=ROOT
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the walk-through failed (exit {proc.returncode}):\n{out[-6000:]}"
    # The answers the README shows are the ones the real model gave through the gateway.
    assert "The capital of France is Paris." in out, out[-6000:]
    assert "A reminder of the ocean's power." in out, out[-6000:]
    watch = (tmp_path / "watch.log").read_text()
    rows = [line.split() for line in watch.splitlines() if line.startswith("smollm2 ")]
    assert rows, f"`kubectl get llmservices -w` showed nothing:\n{watch}"
    # NAME MODEL READY DESIRED ...: the benchmark's queue made the autoscaler ask for two.
    desired = max(int(r[3]) for r in rows if r[3].isdigit())
    assert desired >= 2, f"the replicas did not grow under the benchmark's load:\n{watch}"
    assert list((ROOT / "dashboards").glob("*.png")), "the dashboards were not rendered"
    from conveyor.cluster.cluster import Cluster

    assert Cluster.attach() is None, "conveyor down left a cluster running"


def test_every_marker_has_a_block():
    readme = (ROOT / "README.md").read_text()
    starts = readme.count("<!-- walkthrough:")
    assert starts == len(MARKER.findall(readme)), "a walk-through marker is malformed"
    script = walkthrough_script(readme, Path("/tmp"))
    assert "conveyor up" in script and "conveyor down" in script
