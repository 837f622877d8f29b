"""LoRA adapters (``layers/lora.py``): a request that names an adapter gets what the base model
with the adapter merged into its weights gives, in a batch that mixes adapters and the base
model; adapters are kept apart in the prefix cache; bad adapters are refused with reasons."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch
from lora_files import FUSED_MODULES, MODULES, write_adapter, write_merged
from safetensors.torch import load_file, save_file

from conveyor.runtime.engine.llm import LLM, GenerationResult
from conveyor.runtime.engine.settings import AdapterError, LoRAModule
from conveyor.runtime.model.builtin import builtin_model_path
from conveyor.runtime.sampling_params import SamplingParams

PROMPTS = ["hello there, how are you", "the quick brown fox jumps", "one two three four five"]
GREEDY = SamplingParams(max_tokens=10, temperature=0, logprobs=0)


def _same(got: list[GenerationResult], want: list[GenerationResult]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        for a, b in zip(g.logprobs, w.logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=2e-3)


@pytest.mark.parametrize(
    "model", ["conveyor-tiny", "qwen2", "qwen3", "phi3", "gemma3", "granite", "olmo2"]
)
def test_adapters_and_base_in_one_batch_match_merged_weights(
    model: str, model_dirs: dict[str, str], tmp_path: Path
) -> None:
    base = Path(model_dirs[model])
    # Phi-3's adapters target its fused projections (and its q/k rows are reordered for its
    # partial rotary: the adapter's must be too)
    fused = model == "phi3"
    modules = FUSED_MODULES if fused else MODULES
    a = write_adapter(tmp_path / "a", base, seed=1, rank=8, alpha=16, std=0.3, modules=modules)
    # rsLoRA scaling, another rank, some modules of some layers only
    some = ("qkv_proj", "down_proj") if fused else ("q_proj", "v_proj", "down_proj")
    b = write_adapter(
        tmp_path / "b", base, seed=2, rank=4, alpha=8, modules=some, layers=[0], use_rslora=True
    )
    served = (LoRAModule("a", str(tmp_path / "a")), LoRAModule("b", str(tmp_path / "b")))
    with LLM(str(base), lora_modules=served, max_lora_rank=8) as llm:
        mixed = llm.generate(PROMPTS * 3, GREEDY, lora=["a"] * 3 + ["b"] * 3 + [None] * 3)
    merged_a = write_merged(tmp_path / "merged-a", base, a, scaling=16 / 8)
    merged_b = write_merged(tmp_path / "merged-b", base, b, scaling=8 / 4**0.5)
    want = []
    for folder in (merged_a, merged_b, base):
        with LLM(str(folder)) as llm:
            want += llm.generate(PROMPTS, GREEDY)
    _same(mixed, want)
    # the adapters change the answers: the test would catch deltas that were left out
    assert mixed[0].token_ids != mixed[6].token_ids or mixed[0].logprobs != mixed[6].logprobs


@pytest.mark.parametrize("model", ["qwen3_moe", "mixtral"])
def test_attention_adapters_on_a_mixture_of_experts_match_merged_weights(
    model: str, model_dirs: dict[str, str], tmp_path: Path
) -> None:
    """PEFT's default targets are attention's; Qwen3-MoE's dense layer 1 takes MLP ones too."""
    base = Path(model_dirs[model])
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    a = write_adapter(tmp_path / "a", base, seed=3, rank=8, alpha=16, std=0.3, modules=attention)
    served = [LoRAModule("a", str(tmp_path / "a"))]
    if model == "qwen3_moe":  # mlp_only_layers=[1]
        mlp = ("gate_proj", "up_proj", "down_proj")
        b = write_adapter(tmp_path / "b", base, seed=4, rank=4, alpha=8, modules=mlp, layers=[1])
        served.append(LoRAModule("b", str(tmp_path / "b")))
    with LLM(str(base), lora_modules=tuple(served), max_lora_rank=8) as llm:
        names = [s.name for s in served]
        mixed = llm.generate(
            PROMPTS * len(served), GREEDY, lora=[n for n in names for _ in PROMPTS]
        )
        base_out = llm.generate(PROMPTS, GREEDY)
    want = []
    merged = [write_merged(tmp_path / "merged-a", base, a, scaling=16 / 8)]
    if model == "qwen3_moe":
        merged.append(write_merged(tmp_path / "merged-b", base, b, scaling=8 / 4))
    for folder in merged:
        with LLM(str(folder)) as llm:
            want += llm.generate(PROMPTS, GREEDY)
    _same(mixed, want)
    assert [r.token_ids for r in mixed[:3]] != [r.token_ids for r in base_out]


def test_adapters_of_experts_are_refused_with_the_reason(
    model_dirs: dict[str, str], tmp_path: Path
) -> None:
    base = Path(model_dirs["qwen3_moe"])
    # layer 0's MLP is experts: its gate_proj is no dense projection
    write_adapter(tmp_path / "sparse", base, seed=5, modules=("gate_proj",), layers=[0])
    experts = tmp_path / "experts"
    write_adapter(experts, base, seed=6, modules=("q_proj",), layers=[0])
    tensors = load_file(str(experts / "adapter_model.safetensors"))
    for half, shape in (("A", (8, 128)), ("B", (48, 8))):
        key = f"base_model.model.model.layers.0.mlp.experts.3.gate_proj.lora_{half}.weight"
        tensors[key] = torch.zeros(shape)
    save_file(tensors, str(experts / "adapter_model.safetensors"))
    with LLM(str(base), enable_lora=True, max_lora_rank=8) as llm:
        with pytest.raises(AdapterError, match="layer 0 gate_proj: that layer's MLP is a mixture"):
            llm.engine.runner.read_lora("sparse", str(tmp_path / "sparse"))
        with pytest.raises(AdapterError, match="adapts a mixture of experts' expert"):
            llm.engine.runner.read_lora("experts", str(experts))


def test_an_adapter_never_reads_the_base_models_cached_blocks(tmp_path: Path) -> None:
    base = builtin_model_path()
    write_adapter(tmp_path / "a", base, seed=3)
    prompt = "x" * 100  # six full blocks of 16
    one = SamplingParams(max_tokens=1, temperature=0)
    with LLM(str(base), lora_modules=(LoRAModule("a", str(tmp_path / "a")),)) as llm:
        cached = [
            llm.generate(prompt, one, lora=name)[0].num_cached_tokens
            for name in (None, "a", "a", None)
        ]
    assert cached == [0, 0, 96, 96]


def test_adapters_load_and_unload_while_the_engine_runs(tmp_path: Path) -> None:
    base = builtin_model_path()
    write_adapter(tmp_path / "a", base, seed=4)
    write_adapter(tmp_path / "b", base, seed=5)
    with LLM(str(base), enable_lora=True, max_cpu_loras=1) as llm:
        engine = llm.engine
        with pytest.raises(ValueError, match="not loaded"):
            llm.generate("hi", GREEDY, lora="a")
        engine.loras.load(engine.runner.read_lora("a", str(tmp_path / "a")))
        first = llm.generate(PROMPTS, GREEDY, lora="a")
        with pytest.raises(AdapterError, match="--max-cpu-loras"):
            engine.loras.load(engine.runner.read_lora("b", str(tmp_path / "b")))
        with pytest.raises(AdapterError, match="already loaded"):
            engine.loras.load(engine.runner.read_lora("a", str(tmp_path / "a")))
        # unloaded while a request runs with it: the request finishes on it, new ones are refused
        engine.add_request("running", "hello", SamplingParams(max_tokens=5), lora="a")
        engine.add_request("queued", "hello", SamplingParams(max_tokens=5))
        assert engine.stats().waiting_loras == ("a",)
        engine.step()
        stats = engine.stats()
        assert (stats.max_loras, stats.running_loras, stats.waiting_loras) == (1, ("a",), ())
        engine.loras.unload("a")
        with pytest.raises(ValueError, match="not loaded"):
            engine.add_request("late", "hello", GREEDY, lora="a")
        with pytest.raises(AdapterError, match="being unloaded"):
            engine.loras.load(engine.runner.read_lora("a", str(tmp_path / "a")))
        while engine.has_unfinished_requests():
            engine.step()
        engine.loras.load(engine.runner.read_lora("b", str(tmp_path / "b")))  # its slot is free
        engine.loras.load(engine.runner.read_lora("b", str(tmp_path / "a")), replace=True)
        again = llm.generate(PROMPTS, GREEDY, lora="b")  # a's weights under b's name
    assert [r.token_ids for r in again] == [r.token_ids for r in first]


def test_slots_are_added_as_adapters_load_and_a_step_computes_only_the_adapters_in_it(
    tmp_path: Path,
) -> None:
    """One slot at start (vLLM's --max-loras 1 with three --lora-modules): every adapter gets
    one; a fourth loaded at run time adds more; after an unload the step's adapters are not
    the first slots, and each request still gets what it gets alone."""
    base = builtin_model_path()
    for name, seed in (("a", 11), ("b", 12), ("c", 13), ("d", 14)):
        write_adapter(tmp_path / name, base, seed=seed, std=0.3)
    modules = tuple(LoRAModule(n, str(tmp_path / n)) for n in "abc")
    with LLM(str(base), lora_modules=modules, max_loras=1) as llm:
        engine = llm.engine
        alone = {n: llm.generate(PROMPTS[0], GREEDY, lora=n)[0] for n in "abc"}
        engine.loras.load(engine.runner.read_lora("d", str(tmp_path / "d")))
        assert engine.runner.model.lora.names == ["a", "b", "c", "d", None, None]  # doubled
        alone["d"] = llm.generate(PROMPTS[0], GREEDY, lora="d")[0]
        engine.loras.unload("a")
        names = ["d", None, "b", "c", "d"]
        mixed = llm.generate([PROMPTS[0]] * len(names), GREEDY, lora=names)
        base_alone = llm.generate(PROMPTS[0], GREEDY)[0]
    want = [alone[n] if n else base_alone for n in names]
    _same(mixed, want)
    assert len({tuple(r.token_ids) for r in want}) == 4  # d, the base model, b and c differ


def _refusal(llm: LLM, tmp_path: Path, base: Path, **changes: object) -> str:
    folder = tmp_path / "bad"
    tensors = write_adapter(folder, base, seed=6, rank=4, layers=[0])
    edit = changes.pop("edit", None)
    if callable(edit):
        edit(folder, tensors)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(AdapterError) as err:
        llm.engine.runner.read_lora("bad", str(folder))
    return str(err.value)


def test_adapters_that_cannot_be_served_are_refused_with_the_reason(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    base = builtin_model_path()

    def save(folder: Path, tensors: dict) -> None:
        save_file(tensors, str(folder / "adapter_model.safetensors"))

    def wider(folder: Path, tensors: dict) -> None:
        key = next(k for k in tensors if k.endswith("q_proj.lora_A.weight"))
        save(folder, {**tensors, key: tensors[key].repeat(1, 2)})

    def embedding(folder: Path, tensors: dict) -> None:
        extra = {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 8)}
        save(folder, {**tensors, **extra})

    def rank_8(folder: Path, tensors: dict) -> None:
        write_adapter(folder, base, seed=7, rank=8, layers=[0])

    def far_layer(folder: Path, tensors: dict) -> None:
        save(folder, {k.replace("layers.0.", "layers.99."): v for k, v in tensors.items()})

    def half(folder: Path, tensors: dict) -> None:
        save(folder, {k: v for k, v in tensors.items() if ".lora_B." not in k})

    def no_weights(folder: Path, tensors: dict) -> None:
        (folder / "adapter_model.safetensors").unlink()

    with LLM(str(base), enable_lora=True, max_lora_rank=4) as llm:
        refused = partial(_refusal, llm, tmp_path, base)
        assert "do not fit" in refused(edit=wider)
        assert "embeddings" in refused(edit=embedding)
        assert "--max-lora-rank 4" in refused(edit=rank_8)
        assert "layers" in refused(edit=far_layer)
        assert "both" in refused(edit=half)
        assert "no adapter_model.safetensors" in refused(edit=no_weights)
        assert "DoRA" in refused(use_dora=True)
        assert "biases" in refused(bias="all")
        assert "whole modules" in refused(modules_to_save=["lm_head"])
        assert "not LORA" in refused(peft_type="PREFIX_TUNING")
        with pytest.raises(AdapterError, match="not a folder"):
            llm.engine.runner.read_lora("x", str(tmp_path / "missing"))
        assert "alpha_pattern" in refused(alpha_pattern={"(": 2})
        assert "finite number" in refused(lora_alpha=float("nan"))  # json writes NaN
        assert "finite number" in refused(lora_alpha=True)
        assert "NaN or infinity" in refused(lora_alpha=1e300)  # B * alpha / r overflows
        # PEFT's scaling: lora_alpha / r, with alpha_pattern's alpha for the modules it names
        folder = tmp_path / "patterned"
        tensors = write_adapter(folder, base, seed=8, rank=4, alpha=8, layers=[0],
                                alpha_pattern={"q_proj": 32})  # fmt: skip
        adapter = llm.engine.runner.read_lora("patterned", str(folder))
        config = json.loads((folder / "adapter_config.json").read_text())
        del config["lora_alpha"]  # PEFT's default, 8
        (folder / "adapter_config.json").write_text(json.dumps(config))
        default = llm.engine.runner.read_lora("default-alpha", str(folder))
        for module, scaling, default_scaling in (("q_proj", 8.0, 8.0), ("k_proj", 2.0, 2.0)):
            b = tensors[f"base_model.model.model.layers.0.self_attn.{module}.lora_B.weight"]
            assert torch.equal(adapter.weights[(0, module)][1], b * scaling)
            assert torch.equal(default.weights[(0, module)][1], b * default_scaling)


def test_lora_modules_parse_as_vllm_writes_them() -> None:
    assert LoRAModule.parse("sql=/adapters/sql") == LoRAModule("sql", "/adapters/sql")
    given = '{"name": "sql", "path": "/a/sql", "base_model_name": "m"}'
    assert LoRAModule.parse(given) == LoRAModule("sql", "/a/sql")
    for bad in ("sql", "=/a", "sql=", "{not json", '{"name": "x"}', "two words=/a"):
        with pytest.raises(ValueError):
            LoRAModule.parse(bad)


@pytest.mark.parametrize("model", ["conveyor-tiny", "qwen2"])
def test_adapters_split_over_tensor_parallel_ranks_match_one_rank(
    model: str, model_dirs: dict[str, str], tmp_path: Path
) -> None:
    """Each rank holds its share (B's rows of q/k/v and gate/up, A's columns of o and down);
    an adapter loaded at run time reaches every rank."""
    base = Path(model_dirs[model])
    write_adapter(tmp_path / "a", base, seed=8, std=0.3)
    write_adapter(tmp_path / "b", base, seed=9, rank=4, std=0.3)
    loras = ["a", None, "b"]
    results = []
    for tp in (1, 2):
        with LLM(
            str(base), tensor_parallel_size=tp, num_threads=2, device="cpu", max_loras=2,
            lora_modules=(LoRAModule("a", str(tmp_path / "a")),),
        ) as llm:  # fmt: skip
            engine = llm.engine
            b = engine.runner.read_lora("b", str(tmp_path / "b"))
            (tmp_path / "b" / "adapter_model.safetensors").rename(tmp_path / "b.safetensors")
            engine.loras.load(b)  # the other ranks take rank 0's tensors, not the folder's
            (tmp_path / "b.safetensors").rename(tmp_path / "b" / "adapter_model.safetensors")
            results.append(llm.generate(PROMPTS, GREEDY, lora=loras))
    _same(results[1], results[0])
