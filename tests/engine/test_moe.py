"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) beside transformers: what the
shared correctness tests (``model_dirs``'s ``mixtral``, ``qwen3_moe`` and ``qwen2_moe``) do not
reach -- the experts' torch path against a plain loop, both checkpoint layouts, the configs'
fields, and what is refused."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from model_shapes import MIXTRAL, QWEN2_MOE, QWEN3_MOE
from safetensors.torch import load_file, save_file
from test_correctness import make_engine, run_staggered

from conveyor.runtime.layers.moe import ExpertShape, SparseMoeBlock
from conveyor.runtime.layers.parallel import TensorParallel
from conveyor.runtime.model.builtin import generate_model


def _requests(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(256) for _ in range(rng.randint(2, 40))], 12) for _ in range(n)]


def _block(shape: dict, seed: int) -> SparseMoeBlock:
    torch.manual_seed(seed)
    e = ExpertShape.of(SimpleNamespace(**shape))
    assert e is not None
    block = SparseMoeBlock(shape["hidden_size"], e, "silu", TensorParallel())
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return block


def _loop(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """The block, one token and one chosen expert at a time."""
    weights, ids = block.route(x)
    inter = block.w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist(), strict=True):
            gate, up = (block.w13[e] @ x[t]).split(inter)
            out[t] += w * (block.w2[e] @ (torch.nn.functional.silu(gate) * up))
    if block.shared_expert is not None:
        out += torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    return out


@pytest.mark.parametrize(
    "shape", [MIXTRAL, QWEN3_MOE, QWEN2_MOE], ids=["mixtral", "qwen3", "qwen2"]
)
@torch.no_grad()
def test_experts_equal_a_loop_over_tokens(shape):
    block = _block(shape, seed=1)
    x = torch.randn(23, shape["hidden_size"])
    assert torch.allclose(block(x), _loop(block, x), atol=1e-5, rtol=1e-4)
    # Every token on one expert (others idle), and no tokens at all.
    block.gate.weight.zero_()
    block.gate.weight[1] = 1.0
    x = x.abs()
    assert torch.allclose(block(x), _loop(block, x), atol=1e-5, rtol=1e-4)
    assert block(x[:0]).shape == (0, shape["hidden_size"])


def test_routing_follows_each_config():
    mixtral = ExpertShape.of(SimpleNamespace(**MIXTRAL))
    assert mixtral is not None and mixtral.renormalize and not mixtral.round_weights
    assert mixtral.intermediate_size == MIXTRAL["intermediate_size"]
    # transformers 5 keeps Qwen's num_experts as num_local_experts (its attribute map).
    qwen3 = transformers.Qwen3MoeConfig(
        num_hidden_layers=4, num_experts=6, num_experts_per_tok=2, decoder_sparse_step=2,
        mlp_only_layers=[3], moe_intermediate_size=40,
    )  # fmt: skip
    e = ExpertShape.of(qwen3)
    assert e is not None and e.num_experts == 6 and e.round_weights and not e.renormalize
    assert e.sparse_layers == (False, True, False, False)
    qwen2 = ExpertShape.of(SimpleNamespace(**QWEN2_MOE), TensorParallel(1, 2))
    assert qwen2 is not None
    assert (qwen2.intermediate_start, qwen2.intermediate_size) == (16, 16)
    assert (qwen2.shared_intermediate_start, qwen2.shared_intermediate_size) == (48, 48)
    assert ExpertShape.of(SimpleNamespace(model_type="qwen3")) is None


def test_a_dense_width_no_layer_uses_need_not_split():
    """A Qwen-MoE whose every layer is experts: only the experts' width must divide by the
    ranks; with num_experts 0 (every layer dense) it is a dense model."""
    from conveyor.runtime.model.shape import DecoderShape

    config = SimpleNamespace(**dict(QWEN3_MOE, intermediate_size=6002, mlp_only_layers=[]))
    shape = DecoderShape(config, TensorParallel(0, 4))
    assert shape.experts is not None and shape.total_intermediate_size == 0
    assert ExpertShape.of(SimpleNamespace(**dict(QWEN3_MOE, num_experts=0))) is None


def test_shapes_that_cannot_run_are_refused():
    with pytest.raises(ValueError, match="does not divide the model's expert MLP width 48"):
        ExpertShape.of(SimpleNamespace(**QWEN3_MOE), TensorParallel(0, 5))
    with pytest.raises(ValueError, match="num_experts_per_tok 5 must be between 1 and the 4"):
        ExpertShape.of(SimpleNamespace(**dict(MIXTRAL, num_experts_per_tok=5)))


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe")
    return {
        "qwen3_moe": str(generate_model(root / "qwen3_moe", QWEN3_MOE, seed=21)),
        "mixtral": str(generate_model(root / "mixtral", MIXTRAL, seed=22)),
    }


def _stacked(src: str, dest: Path) -> str:
    """A copy of ``src`` with each layer's experts in transformers 5's stacked layout."""
    dest.mkdir()
    for f in Path(src).iterdir():
        if f.name != "model.safetensors":
            (dest / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(Path(src) / "model.safetensors"))
    stacked: dict[str, torch.Tensor] = {}
    for layer in range(QWEN3_MOE["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts."
        if f"{p}0.gate_proj.weight" not in tensors:
            continue  # a dense layer
        parts = {
            part: [tensors.pop(f"{p}{i}.{part}.weight") for i in range(QWEN3_MOE["num_experts"])]
            for part in ("gate_proj", "up_proj", "down_proj")
        }
        stacked[p + "gate_up_proj"] = torch.cat(
            [torch.stack(parts["gate_proj"]), torch.stack(parts["up_proj"])], dim=1
        )
        stacked[p + "down_proj"] = torch.stack(parts["down_proj"])
    save_file(tensors | stacked, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return str(dest)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_stacked_and_per_expert_checkpoints_give_transformers_tokens(
    moe_dirs, reference, tmp_path, backend
):
    dirs = {**moe_dirs, "stacked": _stacked(moe_dirs["qwen3_moe"], tmp_path / "stacked")}
    requests = _requests(4, seed=3)
    for model in ("stacked", "mixtral"):
        engine = make_engine(
            dirs, model, attention_backend=backend, chunked_prefill_size=16, max_running_requests=3
        )
        outputs = run_staggered(engine, requests, [0, 0, 1, 2])
        reference_dir = moe_dirs["qwen3_moe"] if model == "stacked" else dirs[model]
        for i, (prompt, max_tokens) in enumerate(requests):
            assert outputs[f"r{i}"] == reference.greedy(reference_dir, prompt, max_tokens), model


def test_a_missing_expert_is_named(moe_dirs, tmp_path):
    src = Path(moe_dirs["qwen3_moe"])
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.0.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 tensors, e.g. \['layers.0.mlp.w13:5:1'\]"):
        make_engine({"broken": str(broken)}, "broken")


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
def test_a_shared_expert_of_width_0_as_transformers_saves_it(reference, tmp_path):
    """Qwen2-MoE without a shared expert: transformers still saves its (empty) projections and
    its gate; they add nothing, and the engine skips them."""
    config = dict(QWEN2_MOE, shared_expert_intermediate_size=0, qkv_bias=False)
    src = generate_model(tmp_path / "src", config, seed=23)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    assert model.model.layers[0].mlp.shared_expert.down_proj.weight.numel() == 0
    model.save_pretrained(tmp_path / "saved")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (Path(src) / f).exists():
            (tmp_path / "saved" / f).write_bytes((Path(src) / f).read_bytes())
    dirs = {"saved": str(tmp_path / "saved")}
    requests = _requests(2, seed=4)
    outputs = run_staggered(make_engine(dirs, "saved"), requests, [0, 0])
    for i, (prompt, max_tokens) in enumerate(requests):
        assert outputs[f"r{i}"] == reference.greedy(str(src), prompt, max_tokens)
