"""Rotary position embeddings (the rotate-half layout of Llama, Qwen, Mistral and Phi-3).

A partial rotary (Phi-3's ``partial_rotary_factor``: only a head's first ``rotary_dim``
dimensions turn, in pairs ``(i, i + rotary_dim / 2)``) runs in the same full-head layout, so
every kernel stays as it is: the checkpoint's q and k rows are reordered per head at load
(``rotary_row_order``) so that each turning pair lands on ``(j, j + head_dim / 2)`` and the
passing dimensions on the slots whose frequency is zero (cos 1, sin 0). Attention reads only
q·k, which one order for both leaves as it was. An interleaved rotary (GLM's and ERNIE 4.5's,
GPT-J's layout: pairs ``(2i, 2i + 1)`` turn at frequency ``i``) is reordered the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

RotaryKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    tuple[torch.Tensor, torch.Tensor],
]
"""(positions, q, k, cos, sin) -> (q, k), rotated (in place or not)."""


def rope_inv_freq(
    config, head_dim: int, context: int | None = None, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of the turning pairs, ``(rotary_dim / 2,)``, and the attention
    scaling, for ``config``'s rope type; ``context``: the most positions a sequence may have
    (the served ``--max-model-len``; None: the model's ``max_position_embeddings``).
    ``layer_type``: which of a config's per-layer-type parameters (Gemma 3's
    ``rope_parameters`` holds one set for ``sliding_attention`` layers and one for
    ``full_attention``, see ``rope_layer_types``); None where it has one set.

    Scaled variants (llama3, yarn, linear, dynamic, longrope) come from
    transformers' own initialisers, so they match the reference exactly. A GGUF of
    Llama 3.x states its scaling as per-frequency factors instead (``rope_freq_factors``,
    set by the GGUF reader): each inverse frequency is divided by its factor, as llama.cpp does.

    LongRoPE (Phi-3's 128k models) has two sets of factors: transformers turns a sequence
    with the short ones while it fits ``original_max_position_embeddings`` and recomputes its
    whole cache with the long ones once it outgrows them. A replica keeps one table, as vLLM
    0.32 does (``LlamaForCausalLM.fit_rope_to`` rewrites it once the KV cache has sized the
    served context): the short factors when ``context`` fits the original length (exactly
    transformers' rope, for every sequence), the long ones when it does not (transformers'
    rope for every sequence longer than the original length). Without ``--max-model-len``
    the served context is the original one (``engine/state.py``), as vLLM's default is.
    """
    inv_freq, attention_scaling = _rope_inv_freq(config, head_dim, context, layer_type)
    factors = getattr(config, "rope_freq_factors", None)
    if factors is not None:
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32, device="cpu")  # (D/2,)
    return inv_freq, attention_scaling


def rope_layer_types(config) -> tuple[str, ...] | None:
    """The layer types whose rope parameters differ (Gemma 3: ``full_attention`` layers turn
    at theta 1e6, scaled on its larger models, ``sliding_attention`` ones at 1e4), in the
    order the model keeps their tables; None where one set serves every layer."""
    params = getattr(config, "rope_parameters", None) or {}
    # transformers' Gemma 3 config nests a set per layer type even beside flat keys (a
    # config.json with a flat rope_parameters): the nested sets are what its layers read.
    nested = tuple(sorted(k for k, v in params.items() if isinstance(v, dict)))
    return nested or None


def rope_type(config, layer_type: str | None = None) -> str:
    """``default`` (plain rope, computed here) or a scaled variant (transformers computes it)."""
    params = _rope_params(config, layer_type)
    scaling = (getattr(config, "rope_scaling", None) or {}) if layer_type is None else {}
    return str(
        params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    )


def _rope_params(config, layer_type: str | None) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is None:
        return params if rope_layer_types(config) is None else {}
    return params[layer_type]


def rotary_dim(config, head_dim: int, layer_type: str | None = None) -> int:
    """How many of a head's dimensions turn: all but under a ``partial_rotary_factor``."""
    params = _rope_params(config, layer_type)
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    dim = int(head_dim * (1.0 if factor is None else factor))
    if dim < 2 or dim > head_dim or dim % 2:
        raise ValueError(
            f"partial_rotary_factor {factor!r} turns {dim} of a head's {head_dim} dimensions; "
            "Conveyor needs an even number from 2 to head_dim"
        )
    return dim


def rotary_row_order(head_dim: int, turning: int, interleaved: bool = False) -> torch.Tensor | None:
    """A head's q/k dimensions in Conveyor's layout under a partial rotary of ``turning``
    dimensions, or an interleaved one (see the module docstring): slot ``j`` holds the
    checkpoint's dimension ``order[j]``; None for a full rotary in the rotate-half layout,
    where the layouts are the same."""
    if turning == head_dim and not interleaved:
        return None
    half, pairs = head_dim // 2, turning // 2
    passing = list(range(turning, head_dim))
    # The checkpoint's pair i: (i, i + turning / 2), or (2i, 2i + 1) interleaved.
    first = range(0, turning, 2) if interleaved else range(pairs)
    second = range(1, turning, 2) if interleaved else range(pairs, turning)
    order = list(first) + passing[: half - pairs] + list(second) + passing[half - pairs :]
    return torch.tensor(order)


def _rope_inv_freq(
    config, head_dim: int, context: int | None, layer_type: str | None
) -> tuple[torch.Tensor, float]:
    params = _rope_params(config, layer_type)
    kind = rope_type(config, layer_type)
    dim = rotary_dim(config, head_dim, layer_type)  # checked for every kind: transformers' do not
    if kind == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (
            base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
        )
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    longest = context or getattr(config, "max_position_embeddings", None)
    extra: dict = {"seq_len": longest} if kind == "longrope" and longest else {}
    if layer_type is not None:
        extra["layer_type"] = layer_type
    with torch.device("cpu"):  # it makes some tensors on the default device (the model's)
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[kind](config, "cpu", **extra)
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
        half, pairs = head_dim // 2, inv_freq.numel()
        if pairs > half:
            raise ValueError(f"{pairs} rotary frequencies for a head of {head_dim}")
        # A partial rotary's passing slots (``rotary_row_order``): frequency 0, unscaled.
        inv_freq = torch.cat([inv_freq, inv_freq.new_zeros(half - pairs)]).to(device)
        scale = torch.ones(half, dtype=torch.float32, device=device)
        scale[:pairs] = scaling
        scale = torch.cat((scale, scale))  # (D,)
        positions = torch.arange(max_position, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq)  # (P, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, D)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

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
