"""Mixture-of-experts MLP: Mixtral, Qwen2-MoE and Qwen3-MoE.

A router (a linear layer over the hidden state) scores every expert for each token; the
softmax over those scores, in float32, picks the token's top ``k`` experts and weighs their
outputs (renormalised over the ``k`` where the model says so). Each expert is a gated MLP of
its own. Qwen2-MoE adds a shared expert that every token runs, scaled by a sigmoid gate.

The experts' weights are stacked, as one kernel reads them: ``w13`` (E, 2 * I, H) holds each
expert's gate rows then its up rows, ``w2`` (E, H, I) its down projection. Under tensor
parallelism each rank holds a slice of every expert's columns (as a dense MLP's), and one
all-reduce sums the experts' and the shared expert's partial outputs.

The torch path here sorts the token-expert pairs by expert and runs one gated MLP per expert
that has tokens (it reads the counts on the host). A backend may hand the block a fused
kernel with ``experts``' signature instead: Triton's on GPU (``kernels/fused_moe.py``), which
reads nothing on the host, so CUDA graphs hold it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.runtime.layers.activation import GeluAndMul, SiluAndMul
from conveyor.runtime.layers.parallel import SINGLE, TensorParallel

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "granitemoe")

FusedMoEKernel = Callable[
    ["SparseMoeBlock", torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]
"""(block, x, topk_weights, topk_ids) -> the routed experts' sum, as ``block.experts``."""


@dataclass(frozen=True)
class ExpertShape:
    """What a config says about its experts; the widths are this rank's share."""

    num_experts: int
    top_k: int
    intermediate_size: int
    """Each expert's MLP width on this rank."""
    intermediate_start: int
    total_intermediate_size: int
    renormalize: bool
    """The top-k weights are divided by their sum (Mixtral and GraniteMoE always; Qwen's
    ``norm_topk_prob``)."""
    round_weights: bool
    """The routing weights are rounded to the model's dtype before they scale the experts'
    outputs (Qwen's and GraniteMoE's routers); Mixtral's stay float32."""
    shared_intermediate_size: int
    """Qwen2-MoE's shared expert's width on this rank; 0: none."""
    shared_intermediate_start: int
    total_shared_intermediate_size: int
    sparse_layers: tuple[bool, ...]
    """Per layer: experts (True) or a dense MLP of ``config.intermediate_size``."""

    @classmethod
    def of(cls, config: Any, tp: TensorParallel = SINGLE) -> ExpertShape | None:
        """None for a dense model; ValueError when the experts cannot be split ``tp.size``
        ways or the config asks for what is not served."""
        kind = config.model_type
        if kind not in MOE_MODEL_TYPES:
            return None
        layers = config.num_hidden_layers
        # Qwen's config.json says num_experts, which transformers 5 keeps as num_local_experts.
        local = getattr(config, "num_local_experts", None)
        experts: int = getattr(config, "num_experts", 0) if local is None else local
        if kind in ("mixtral", "granitemoe"):  # GraniteMoE: a softmax over the top k's scores
            inter, shared = config.intermediate_size, 0
            renormalize, sparse = True, (True,) * layers
        else:
            inter = config.moe_intermediate_size
            shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
            renormalize = bool(getattr(config, "norm_topk_prob", False))
            step = getattr(config, "decoder_sparse_step", 1) or 1
            dense = set(getattr(config, "mlp_only_layers", None) or ())
            sparse = tuple(
                experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(layers)
            )
        if not any(sparse):
            return None  # num_experts 0, or every layer in mlp_only_layers: a dense model
        top_k = config.num_experts_per_tok
        if not 1 <= top_k <= experts:
            raise ValueError(
                f"num_experts_per_tok {top_k} must be between 1 and the {experts} experts"
            )
        start, width = split_width(inter, tp, "expert MLP width")
        shared_start, shared_width = split_width(shared, tp, "shared expert's MLP width")
        return cls(
            experts, top_k, width, start, inter, renormalize, kind != "mixtral",
            shared_width, shared_start, shared, sparse,
        )  # fmt: skip


def dense_width(config: Any, experts: ExpertShape | None) -> int:
    """The dense MLP's width: ``intermediate_size``, or 0 when every layer's MLP is experts
    (Mixtral's ``intermediate_size`` is its experts' width; a Qwen-MoE's dense width is then
    never used, so tensor parallelism need not divide it)."""
    if experts is not None and all(experts.sparse_layers):
        return 0
    return config.intermediate_size


def split_width(total: int, tp: TensorParallel, what: str) -> tuple[int, int]:
    """(start, width) of this rank's columns of an MLP ``total`` wide."""
    if total % tp.size:
        raise ValueError(
            f"--tensor-parallel-size {tp.size} does not divide the model's {what} {total}"
        )
    width = total // tp.size
    return tp.rank * width, width


class GatedMLP(nn.Module):
    """act(x @ gate) * (x @ up) @ down, over a merged gate_up projection; its output is this
    rank's partial sum (the caller all-reduces it)."""

    def __init__(self, hidden: int, width: int, activation: str, bias: bool = False):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * width, bias=bias)
        self.down_proj = nn.Linear(width, hidden, bias=bias)
        self.act = SiluAndMul() if activation == "silu" else GeluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """The experts of one layer, their router and (Qwen2-MoE) the shared expert."""

    kernel: FusedMoEKernel | None = None
    """A fused kernel for ``experts`` (``layers/fused.py``); None: the torch path."""
    packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
    """Each expert's w13 and w2 prepacked for oneDNN, on CPU (``layers/linear.py``)."""

    def __init__(self, hidden: int, e: ExpertShape, activation: str, tp: TensorParallel):
        super().__init__()
        self.top_k, self.renormalize, self.round_weights = e.top_k, e.renormalize, e.round_weights
        self.activation = activation
        self.gate = nn.Linear(hidden, e.num_experts, bias=False)  # the router: replicated
        self.w13 = nn.Parameter(torch.empty(e.num_experts, 2 * e.intermediate_size, hidden))
        self.w2 = nn.Parameter(torch.empty(e.num_experts, hidden, e.intermediate_size))
        self.act = SiluAndMul() if activation == "silu" else GeluAndMul()
        self.shared_expert: GatedMLP | None = None
        if e.total_shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden, e.shared_intermediate_size, activation)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.tp = tp if tp.size > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden), summed over the ranks."""
        weights, ids = self.route(x)
        if self.kernel is not None:
            out = self.kernel(self, x, weights, ids)
        else:
            out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.tp is None else self.tp.all_reduce(out)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and their weights -> (weights (T, k) float32, ids (T, k))."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.round_weights:
            weights = weights.to(x.dtype).float()
        return weights, ids

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum (T, hidden): one gated MLP per expert that has
        tokens, over the token-expert pairs sorted by expert. Each expert's output is rounded
        to x's dtype, weighed and summed in float32, and rounded once."""
        num_tokens, k = ids.shape
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.w13.shape[0]).tolist()
        rows = x[order // k]  # the pairs' tokens, grouped by expert
        outs = torch.empty((num_tokens * k, x.shape[1]), dtype=x.dtype, device=x.device)
        start = 0
        for expert, n in enumerate(counts):
            if n:
                group = rows[start : start + n]
                h = self.act(F.linear(group, self.w13[expert]))
                outs[order[start : start + n]] = F.linear(h, self.w2[expert])
                start += n
        weighted = outs.view(num_tokens, k, x.shape[1]).float() * weights.unsqueeze(-1)
        return weighted.sum(dim=1).to(x.dtype)
