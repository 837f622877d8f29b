"""Store-KV, fused add+RMSNorm, rotary, SiLU-and-mul and GELU-and-mul against the torch layers.

Tolerances: ``checks.ELEMENTWISE_TOL`` (cache writes and the fused residual are exact).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor.runtime.kernels import checks
from conveyor.runtime.kernels.gelu_and_mul import gelu_tanh_and_mul

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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,intermediate", checks.ELEMENTWISE_CASES["gelu_tanh_and_mul"])
def test_gelu_tanh_and_mul(tokens, intermediate, dtype, device):
    checks.check_gelu_tanh_and_mul(tokens, intermediate, dtype, device)


def test_gelu_tanh_tails(device):
    """Gates far into both tails: GELU's 0 and identity, no overflow (a warning here) or NaN."""
    x = torch.cat([torch.linspace(-200, 200, 4001), torch.tensor([-1e6, 1e6, 0.0])]).to(device)
    gate_up = torch.cat([x, torch.ones_like(x)]).view(1, -1)
    expected = F.gelu(x, approximate="tanh").view(1, -1)
    torch.testing.assert_close(gelu_tanh_and_mul(gate_up), expected, atol=1e-6, rtol=1e-5)
