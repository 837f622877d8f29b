"""A model's generation_config.json gives the default sampling parameters of requests that
leave them out, as vLLM's ``--generation-config auto`` does; ``vllm`` ignores the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conveyor.runtime.engine.sampling_defaults import sampling_defaults

QWEN25_INSTRUCT = {
    "bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
    "pad_token_id": 151643, "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8,
    "top_k": 20, "transformers_version": "4.37.0",
}  # fmt: skip
"""Qwen2.5-0.5B-Instruct's generation_config.json."""


def write(folder: Path, values: dict) -> Path:
    folder.mkdir(exist_ok=True)
    path = folder / "generation_config.json"
    path.write_text(json.dumps(values))
    return path


def test_the_models_recommended_sampling_is_the_default(tmp_path):
    path = write(tmp_path, QWEN25_INSTRUCT)
    assert sampling_defaults("auto", path) == {
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
    }  # fmt: skip
    assert sampling_defaults("vllm", path) == {}
    assert sampling_defaults("auto", None) == {}  # a GGUF
    assert sampling_defaults("auto", tmp_path / "absent.json") == {}


def test_max_new_tokens_is_the_default_max_tokens_and_top_k_0_is_off(tmp_path):
    path = write(tmp_path, {"max_new_tokens": 64, "top_k": 0, "min_p": 0.05})
    assert sampling_defaults("auto", path) == {"max_tokens": 64, "top_k": -1, "min_p": 0.05}


def test_a_folder_given_replaces_the_models_file(tmp_path):
    model_file = write(tmp_path / "model", QWEN25_INSTRUCT)
    write(tmp_path / "mine", {"temperature": 0.0})
    assert sampling_defaults(str(tmp_path / "mine"), model_file) == {"temperature": 0.0}


@pytest.mark.parametrize(
    ("folder_has", "message"),
    [
        (None, "there is no .*generation_config.json; give a folder"),
        ("{not json", "cannot be read as a generation config"),
        ('{"top_p": 1.5}', "sets a default sampling parameter Conveyor refuses: top_p"),
    ],
)
def test_a_bad_generation_config_says_what_to_do(tmp_path, folder_has, message):
    if folder_has is not None:
        (tmp_path / "generation_config.json").write_text(folder_has)
    with pytest.raises(ValueError, match=message) as err:
        sampling_defaults(str(tmp_path), None)
    assert "--generation-config" in str(err.value) or "give a folder" in str(err.value)
