"""Built-in models written for other engines (the LLMService model container of vLLM and
SGLang pods): SmolLM2's GGUF becomes a Hugging Face directory that transformers reads with the
same greedy tokens as Conveyor's engine on the GGUF itself; conveyor-tiny is linked as it is;
bad arguments are refused with a message before anything is written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.runtime import SamplingParams
from conveyor.runtime.engine.llm import LLM
from conveyor.runtime.model.builtin import builtin_model_path
from conveyor.runtime.model.export import main, write_builtin

SMOLLM2 = "smollm2-135m-instruct"


def test_smollm2_exported_gives_the_engines_tokens_in_transformers(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest = write_builtin(SMOLLM2, tmp_path / "builtin" / SMOLLM2)
    assert sorted(p.name for p in dest.iterdir() if p.suffix == ".json")[:1] == ["config.json"]
    assert (dest / "model.safetensors").exists() and (dest / "tokenizer.json").exists()
    assert not [p for p in dest.parent.iterdir() if p.name.startswith(".")]  # no leftovers
    tokenizer = AutoTokenizer.from_pretrained(dest)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    hf = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32)
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)[
        0, len(prompt) :
    ].tolist()

    with LLM(model=SMOLLM2, max_total_tokens=2048, num_threads=1) as llm:
        (result,) = llm.generate(
            [prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        )
    engine = result.token_ids
    eos = tokenizer.eos_token_id
    cut = out.index(eos) + 1 if eos in out else len(out)  # transformers stops at EOS
    assert len(out) >= 4 and out[:cut] == engine[:cut]
    # a second call finds the directory and writes nothing
    stamp = (dest / "model.safetensors").stat().st_mtime_ns
    assert write_builtin(SMOLLM2, dest) == dest
    assert (dest / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_directory_model_is_linked_not_copied(tmp_path: Path, capsys) -> None:
    dest = tmp_path / "conveyor-tiny"
    assert main(["conveyor-tiny", str(dest)]) == 0
    assert dest.is_symlink() and dest.resolve() == builtin_model_path("conveyor-tiny").resolve()
    assert f"at {dest}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["llama-70b", "DEST"], "invalid choice: 'llama-70b'"),
        ([SMOLLM2, "FILE"], "exists and is not a directory"),
        ([SMOLLM2, "DEST", "--dtype", "int3"], "invalid choice: 'int3'"),
    ],
)
def test_bad_arguments_are_refused_before_writing(
    tmp_path: Path, args: list[str], message: str
) -> None:
    (tmp_path / "FILE").write_text("not a model")
    argv = [
        a.replace("DEST", str(tmp_path / "out")).replace("FILE", str(tmp_path / "FILE"))
        for a in args
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "conveyor.runtime.model.export", *argv],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
