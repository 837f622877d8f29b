"""Where a mixture-of-experts checkpoint's tensors go: routed experts into their layer's
stacked ``w13`` / ``w2`` (``layers/moe.py``), cut to this rank's columns.

Checkpoints name the experts two ways. One tensor per expert and projection: Mixtral's
``block_sparse_moe.experts.N.w1`` (gate), ``w3`` (up), ``w2`` (down), Qwen's
``mlp.experts.N.gate_proj`` / ``up_proj`` / ``down_proj``. Or transformers 5's stacked
layout, all a layer's experts in one tensor: ``experts.gate_up_proj`` (E, 2 * I, H) and
``experts.down_proj`` (E, H, I), which GraniteMoE's checkpoints hold as ``input_linear`` and
``output_linear`` (``canonical_name``). Tensor parallelism splits each expert's columns as a dense
MLP's (``weight_shard``); the stacked gate/up is read whole and cut here, since its gate and
up halves each hold a slice of this rank's columns.

What a tensor set is named as ``expected`` names it (``w13:expert:half``, ``w2:expert``), so
the loader can say which expert a checkpoint lacks.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from conveyor.runtime.layers.moe import ExpertShape
from conveyor.runtime.layers.parallel import Shard

GRANITE_NAMES = {
    "block_sparse_moe.input_linear.weight": "block_sparse_moe.experts.gate_up_proj",
    "block_sparse_moe.output_linear.weight": "block_sparse_moe.experts.down_proj",
    "block_sparse_moe.router.layer.weight": "block_sparse_moe.gate.weight",
    "block_sparse_moe.router.weight": "block_sparse_moe.gate.weight",
}
"""GraniteMoE's names (its checkpoints', then transformers 5's) -> the stacked layout's and the
router's as Mixtral names it."""

EXPERT_WEIGHT = re.compile(
    r"(layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\."
    r"(?:(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight|(gate_up_proj|down_proj))$"
)
"""A routed expert's checkpoint tensor -> (layer, expert, part, None), or (layer, None, None,
stacked) for the stacked layout."""
EXPERT_HALF = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1}
"""An expert's gate and up projections -> their half of its ``w13`` rows; the rest is ``w2``."""


def canonical_name(hf_name: str) -> str:
    """``hf_name`` with GraniteMoE's expert and router names as the stacked layout's."""
    for theirs, ours in GRANITE_NAMES.items():
        if hf_name.endswith(theirs):
            return hf_name.removesuffix(theirs) + ours
    return hf_name


def is_expert(hf_name: str) -> bool:
    """``hf_name`` (``canonical_name``) is a routed or a shared expert's tensor."""
    return EXPERT_WEIGHT.search(hf_name) is not None or ".shared_expert." in hf_name


def expert_shard(e: ExpertShape, hf_name: str) -> Shard | None:
    """The part of expert tensor ``hf_name`` (``is_expert``) a rank holds; None: all of it."""
    expert = EXPERT_WEIGHT.search(hf_name)
    if expert is not None:
        start, width = e.intermediate_start, e.intermediate_size
        if expert[4] == "gate_up_proj":
            return None  # stacked gate and up: read whole, cut by ``load_expert``
        if expert[4] == "down_proj":
            return Shard(2, start, width)
        return Shard(0, start, width) if expert[3] in EXPERT_HALF else Shard(1, start, width)
    start, width = e.shared_intermediate_start, e.shared_intermediate_size
    return Shard(1 if ".down_proj." in hf_name else 0, start, width)


def load_expert(
    e: ExpertShape,
    params: dict[str, nn.Parameter],
    name: str,
    tensor: torch.Tensor,
    hf_name: str,
    down_scale: float = 1.0,
) -> list[str] | None:
    """Copy routed expert tensor ``name`` (the model's name for checkpoint tensor ``hf_name``)
    into its layer's ``w13`` or ``w2`` (times ``down_scale``: GraniteMoE's residual
    multiplier); returns what it set, as ``expected`` names it, or None when ``name`` is no
    routed expert's."""
    expert = EXPERT_WEIGHT.search(name)
    if expert is None:
        return None
    layer, index, part, stacked = expert.groups()
    w13, w2 = params.get(f"{layer}.mlp.w13"), params.get(f"{layer}.mlp.w2")
    if w13 is None or w2 is None or (index is not None and int(index) >= e.num_experts):
        raise ValueError(f"checkpoint tensor {hf_name!r} names an expert the model does not have")
    width, experts = e.intermediate_size, range(e.num_experts)
    if down_scale != 1 and (stacked == "down_proj" or part in ("w2", "down_proj")):
        tensor = tensor.float() * down_scale  # float32: a bf16 checkpoint rounds once
    if stacked == "gate_up_proj":  # (E, 2 * I, H) whole: this rank's gate rows, up rows
        start, total = e.intermediate_start, e.total_intermediate_size
        if tensor.dim() != 3 or tensor.shape[1] != 2 * total:
            raise ValueError(
                f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected "
                f"({e.num_experts}, {2 * total}, hidden)"
            )
        tensor = torch.cat(
            [tensor.narrow(1, start, width), tensor.narrow(1, total + start, width)], 1
        )
        copy_checked(w13.data, tensor, hf_name)
        return [f"{layer}.mlp.w13:{i}:{half}" for i in experts for half in (0, 1)]
    if stacked == "down_proj":
        copy_checked(w2.data, tensor, hf_name)
        return [f"{layer}.mlp.w2:{i}" for i in experts]
    i = int(index)
    half = EXPERT_HALF.get(part)
    if half is None:
        copy_checked(w2.data[i], tensor, hf_name)
        return [f"{layer}.mlp.w2:{i}"]
    copy_checked(w13.data[i].narrow(0, half * width, width), tensor, hf_name)
    return [f"{layer}.mlp.w13:{i}:{half}"]


def expected(param_name: str, num_experts: int) -> list[str] | None:
    """What a checkpoint must set of parameter ``param_name``, one name per expert and half,
    or None when it is no layer's stacked experts."""
    if param_name.endswith(".mlp.w13"):
        return [f"{param_name}:{i}:{half}" for i in range(num_experts) for half in (0, 1)]
    if param_name.endswith(".mlp.w2"):
        return [f"{param_name}:{i}" for i in range(num_experts)]
    return None


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    """``dst.copy_(src)``, refusing checkpoint tensor ``name`` when the shapes differ."""
    if dst.shape != src.shape:
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
        )
    dst.copy_(src)
