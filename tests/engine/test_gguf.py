"""GGUF loading: files written from the project's own small models, in each type the loader
dequantizes, reproduce transformers token for token, and bad files are refused at start.

An F32 (or F16, BF16, Q8_0) file of a model has the same greedy output as the directory it came
from; for every type the output equals transformers reading the same file (``gguf_file=``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gguf_files import write_gguf
from test_correctness import run_staggered, workload

from conveyor.runtime import SamplingParams
from conveyor.runtime.engine.llm_engine import LLMEngine
from conveyor.runtime.engine.settings import EngineSettings
from conveyor.runtime.model.gguf import GGUFError, GGUFModel, _reader
from conveyor.runtime.model.loader import open_model, resolve_model_path

QTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
LOSSLESS = {"F32"}  # the very weights of the directory the file was written from


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


def gguf_of(gguf_dir: Path, model_dirs, model: str, qtype: str) -> Path:
    folder = gguf_dir / f"{model}-{qtype}"
    path = folder / f"{model}-{qtype}.gguf"
    if not path.exists():
        folder.mkdir(exist_ok=True)
        write_gguf(model_dirs[model], path, qtype)
    return path


def engine_on(path: Path | str, **settings) -> LLMEngine:
    settings.setdefault("max_total_tokens", 4096)
    settings.setdefault("num_threads", 1)
    return LLMEngine(EngineSettings(model=str(path), device="cpu", **settings))


def greedy(engine: LLMEngine, requests) -> dict[str, list[int]]:
    return run_staggered(engine, requests, [0] * len(requests), ignore_eos=True)


class GGUFReference:
    """transformers' ``generate`` on a GGUF file it dequantizes itself, EOS stopping off."""

    def __init__(self) -> None:
        self._models: dict[Path, object] = {}

    def greedy(self, path: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
        import torch
        from transformers import AutoModelForCausalLM

        if path not in self._models:
            model = AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32
            ).eval()
            model.generation_config.eos_token_id = None  # run to max_new_tokens, as ours does
            model.generation_config.pad_token_id = None
            self._models[path] = model
        model = self._models[path]
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                do_sample=False,
            )  # fmt: skip
        return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def gguf_reference() -> GGUFReference:
    return GGUFReference()


@pytest.mark.parametrize("qtype", QTYPES)
def test_each_type_matches_transformers_on_the_same_file(
    gguf_dir, model_dirs, reference, gguf_reference, qtype
):
    path = gguf_of(gguf_dir, model_dirs, "conveyor-tiny", qtype)
    engine = engine_on(path, max_running_requests=4, chunked_prefill_size=32)
    requests = workload(6, seed=11)
    outputs = greedy(engine, requests)
    for i, (prompt, max_tokens) in enumerate(requests):
        assert outputs[f"r{i}"] == gguf_reference.greedy(path, prompt, max_tokens), (qtype, i)
        if qtype in LOSSLESS:  # and the same as the directory the file was written from
            assert outputs[f"r{i}"] == reference.greedy(
                model_dirs["conveyor-tiny"], prompt, max_tokens
            )


@pytest.mark.parametrize("model", ["qwen2", "qwen3"])
def test_other_architectures_match_their_directory(gguf_dir, model_dirs, reference, model):
    """qwen2 (q/k/v biases, no permutation) and qwen3 (q/k norms, tied head) GGUFs."""
    path = gguf_of(gguf_dir, model_dirs, model, "F32")
    engine = engine_on(path, max_running_requests=4, chunked_prefill_size=16)
    requests = workload(5, seed=12)
    outputs = greedy(engine, requests)  # EOS ignored: the reference's tokens, then more
    stops = set(engine.state.eos_token_ids)
    for i, (prompt, max_tokens) in enumerate(requests):
        expected = reference.greedy(model_dirs[model], prompt, max_tokens)
        assert outputs[f"r{i}"][: len(expected)] == expected
        assert len(expected) == max_tokens or expected[-1] in stops


def test_config_and_tokenizer_come_from_the_metadata(gguf_dir, model_dirs):
    from transformers import AutoConfig, AutoTokenizer

    path = gguf_of(gguf_dir, model_dirs, "conveyor-tiny", "Q8_0")
    files = open_model(str(path))
    config = files.gguf.config()
    want = AutoConfig.from_pretrained(model_dirs["conveyor-tiny"])
    for key in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size",
        "tie_word_embeddings",
    ):  # fmt: skip
        assert getattr(config, key) == getattr(want, key), key
    # the EOS, and the end of turn the writer gave the directory's other stop id (llama.cpp's
    # generation ends on either, as generate ends on generation_config.json's list)
    generation = json.loads(
        (Path(model_dirs["conveyor-tiny"]) / "generation_config.json").read_text()
    )
    assert config.eos_token_id == generation["eos_token_id"] != want.eos_token_id
    assert config.rope_parameters["rope_theta"] == want.rope_parameters["rope_theta"]
    assert config.rms_norm_eps == pytest.approx(want.rms_norm_eps)

    tok, hf = files.gguf.tokenizer(), AutoTokenizer.from_pretrained(model_dirs["conveyor-tiny"])
    for text in ["Hello, world!", "Ünïcödé ☃ and 2024 digits", "<|im_start|>user\nHi<|im_end|>"]:
        assert tok.encode(text) == hf.encode(text), text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    chat = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == (
        hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    )
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def test_a_directory_with_one_gguf_is_that_file(gguf_dir, model_dirs, tmp_path):
    path = gguf_of(gguf_dir, model_dirs, "conveyor-tiny", "F16")
    assert resolve_model_path(str(path.parent)) == path
    shutil.copy(path, tmp_path / "a.gguf")
    shutil.copy(path, tmp_path / "b.gguf")
    with pytest.raises(ValueError, match="2 GGUF files"):
        resolve_model_path(str(tmp_path))


# ---- refusals: each a clear message at start-up, no traceback ----------------------------


def refused(path: Path) -> str:
    with pytest.raises(GGUFError) as caught:
        GGUFModel(path)
    return str(caught.value)


def test_refuses_another_architecture(gguf_dir, model_dirs, tmp_path):
    path = write_gguf(model_dirs["conveyor-tiny"], tmp_path / "gpt2.gguf", architecture="gpt2")
    message = refused(path)
    assert "'gpt2' model" in message and "llama, mistral, qwen2, qwen3" in message


def test_refuses_smollm3_and_names_its_hugging_face_files(model_dirs, tmp_path):
    """SmolLM3 is served from its Hugging Face files, whose config says which layers skip
    the rope (``no_rope_layers``); its GGUFs are refused with a pointer to them, not run as
    a Llama that turns every layer."""
    path = write_gguf(model_dirs["conveyor-tiny"], tmp_path / "s.gguf", architecture="smollm3")
    message = refused(path)
    assert "'smollm3' model" in message and "Hugging Face checkpoint" in message


def test_refuses_a_mixture_of_experts(model_dirs, tmp_path):
    path = write_gguf(model_dirs["conveyor-tiny"], tmp_path / "mixtral.gguf", experts=8)
    assert "mixture-of-experts GGUF (8 experts)" in refused(path)


def test_refuses_an_unsupported_tensor_type(model_dirs, tmp_path):
    path = write_gguf(
        model_dirs["conveyor-tiny"], tmp_path / "iq4.gguf",
        raw_types={"blk.0.ffn_up.weight": "IQ4_NL"},
    )  # fmt: skip
    message = refused(path)
    assert "IQ4_NL" in message and "blk.0.ffn_up.weight" in message and "Q4_1" in message


@pytest.mark.parametrize("keep", [0.5, 0.0001])
def test_refuses_a_truncated_file(gguf_dir, model_dirs, tmp_path, keep):
    whole = gguf_of(gguf_dir, model_dirs, "conveyor-tiny", "Q4_0").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(whole[: int(len(whole) * keep)])
    assert "truncated" in refused(path)


def test_serve_exits_with_the_message_and_no_traceback(model_dirs, tmp_path):
    path = write_gguf(model_dirs["conveyor-tiny"], tmp_path / "gpt2.gguf", architecture="gpt2")
    proc = subprocess.run(
        [sys.executable, "-m", "conveyor", "serve", "--model", str(path), "--port", "0",
         "--num-threads", "1"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "cannot start the engine" in proc.stderr and "'gpt2' model" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_dtype_is_chosen_at_load(gguf_dir, model_dirs):
    import torch

    path = gguf_of(gguf_dir, model_dirs, "conveyor-tiny", "Q4_1")
    engine = engine_on(path, dtype="bfloat16")
    assert engine.runner.model.embed_tokens.weight.dtype == torch.bfloat16
    out = greedy(engine, [([1, 2, 3], 4)])
    assert len(out["r0"]) == 4


def test_sampling_params_reach_a_gguf_model(gguf_dir, model_dirs):
    path = gguf_of(gguf_dir, model_dirs, "conveyor-tiny", "Q8_0")
    engine = engine_on(path)
    engine.add_request("s", list(b"abc"), SamplingParams(max_tokens=5, temperature=0.8, seed=3))
    while engine.has_unfinished_requests():
        finished = [o for o in engine.step() if o.finished]
    assert len(finished[0].output_token_ids) == 5


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_fast_dequantizers_equal_the_gguf_packages(qtype):
    import gguf
    import numpy as np
    import torch

    from conveyor.runtime.model.ggml_quants import dequantize

    kind = gguf.GGMLQuantizationType[qtype]
    weights = np.random.default_rng(0).normal(0, 0.1, size=(48, 96)).astype(np.float32)
    weights[3, :32] = 0.0  # a block of zeros: scale 0
    raw = gguf.quants.quantize(weights, kind)
    want = gguf.quants.dequantize(raw, kind).reshape(48, 96).astype(np.float32)
    got = dequantize(raw, kind, (48, 96))
    assert got.dtype == torch.float32 and got.shape == (48, 96)
    assert torch.equal(got, torch.from_numpy(want))


@pytest.mark.parametrize("endian", ["LITTLE", "BIG"])
def test_metadata_reads_as_the_gguf_package_reads_it(tmp_path, endian):
    """The one-pass metadata reader gives every kind of value as the gguf package's fields do
    (a big-endian file is read by the package itself)."""
    import gguf
    import numpy as np

    path = tmp_path / f"{endian}.gguf"
    w = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian[endian])
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo <|im_end|>")
    w.add_array("t.strs", ["a", "", "ü é", "Ġthe"])
    w.add_array("t.ints", [3, 1, 4, 1, 5])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.bools", [True, False])
    w.add_uint32("general.alignment", 64)
    w.add_tensor("token_embd.weight", np.arange(64 * 3, dtype=np.float32).reshape(3, 64))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    model = GGUFModel.__new__(GGUFModel)  # the reader alone: this file is no model
    model.reader = gguf_reader = _reader(path)
    package = gguf.GGUFReader(path)
    keys = [k for k in package.fields if not k.startswith("GGUF.")]
    assert len(keys) == 18
    for key in keys:
        expected = package.fields[key].contents()
        got = model.field(key)
        assert got == expected and type(got) is type(expected), key
    assert (gguf_reader.metadata is None) == (endian == "BIG")
    assert gguf_reader.alignment == package.alignment == 64
    assert gguf_reader.data_offset == package.data_offset
    assert np.array_equal(gguf_reader.tensors[0].data, package.tensors[0].data)
