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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["alone", "residual"])
def test_a_float32_norm_weight_scales_in_float32_and_rounds_once(dtype, with_residual, device):
    """Gemma's norm: ``(normed(x) * (1 + w)).to(dtype)`` all in float32, as transformers'
    Gemma RMSNorm computes it; the model keeps ``1 + w`` as a float32 weight."""
    from conveyor.runtime.kernels.rmsnorm import rms_norm
    from conveyor.runtime.layers.layernorm import RMSNorm

    g = torch.Generator().manual_seed(0)
    w = 0.3 * torch.randn(1152, generator=g)  # Gemma's stored weight; the norm scales by 1 + w
    x = torch.randn(5, 1152, generator=g).to(dtype)
    residual = torch.randn(5, 1152, generator=g).to(dtype) if with_residual else None
    summed = x if residual is None else x + residual
    xf = summed.float()
    expected = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w)).to(dtype)
    weight = (1.0 + w).float()
    reference = RMSNorm.reference(x, weight, 1e-6, residual)
    got = rms_norm(
        x.to(device), weight.to(device), 1e-6, None if residual is None else residual.to(device)
    )
    if residual is not None:
        reference, got = reference[0], got[0]
    assert reference.dtype == got.dtype == dtype
    assert torch.equal(reference, expected)
    if dtype == torch.float16 and residual is None:  # rounded once: the same bits
        assert torch.equal(got.cpu(), expected)
    # a rounding apart at most (the interpreter truncates to bfloat16 where CUDA rounds)
    exact = dtype != torch.bfloat16 or device.type == "cuda"
    torch.testing.assert_close(got.cpu(), expected, rtol=2**-7 if exact else 2**-5, atol=1e-6)


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
