"""``bench/gpu.sh --smoke``: the GPU benchmark's own dry run on CPU, as the lent GPU machine
would run it: from the checkout, with none of the packages that machine's Python lacks (the
server's, GGUF's, structured output's). A lease is minutes long; a script that fails there
on an import or a renamed field wastes it. No timing asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

ABSENT_ON_THE_GPU_MACHINE = (
    "fastapi", "starlette", "uvicorn", "pydantic", "pydantic_core", "gguf", "xgrammar",
    "kopf", "kubernetes_asyncio", "openai", "httptools", "orjson", "cryptography",
)  # fmt: skip
"""Packages of Conveyor's extras that the lent machine's image does not hold (its list:
the tool library's device/KINDS.md)."""


def test_the_gpu_bench_runs_without_the_packages_the_gpu_machine_lacks(tmp_path):
    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        textwrap.dedent(
            f"""
            import sys
            ABSENT = {ABSENT_ON_THE_GPU_MACHINE!r}
            class Absent:
                def find_spec(self, name, path=None, target=None):
                    if name.split(".")[0] in ABSENT:
                        raise ModuleNotFoundError(f"{{name}} is not on the GPU machine")
            sys.meta_path.insert(0, Absent())
            """
        )
    )
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(blocker), "PYTHON": sys.executable, "OUT": str(out)}
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run(
        ["bash", "bench/gpu.sh", "--smoke", "--stages", "kernels,profile,tp"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    stages = json.loads((out / "gpu_bench.json").read_text())["stages"]
    assert stages["kernels"]["checks"] == stages["kernels"]["passed"] > 0
    assert stages["profile"]["steps"] > 0 and stages["profile"]["seconds_in"]["eager_forward"] > 0
    assert (out / "engine_step.pstats").stat().st_size > 0
    assert stages["tp"]["tiny_greedy_equal"] is True
    assert "profile:" in run.stdout and "tp: TP=2 greedy equals TP=1: True" in run.stdout
