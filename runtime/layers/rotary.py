"""Rotary position embeddings (the rotate-half layout of Llama, Qwen and Mistral)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

RotaryKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    tuple[torch.Tensor, torch.Tensor],
]
"""(positions, q, k, cos, sin) -> (q, k), rotated (in place or not)."""


def rope_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for ``config``'s rope type.

    Scaled variants (llama3, yarn, linear, dynamic, longrope) come from
    transformers' own initialisers, so they match the reference exactly. A GGUF of
    Llama 3.x states its scaling as per-frequency factors instead (``rope_freq_factors``,
    set by the GGUF reader): each inverse frequency is divided by its factor, as llama.cpp does.
    """
    inv_freq, attention_scaling = _rope_inv_freq(config, head_dim)
    factors = getattr(config, "rope_freq_factors", None)
    if factors is not None:
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32, device="cpu")  # (D/2,)
    return inv_freq, attention_scaling


def rope_type(config) -> str:
    """``default`` (plain rope, computed here) or a scaled variant (transformers computes it)."""
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    return str(
        params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    )


def _rope_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = getattr(config, "rope_parameters", None) or {}
    kind = rope_type(config)
    if kind == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (
            base
            ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim)
        )
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    with torch.device("cpu"):  # it makes some tensors on the default device (the model's)
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    return inv_freq.float(), float(attention_scaling)


class RotaryEmbedding(nn.Module):
    kernel: RotaryKernel | None = None
    """A fused kernel (positions, q, k, cos, sin) -> (q, k) (``layers/fused.py``); None = torch."""
    cos: torch.Tensor
    """(max_position, head_dim), a buffer."""
    sin: torch.Tensor
    """(max_position, head_dim), a buffer."""

    def __init__(
        self, head_dim: int, max_position: int, inv_freq: torch.Tensor, scaling: float = 1.0
    ):
        super().__init__()
        self.head_dim = head_dim
        # The tables go where the model is being built (``with torch.device(...)``), and are
        # computed there, as the reference computes them on its own device.
        device = torch.get_default_device()
        inv_freq = inv_freq.to(device)
        positions = torch.arange(max_position, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq)  # (P, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, D)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` (T,), ``q`` (T, Hq, D), ``k`` (T, Hkv, D) -> rotated q, k."""
        if self.kernel is not None:
            return self.kernel(positions, q, k, self.cos, self.sin)
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # (T, 1, D)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
