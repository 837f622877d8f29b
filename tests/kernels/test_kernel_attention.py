"""Paged attention (store K/V, decode, prefill against a cached prefix) against the torch backend.

The CI matrix: block sizes 16 and 32; GQA ratios 1, 4 and 8; head dims 64 and
128; ragged context lengths 1, bs-1, bs, bs+1, 2bs, 3bs+5 and 130 (block
boundaries); prefills with nothing cached, a block-aligned cached prefix, and
a prefix ending mid-block; every sequence's blocks scattered across the
cache; float32, float16 and bfloat16. Tolerances: ``checks.ATTENTION_TOL``.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.runtime.kernels import checks

CASES = checks.attention_cases()
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in checks.DTYPES]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_backend_step_matches_torch(case, dtype, device):
    checks.check_attention_backend(case, dtype, device)


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize(
    "case",
    CASES[1:2] + [c for c in CASES if c.block_size == 1] + [c for c in CASES if c.window][-1:],
    ids=lambda c: c.id,
)
def test_decode_split_kv_and_padded_slots(case, num_splits, device):
    checks.check_decode_splits(case, torch.float32, device, num_splits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the larger sweep needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("case", checks.attention_cases(gpu_sweep=True), ids=lambda c: c.id)
def test_gpu_sweep(case, dtype, device):
    """Block sizes 1..64, GQA ratios 1..8 (incl. 7), contexts past 4k, 2k-token chunks."""
    checks.check_attention_backend(case, dtype, device)
    checks.check_decode_splits(case, dtype, device, num_splits=7)
