"""LoRA adapters: fine-tunes of one base model served side by side, chosen per request.

An adapter (PEFT's ``adapter_config.json`` and ``adapter_model.safetensors``) adds
``scaling * B @ A`` to some of the decoder's projections. Every adapter a replica serves
sits in one of ``--max-loras`` slots on the device. Each projection keeps all slots' ``A``
stacked in one matrix and all ``B`` side by side in another, so a step whose tokens use
different adapters (or none) costs two extra matmuls per projection:

    y += ((x @ A_all.T) * mask) @ B_all.T

``mask`` (tokens, slots * parts * rank) keeps, for each token, the columns of its own
adapter only; a base token's row is all zeros, so its output is the base model's. Ranks
below ``--max-lora-rank`` are padded with zero rows. The shapes are fixed, whatever the mix.

A step whose tokens all belong to the base model runs no LoRA code: the fused C++ layers and
the CUDA graphs stay as they are. A step that holds an adapter's tokens runs the layers one
by one, eagerly (``ModelRunner._forward``).

On a mixture-of-experts model (Mixtral, Qwen-MoE, GraniteMoE) adapters of the attention
projections, and of the MLPs of the layers that keep a dense one, are served; PEFT's default
targets (q_proj, v_proj) are attention's. Adapters of the experts are refused.

Under tensor parallelism a column-parallel projection (q/k/v, gate/up) takes this rank's
rows of ``B``, a row-parallel one (o, down) this rank's columns of ``A``: its partial delta
is summed by the layer's all-reduce with the rest.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from conveyor.runtime.engine.settings import AdapterError, check_adapter_name

if TYPE_CHECKING:
    from conveyor.runtime.model.llama import LlamaForCausalLM

PEFT_DEFAULT_ALPHA = 8
"""``LoraConfig.lora_alpha``'s default, for a config that leaves it out."""

TARGETS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
"""Each of the model's (packed) projections -> the checkpoint's modules it holds, in order."""

_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
          "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
          "qkv_proj": "self_attn", "gate_up_proj": "mlp"}  # fmt: skip
"""Checkpoint module -> its block; ``qkv_proj`` and ``gate_up_proj`` are Phi-3's fused ones."""

_TENSOR = re.compile(
    r"(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(q_proj|k_proj|"
    r"v_proj|o_proj|gate_proj|up_proj|down_proj|qkv_proj|gate_up_proj)\.lora_([AB])(?:\.default)?\.weight"
)


@dataclass
class Adapter:
    """An adapter read from its folder: per checkpoint module, ``A`` (r, in) and
    ``scaling * B`` (out, r), on the CPU in float32, at the model's full (unsplit) shape."""

    name: str
    path: str
    rank: int
    """The largest rank of its modules."""
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    """(layer, checkpoint module such as ``q_proj``) -> (A, scaling * B)."""

    def to_bytes(self) -> bytes:
        """The tensors as safetensors bytes, as a tensor-parallel rank 0 sends them to the
        others (a pickled tensor would go through torch's shared-memory handles, which the
        ranks' own processes cannot open)."""
        from safetensors.torch import save

        tensors = {}
        for (layer, module), (a, b) in self.weights.items():
            tensors[f"{layer}.{module}.A"], tensors[f"{layer}.{module}.B"] = a, b
        return save(tensors)

    @classmethod
    def from_bytes(cls, name: str, path: str, rank: int, data: bytes) -> Adapter:
        from safetensors.torch import load

        tensors = load(data)
        weights = {}
        for key in tensors:
            if key.endswith(".A"):
                layer, module, _ = key.split(".")
                weights[(int(layer), module)] = (tensors[key], tensors[key[:-1] + "B"])
        return cls(name, path, rank, weights)


def read_adapter(name: str, path: str | Path, model: LlamaForCausalLM, max_rank: int) -> Adapter:
    """Read and check the PEFT adapter in folder ``path`` against ``model``'s shape."""
    from safetensors.torch import load_file

    check_adapter_name(name)
    folder = Path(path).expanduser()
    try:
        return _read(name, folder, model, max_rank, load_file)
    except OSError as exc:  # a name too long, a folder that cannot be listed
        raise AdapterError(f"adapter {name!r}: {str(folder)[:300]!r}: {exc.strerror}") from None


def _read(
    name: str, folder: Path, model: LlamaForCausalLM, max_rank: int, load_file: Any
) -> Adapter:
    from safetensors import SafetensorError

    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not folder.is_dir():
        raise AdapterError(f"adapter {name!r}: {str(folder)!r} is not a folder")
    if not config_file.is_file():
        raise AdapterError(f"adapter {name!r}: {str(folder)!r} holds no adapter_config.json")
    if not weights_file.is_file():
        hint = (
            " (convert adapter_model.bin to safetensors)"
            if (folder / "adapter_model.bin").is_file()
            else ""
        )
        raise AdapterError(
            f"adapter {name!r}: {str(folder)!r} holds no adapter_model.safetensors{hint}"
        )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:  # also not UTF-8
        raise AdapterError(f"adapter {name!r}: adapter_config.json cannot be read: {exc}") from None
    scaling_of = _scaling(name, config)
    try:
        tensors = load_file(str(weights_file))
    except (OSError, SafetensorError) as exc:
        raise AdapterError(
            f"adapter {name!r}: adapter_model.safetensors cannot be read: {exc}"
        ) from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _TENSOR.fullmatch(key)
        if m is None and (".experts." in key or ".shared_expert." in key):
            raise AdapterError(
                f"adapter {name!r}: tensor {key!r} adapts a mixture of experts' expert; only "
                "attention projections (and dense layers' MLPs) are served on these models"
            )
        if m is None or _BLOCK[m.group(3)] != m.group(2):
            raise AdapterError(
                f"adapter {name!r}: tensor {key!r} is not a LoRA weight of q/k/v/o/gate/up/down "
                "projections; adapters of embeddings, the LM head or biases are not served"
            )
        halves.setdefault((int(m.group(1)), m.group(3)), {})[m.group(4)] = tensor
    if not halves:
        raise AdapterError(f"adapter {name!r}: adapter_model.safetensors holds no LoRA weights")
    dims = module_dims(model)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), pair in sorted(halves.items()):
        where = f"adapter {name!r}, layer {layer} {module}"
        if layer >= model.shape.num_layers:
            raise AdapterError(f"{where}: the model has {model.shape.num_layers} layers")
        experts = model.shape.experts
        if _BLOCK[module] == "mlp" and experts is not None and experts.sparse_layers[layer]:
            raise AdapterError(
                f"{where}: that layer's MLP is a mixture of experts; adapters of experts are "
                "not served, only of attention projections and dense layers' MLPs"
            )
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{where}: lora_A and lora_B must both be given")
        a, b = pair["A"].float(), pair["B"].float()
        out_features, in_features = dims[module]
        rank = a.shape[0] if a.dim() == 2 else -1
        if (
            a.dim() != 2
            or b.dim() != 2
            or a.shape[1] != in_features
            or tuple(b.shape) != (out_features, rank)
        ):
            raise AdapterError(
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the "
                f"model's ({out_features}, {in_features}) projection; is it this model's adapter?"
            )
        if rank < 1:
            raise AdapterError(f"{where}: lora_A has rank 0")
        if rank > max_rank:
            raise AdapterError(
                f"{where}: rank {rank} is over --max-lora-rank {max_rank}; raise it to serve it"
            )
        b = b * scaling_of(layer, module, rank)
        dtype = model.embed_tokens.weight.dtype
        if not (torch.isfinite(a.to(dtype)).all() and torch.isfinite(b.to(dtype)).all()):
            raise AdapterError(
                f"{where}: the weights (B scaled by lora_alpha / r) hold NaN or infinity "
                f"in {str(dtype).removeprefix('torch.')}"
            )
        # A fused module's A is its parts' A, and its B their Bs one under another.
        parts = TARGETS.get(module, (module,))
        pieces = b.split([dims[part][0] for part in parts])
        for part, piece in zip(parts, pieces, strict=True):
            if (layer, part) in weights:
                raise AdapterError(f"{where}: {part} is given twice (fused and on its own)")
            weights[(layer, part)] = (a, model.output_rows(part, piece))
    return Adapter(name, str(folder), max(a.shape[0] for a, _ in weights.values()), weights)


def _scaling(name: str, config: Any):
    """PEFT's ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA) per module, from the config
    (``alpha_pattern`` overrides alpha per module, as PEFT matches it: by the name's end)."""
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name!r}: adapter_config.json is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, ok, why in (
        ("use_dora", lambda v: not v, "DoRA adapters are not served"),
        ("bias", lambda v: v in (None, "none"), "adapters that train biases are not served"),
        ("modules_to_save", lambda v: not v, "adapters that save whole modules are not served"),
        ("fan_in_fan_out", lambda v: not v, "fan_in_fan_out (GPT-2 style) is not served"),
    ):
        if not ok(config.get(key)):
            raise AdapterError(f"adapter {name!r}: {why} ({key}: {config.get(key)!r})")
    alpha = config.get("lora_alpha", PEFT_DEFAULT_ALPHA)
    patterns = config.get("alpha_pattern") or {}
    if not _finite_number(alpha) or not isinstance(patterns, dict):
        raise AdapterError(f"adapter {name!r}: lora_alpha must be a finite number, got {alpha!r}")
    rslora = bool(config.get("use_rslora"))

    try:
        compiled = [(re.compile(rf"(.*\.)?{k}$"), v) for k, v in patterns.items()]
    except re.error as exc:
        raise AdapterError(
            f"adapter {name!r}: alpha_pattern is not a set of patterns: {exc}"
        ) from None
    if not all(_finite_number(v) for _, v in compiled):
        raise AdapterError(f"adapter {name!r}: alpha_pattern's values must be finite numbers")

    def scaling(layer: int, module: str, rank: int) -> float:
        full = f"model.layers.{layer}.{_BLOCK[module]}.{module}"
        a = next((v for k, v in compiled if k.match(full)), alpha)
        return float(a) / (math.sqrt(rank) if rslora else rank)

    return scaling


def _finite_number(value: Any) -> bool:
    """A JSON number that is not a bool, NaN or infinite (Python's json reads NaN and Infinity)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def module_dims(model: LlamaForCausalLM) -> dict[str, tuple[int, int]]:
    """Checkpoint module -> (out, in) features of the whole (unsplit) model."""
    s = model.shape
    q, kv = s.total_num_heads * s.head_dim, s.total_num_kv_heads * s.head_dim
    h, i = s.hidden_size, s.total_intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i),
            "qkv_proj": (q + 2 * kv, h), "gate_up_proj": (2 * i, h)}  # fmt: skip


class LoRAStep:
    """The step's adapters: per number of parts (1, 2, 3), the slots' columns its tokens use
    and each token's mask over them; None: no token of the step uses an adapter, and the
    projections add nothing."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.masks: dict[int, torch.Tensor] | None = None
        self.columns: dict[int, slice | torch.Tensor] = {}

    def begin(self, token_slots: list[int], device: torch.device) -> None:
        """``token_slots``: each token's slot, -1 for the base model. Only the slots the step
        uses take part, so its cost grows with the adapters in it, not the adapters loaded."""
        used = sorted({s for s in token_slots if s >= 0})
        place = {slot: i for i, slot in enumerate(used)}
        tokens = torch.tensor([place.get(s, -1) for s in token_slots], device=device)
        self.masks = {}
        for parts in (1, 2, 3):
            width = parts * self.rank
            if used == list(range(len(used))):  # the first slots: a view, no copy
                self.columns[parts] = slice(0, len(used) * width)
            else:
                starts = torch.tensor(used, device=device)[:, None] * width
                self.columns[parts] = (starts + torch.arange(width, device=device)).flatten()
            column_slot = torch.arange(len(used) * width, device=device) // width
            self.masks[parts] = tokens[:, None] == column_slot[None, :]

    def end(self) -> None:
        self.masks = None
        self.columns.clear()


class LoRAProjection:
    """One projection's slots: ``A`` (slots * parts * rank, in) and ``B`` (out, slots *
    parts * rank), this rank's share; called with the projection's input and output."""

    def __init__(self, step: LoRAStep, parts: int, a: torch.Tensor, b: torch.Tensor) -> None:
        self.step, self.parts, self.a, self.b = step, parts, a, b

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        masks = self.step.masks
        if masks is None:
            return y
        cols = self.step.columns[self.parts]
        # where, not a multiply: another token's columns are exact zeros, whatever x @ A.T
        # holds there, so no adapter can reach a request that does not use it
        shrunk = torch.where(masks[self.parts], x @ self.a[cols].t(), 0.0)
        return y + shrunk @ self.b[:, cols].t()


class LoRASlots:
    """The adapters resident on the device, one slot each, and each projection's
    ``LoRAProjection`` attached to the model's layers (``lora_qkv_proj`` and so on). Slots
    are added (the stacks copied into larger ones, between two steps) as adapters are
    loaded, up to ``max_resident`` adapters (None: no bound)."""

    def __init__(
        self, model: LlamaForCausalLM, slots: int, max_rank: int, max_resident: int | None = None
    ) -> None:
        self.model = model
        self.max_rank = max_rank
        self.max_resident = max_resident
        self.names: list[str | None] = []
        self.paths: list[str | None] = []
        self.loads = 0
        self.keys: list[str | None] = []
        """Per slot: what keys its requests' prefix-cache blocks (the name and which load of
        it: a name loaded again may have other weights)."""
        self.step = LoRAStep(max_rank)
        self.projections: dict[tuple[int, str], LoRAProjection] = {}
        weight = model.embed_tokens.weight
        params = dict(model.named_parameters())
        for i, layer in enumerate(model.layers):
            for target, modules in TARGETS.items():
                block = "self_attn" if target in ("qkv_proj", "o_proj") else "mlp"
                if f"layers.{i}.{block}.{target}.weight" not in params:
                    continue  # a mixture of experts' layer: no dense MLP (``_read`` refuses it)
                out_features, in_features = params[f"layers.{i}.{block}.{target}.weight"].shape
                a = weight.new_zeros(0, in_features)
                b = weight.new_zeros(out_features, 0)
                projection = LoRAProjection(self.step, len(modules), a, b)
                self.projections[(i, target)] = projection
                setattr(getattr(layer, block), f"lora_{target}", projection)
        self._grow(slots)

    @torch.no_grad()
    def _grow(self, slots: int) -> None:
        """Room for ``slots`` adapters: each stack copied into a larger one of zeros."""
        added = slots - len(self.names)
        if added <= 0:
            return
        grown = {}
        try:  # every stack made before any is replaced: a failure leaves them all as they were
            for key, p in self.projections.items():
                width = added * len(TARGETS[key[1]]) * self.max_rank
                a = torch.cat([p.a, p.a.new_zeros(width, p.a.shape[1])])
                b = torch.cat([p.b, p.b.new_zeros(p.b.shape[0], width)], dim=1)
                grown[key] = (a, b)
        except RuntimeError as exc:  # out of memory (torch.OutOfMemoryError is one)
            raise AdapterError(
                f"no memory for {slots} LoRA slots ({exc}); unload an adapter or bound them with "
                "--max-cpu-loras"
            ) from None
        for key, (a, b) in grown.items():
            self.projections[key].a, self.projections[key].b = a, b
        self.names += [None] * added
        self.paths += [None] * added
        self.keys += [None] * added

    def slot_of(self, name: str) -> int | None:
        return self.names.index(name) if name in self.names else None

    def name_of(self, slot: int) -> str | None:
        return self.names[slot] if slot >= 0 else None

    @property
    def loaded(self) -> int:
        return sum(name is not None for name in self.names)

    def free_slot(self) -> int | None:
        """An empty slot (one more is made if every slot holds an adapter); None when
        ``max_resident`` adapters are loaded."""
        if self.max_resident is not None and self.loaded >= self.max_resident:
            return None
        return self.names.index(None) if None in self.names else len(self.names)

    @torch.no_grad()
    def put(self, slot: int, adapter: Adapter | None) -> None:
        """Fill ``slot`` with ``adapter`` (this rank's share of it); None empties it. A slot
        past the last makes room: twice the slots, or as many as needed."""
        if slot >= len(self.names):
            doubled = 2 * len(self.names)
            if self.max_resident is not None:
                doubled = min(doubled, self.max_resident)
            self._grow(max(slot + 1, doubled))
        r = self.max_rank
        for (i, target), p in self.projections.items():
            modules = TARGETS[target]
            cols = slice(slot * len(modules) * r, (slot + 1) * len(modules) * r)
            p.a[cols].zero_()
            p.b[:, cols].zero_()
            if adapter is None:
                continue
            for j, module in enumerate(modules):
                pair = adapter.weights.get((i, module))
                if pair is None:
                    continue
                a, b = self._shard(i, module, *pair)
                start = cols.start + j * r
                rows = self._rows(target, module)
                p.a[start : start + a.shape[0]] = a.to(p.a.dtype)
                p.b[rows, start : start + b.shape[1]] = b.to(p.b.dtype)
        self.names[slot] = None if adapter is None else adapter.name
        self.paths[slot] = None if adapter is None else adapter.path
        self.loads += 1
        self.keys[slot] = None if adapter is None else f"{adapter.name}\0{self.loads}"

    def _shard(
        self, layer: int, module: str, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        shard = self.model.weight_shard(f"model.layers.{layer}.{_BLOCK[module]}.{module}.weight")
        if shard is None:
            return a, b
        if shard.dim == 0:  # column-parallel: this rank's output rows
            return a, shard.of(b)
        return shard.of(a), b  # row-parallel: this rank's input columns

    def _rows(self, target: str, module: str) -> slice:
        """The rows of ``target``'s output that ``module`` fills (this rank's)."""
        if len(TARGETS[target]) == 1:
            return slice(None)
        start, size = self.model.shard_range(module)
        return slice(start, start + size)
