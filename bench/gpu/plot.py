"""Stage ``plot`` of ``conveyor bench gpu``: step time and MBU against batch size as a PNG.

The GPU machine may have no matplotlib (``bench/gpu.sh`` installs nothing): then the plot is
skipped with one line, as every figure is in ``gpu_bench.json`` anyway.
"""

from __future__ import annotations

import sys
from pathlib import Path


def stage_plot(decode: dict, path: Path) -> dict:
    rows = [r for r in decode.get("rows", []) if "step_ms" in r]
    if not rows:
        return {"skipped": "no decode rows"}
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "[plot] no matplotlib here: no PNG (the figures are in gpu_bench.json)", file=sys.stderr
        )
        return {"skipped": "no matplotlib"}
    batch = [r["batch"] for r in rows]
    step = [r["step_ms"] for r in rows]
    mbu = [100 * r["mbu_step"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(batch, step, "o-")
    a.set(
        xscale="log",
        xlabel="batch size",
        ylabel="decode step (ms)",
        title=f"{decode.get('model')}, {decode.get('dtype', '').removeprefix('torch.')}",
    )
    b.plot(batch, mbu, "o-", color="tab:green")
    b.axhline(60, ls="--", color="grey")
    b.set(
        xscale="log",
        xlabel="batch size",
        ylabel="MBU (%)",
        ylim=(0, 100),
        title=f"context {decode.get('context_len')} tokens per sequence",
    )
    for ax in (a, b):
        ax.minorticks_off()
        ax.set_xticks(batch, [str(x) for x in batch])
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return {"png": str(path), "renderer": "matplotlib"}
