"""Paged attention (store K/V, decode, prefill against a cached prefix) against the torch backend.

The CI matrix: block sizes 16 and 32; GQA ratios 1, 4 and 8; head dims 64 and
128; ragged context lengths 1, bs-1, bs, bs+1, 2bs, 3bs+5 and 130 (block
boundaries); prefills with nothing cached, a block-aligned cached prefix, and
a prefix ending mid-block; every sequence's blocks scattered across the
cache; float32, float16 and bfloat16; sliding windows; Gemma 2's soft-capped scores, with and
without a window. Tolerances: ``checks.ATTENTION_TOL``.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.runtime.kernels import checks
from conveyor.runtime.kernels.backend import TritonAttentionBackend

CASES = checks.attention_cases()
SOFTCAP_CASES = checks.softcap_attention_cases()
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in checks.DTYPES]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_backend_step_matches_torch(case, dtype, device):
    checks.check_attention_backend(case, dtype, device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SOFTCAP_CASES, ids=lambda c: c.id)
def test_softcapped_step_matches_torch(case, dtype, device):
    checks.check_attention_backend(case, dtype, device)


class _UncappedTritonBackend(TritonAttentionBackend):
    def forward(self, *args, softcap: float = 0.0, **kwargs):
        return super().forward(*args, **kwargs)


def test_softcapped_cases_fail_without_the_cap(device):
    """The capped cases' scores are large enough that the cap decides the result: kernels that
    ignored it would fail them."""
    with pytest.raises(AssertionError, match="attention"):
        checks.check_attention_backend(
            SOFTCAP_CASES[1], torch.float32, device, backend=_UncappedTritonBackend()
        )


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize(
    "case",
    CASES[1:2]
    + [c for c in CASES if c.block_size == 1]
    + [c for c in CASES if c.window][-1:]
    + SOFTCAP_CASES[1:2],
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
