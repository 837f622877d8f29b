"""A model directory's tokenizer: loaded directly where AutoTokenizer would load the same."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.runtime.model.builtin import builtin_model_path
from conveyor.runtime.model.loader import (
    AUTO_TOKENIZER_KEEPS_BACKEND,
    ModelFiles,
    _declares_tokenizers_backend,
    load_tokenizer,
)
from conveyor.runtime.model.shape import SUPPORTED_MODEL_TYPES

TEXTS = ["Hello, world!", "Ünïcödé ☃ and 2024 digits", "<|im_start|>user\nHi<|im_end|>", ""]


def test_the_model_types_are_those_auto_tokenizer_keeps_the_backend_for():
    from transformers.models.auto.tokenization_auto import (
        MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
        TOKENIZER_MAPPING_NAMES,
    )

    assert set(AUTO_TOKENIZER_KEEPS_BACKEND) == {
        t
        for t in SUPPORTED_MODEL_TYPES
        if t not in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
        and TOKENIZER_MAPPING_NAMES.get(t) != "MistralCommonBackend"
    }


@pytest.mark.parametrize("model", ["conveyor-tiny", "qwen2", "qwen3"])
def test_the_tokenizer_is_the_one_auto_tokenizer_loads(model_dirs, model):
    from transformers import AutoTokenizer

    path = Path(model_dirs[model])
    assert _declares_tokenizers_backend(path) == (model != "qwen2")
    ours, theirs = load_tokenizer(ModelFiles(path)), AutoTokenizer.from_pretrained(path)
    assert type(ours) is type(theirs)
    assert repr(ours.init_kwargs) == repr(theirs.init_kwargs)
    assert ours.all_special_ids == theirs.all_special_ids
    assert (ours.eos_token_id, ours.pad_token_id) == (theirs.eos_token_id, theirs.pad_token_id)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        ids = ours.encode(text)
        assert ours.decode(ids) == theirs.decode(ids)
    chat = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == (
        theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    )


@pytest.mark.parametrize(
    "change",
    [
        {"tokenizer_class": "Qwen2Tokenizer"},
        {"auto_map": {"AutoTokenizer": [None, "tok.MyTokenizer"]}},
    ],
)
def test_any_other_tokenizer_goes_through_auto_tokenizer(tmp_path, model_dirs, change):
    source = Path(model_dirs["conveyor-tiny"])
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    declared = json.loads((source / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**declared, **change}))
    assert not _declares_tokenizers_backend(tmp_path)


def test_loading_the_tiny_model_imports_no_transformers_config_class():
    """AutoTokenizer reads the model's config with transformers' classes, whose imports
    (torch.distributed.tensor, sympy) were seconds of a replica's start."""
    code = (
        "import sys\n"
        "from conveyor.runtime.model.loader import load_config, load_tokenizer, open_model\n"
        "files = open_model('conveyor-tiny')\n"
        "load_config(files), load_tokenizer(files)\n"
        "loaded = [m for m in ('sympy', 'transformers.configuration_utils') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    builtin_model_path()  # generated here, not in the child
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("vocab_size", [320, 322])
def test_the_generated_tokenizer_files_are_those_transformers_writes(tmp_path, vocab_size):
    """conveyor-tiny's tokenizer is written with the tokenizers library alone (importing
    transformers for it was most of a pod's start-up); the files must be exactly those
    ``save_pretrained`` writes for the same tokenizer, which loaders (ours, transformers',
    vLLM's) read."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from conveyor.runtime.model.builtin import CHAT_TEMPLATE, TINY_CONFIG, _write_tokenizer

    config = dict(TINY_CONFIG, vocab_size=vocab_size)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir()
    _write_tokenizer(ours, config)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_file(str(ours / "tokenizer.json")),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=config["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(theirs)
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    for path in ours.iterdir():
        assert path.read_bytes() == (theirs / path.name).read_bytes(), path.name
