"""Every kernel lowers to a cubin for sm_90 (H100/H200), bfloat16 tensor-core dots included.

The interpreter runs kernels without lowering them; this compiles them for
the GPU the project benchmarks on, with the ptxas that ships in Triton's
wheel. It proves they compile, not that they run correctly: ``bench/gpu.sh``
does that on a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton build has no bundled ptxas")
def test_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {
        "TRITON_CACHE_DIR": str(tmp_path),
        "TRITON_DEFAULT_FP_FUSION": "1",
        "PYTHONWARNINGS": "error",
    }
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("compile_sm90.py"))],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("prefill") == 8
    assert proc.stdout.count("fused_moe") == 3
