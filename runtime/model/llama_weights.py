"""Where a Hugging Face checkpoint's tensors go in a Llama-family model (``llama.py``).

The model merges some projections into one parameter (q/k/v into ``qkv_proj``, gate/up into
``gate_up_proj``: ``PACKED``); Phi-3's checkpoints hold them fused already (``FUSED``), split
here so that tensor parallelism cuts each as any other. ``weight_shard`` says which part of
each tensor a rank holds, so the loaders read only that; ``load_weights`` copies the parts in
and checks that every parameter was set exactly once. Routed and shared experts map through
``expert_weights.py``; a partial or interleaved rotary reorders q's and k's rows (``to_rotary_layout``);
Gemma's norms are offset by 1 and Granite's residual branches scaled (``output_rows``) at load;
OLMo's q/k norms span the whole projection, so a rank holds its heads' part of their weights.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from conveyor.runtime.layers.lora import TARGETS
from conveyor.runtime.layers.parallel import Shard
from conveyor.runtime.model.expert_weights import (
    canonical_name,
    copy_checked,
    expected,
    expert_shard,
    is_expert,
    load_expert,
)
from conveyor.runtime.model.shape import DecoderShape

if TYPE_CHECKING:
    from conveyor.runtime.model.llama import LlamaForCausalLM

PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
"""Checkpoint projections -> (the model's merged parameter, the projection's part of it)."""

FUSED = {packed: parts for packed, parts in TARGETS.items() if len(parts) > 1}
"""Checkpoint tensors that hold several projections (Phi-3's ``qkv_proj``, ``gate_up_proj``,
named as the packed parameters they fill) -> those projections, in order."""


def weight_shard(shape: DecoderShape, hf_name: str) -> Shard | None:
    """The part of checkpoint tensor ``hf_name`` this rank holds (None: all of it). The
    loaders read only that part and hand ``load_weights`` the shard."""
    tp, sp, d = shape.tp, shape.split, shape.head_dim
    if tp.size == 1:
        return None
    if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
        return shape.vocab.shard
    if shape.experts is not None and is_expert(name := canonical_name(hf_name)):
        return expert_shard(shape.experts, name)
    across = shape.qk_norm_across_heads  # OLMo's q/k norms: this rank's heads' part of each
    if ".q_proj." in hf_name or (across and ".q_norm." in hf_name):
        return Shard(0, sp.head_start * d, sp.num_heads * d)
    if ".k_proj." in hf_name or ".v_proj." in hf_name or (across and ".k_norm." in hf_name):
        return Shard(0, sp.kv_head_start * d, sp.num_kv_heads * d)
    if ".gate_proj." in hf_name or ".up_proj." in hf_name:
        return Shard(0, sp.intermediate_start, sp.intermediate_size)
    if any(f".{fused}." in hf_name for fused in FUSED):
        return None  # read whole, split and cut by ``_split_fused``
    for row_parallel, start, size in (
        (".o_proj.", sp.head_start * d, sp.num_heads * d),
        (".down_proj.", sp.intermediate_start, sp.intermediate_size),
    ):
        if row_parallel in hf_name:
            if hf_name.endswith(".bias"):  # added once, by rank 0 (``layers/parallel.py``)
                return None if tp.rank == 0 else Shard(0, 0, 0, zero=True)
            return Shard(1, start, size)
    return None  # the norms: replicated


def load_weights(model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy Hugging Face tensors (each already cut to ``weight_shard``) into the (partly
    merged) parameters; all must be set."""
    s = model.shape
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for hf_name, tensor in _split_fused(s, weights):
        name = hf_name.removeprefix("model.")
        if "rotary_emb" in name:
            continue
        if name == "lm_head.weight" and model.lm_head is None:
            continue  # tied: the embedding is the head
        # Mixtral's and GraniteMoE's name for it
        name = canonical_name(name).replace(".block_sparse_moe.", ".mlp.")
        experts = s.experts
        if ".shared_expert" in name and experts and not experts.total_shared_intermediate_size:
            continue  # a shared expert of width 0 adds 0; transformers saves its tensors
        if experts is not None:
            keys = load_expert(experts, params, name, tensor, hf_name, s.residual_scale)
            if keys is not None:
                _mark(loaded, keys, hf_name)
                continue
        target, shard = name, None
        for hf_part, (ours, index) in PACKED.items():
            if f".{hf_part}." in name:
                target, shard = name.replace(f".{hf_part}.", f".{ours}."), (hf_part, index)
                break
        if target not in params:
            raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {s.model_type}")
        param = params[target]
        if shard is not None:
            tensor = output_rows(s, shard[0], tensor)
        elif residual := next((p for p in ("o_proj", "down_proj") if f".{p}." in name), None):
            tensor = output_rows(s, residual, tensor)
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            tensor = to_rotary_layout(s, "q_proj", tensor)
        if s.norm_offset and name.endswith("norm.weight"):
            tensor = tensor.float() + s.norm_offset  # Gemma scales by 1 + weight
        if name in ("embed_tokens.weight", "lm_head.weight"):  # the rows past are padding
            copy_checked(param.data[: s.vocab.loaded], tensor, hf_name)
        elif shard is None:
            copy_checked(param.data, tensor, hf_name)
        else:
            rows = shard_range(s, shard[0], ".shared_expert." in name)
            copy_checked(param.data.narrow(0, *rows), tensor, hf_name)
        _mark(loaded, [target if shard is None else f"{target}:{shard[1]}"], hf_name)
    missing = [n for n in _expected_names(model) if n not in loaded]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")


def _split_fused(
    s: DecoderShape, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterable[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each fused one (``FUSED``) split into its projections'
    (named as Llama names them), each cut to this rank's rows."""
    q, kv = s.total_num_heads * s.head_dim, s.total_num_kv_heads * s.head_dim
    sizes = {"qkv_proj": [q, kv, kv], "gate_up_proj": [s.total_intermediate_size] * 2}
    for hf_name, tensor in weights:
        fused = next((f for f in FUSED if f".{f}." in hf_name), None)
        if fused is None:
            yield hf_name, tensor
            continue
        if tensor.shape[0] != sum(sizes[fused]):
            raise ValueError(
                f"checkpoint tensor {hf_name!r} has {tensor.shape[0]} rows, expected "
                f"{' + '.join(map(str, sizes[fused]))}"
            )
        for part, piece in zip(FUSED[fused], tensor.split(sizes[fused]), strict=True):
            name = hf_name.replace(f".{fused}.", f".{part}.")
            shard = weight_shard(s, name)
            yield name, piece if shard is None else shard.of(piece)


def output_rows(shape: DecoderShape, hf_part: str, tensor: torch.Tensor) -> torch.Tensor:
    """The output rows of checkpoint projection ``hf_part`` (a weight, bias or LoRA ``B``) as
    the model holds them: q's and k's in rotary order (``to_rotary_layout``), o_proj's and
    down_proj's times Granite's residual multiplier (``DecoderShape.residual_scale``)."""
    if shape.residual_scale != 1 and hf_part in ("o_proj", "down_proj"):
        return tensor.float() * shape.residual_scale  # float32: a bf16 checkpoint rounds once
    return to_rotary_layout(shape, hf_part, tensor)


def to_rotary_layout(shape: DecoderShape, hf_part: str, tensor: torch.Tensor) -> torch.Tensor:
    """Rows of checkpoint projection ``hf_part`` (whole heads) in the order the rotary tables
    expect: q's and k's reordered per head under a partial rotary (``layers/rotary.py``),
    anything else as it is."""
    order = shape.qk_order
    if order is None or hf_part not in ("q_proj", "k_proj"):
        return tensor
    d = shape.head_dim
    return tensor.unflatten(0, (-1, d))[:, order.to(tensor.device)].flatten(0, 1)


def shard_range(s: DecoderShape, hf_part: str, shared_expert: bool = False) -> tuple[int, int]:
    """(start, rows) of checkpoint projection ``hf_part`` in its packed parameter: the
    dense MLP's, or ``shared_expert``'s (Qwen2-MoE)."""
    q, kv, inter = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.intermediate_size
    if shared_expert and s.experts is not None:
        inter = s.experts.shared_intermediate_size
    return {
        "q_proj": (0, q),
        "k_proj": (q, kv),
        "v_proj": (q + kv, kv),
        "gate_proj": (0, inter),
        "up_proj": (inter, inter),
    }[hf_part]


def _expected_names(model: LlamaForCausalLM) -> list[str]:
    names = []
    experts = model.shape.experts.num_experts if model.shape.experts else 0
    for name, _ in model.named_parameters():
        if (per_expert := expected(name, experts)) is not None:
            names += per_expert
        elif ".qkv_proj." in name:
            names += [f"{name}:{i}" for i in range(3)]
        elif ".gate_up_proj." in name:
            names += [f"{name}:{i}" for i in range(2)]
        else:
            names.append(name)
    return names


def _mark(loaded: set[str], keys: list[str], hf_name: str) -> None:
    """Note what a checkpoint tensor set; each part may be set once."""
    if not loaded.isdisjoint(keys):
        raise ValueError(f"checkpoint tensor {hf_name!r} is given twice (fused and on its own?)")
    loaded.update(keys)
