"""Store-KV, fused add+RMSNorm, rotary and SiLU-and-mul against the torch layers.

Tolerances: ``checks.ELEMENTWISE_TOL`` (cache writes and the fused residual are exact).
"""

from __future__ import annotations

import pytest

from conveyor.runtime.kernels import checks

DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in checks.DTYPES]


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_skips_padding_and_writes_exactly(dtype, device):
    checks.check_store_kv(dtype, device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden,with_residual", checks.ELEMENTWISE_CASES["rms_norm"])
def test_rms_norm(rows, hidden, with_residual, dtype, device):
    checks.check_rms_norm(rows, hidden, with_residual, dtype, device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim", checks.ELEMENTWISE_CASES["rotary"])
def test_rotary_in_place(tokens, q_heads, kv_heads, head_dim, dtype, device):
    checks.check_rotary(tokens, q_heads, kv_heads, head_dim, dtype, device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,intermediate", checks.ELEMENTWISE_CASES["silu_and_mul"])
def test_silu_and_mul(tokens, intermediate, dtype, device):
    checks.check_silu_and_mul(tokens, intermediate, dtype, device)
