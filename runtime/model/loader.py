"""Find a model, read its config and tokenizer, build it and load its weights.

The built-in models, a local directory, a GGUF file and a hub id all end up as
``ModelFiles``: a directory of Hugging Face files, or one GGUF file opened once.
The config, tokenizer and weights come from whichever it is; everything after
that is one code path.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from conveyor.runtime.layers.attention import AttentionBackend
from conveyor.runtime.layers.parallel import SINGLE, Shard, TensorParallel
from conveyor.runtime.model.builtin import BUILTIN_MODELS, builtin_model_path
from conveyor.runtime.model.config import ModelConfig, transformers_values
from conveyor.runtime.model.gguf import GGUFModel, find_gguf, is_gguf
from conveyor.runtime.model.llama import LlamaForCausalLM

log = logging.getLogger("conveyor.runtime")

LOAD_TIMES: dict[str, float] = {}
"""Seconds this process spent in each loading step: resolve, config, tokenizer, weights (the
server's start-up line reports them; whoever reads them clears them first)."""


@contextlib.contextmanager
def _timed(step: str) -> Iterator[None]:
    started = time.monotonic()
    try:
        yield
    finally:
        LOAD_TIMES[step] = LOAD_TIMES.get(step, 0.0) + time.monotonic() - started


@dataclass(frozen=True)
class ModelFiles:
    """Where a model comes from: a Hugging Face directory, or one GGUF file (opened once)."""

    path: Path
    """The directory, or the ``.gguf`` file."""

    gguf: GGUFModel | None = None

    @property
    def generation_config(self) -> Path | None:
        """generation_config.json of a Hugging Face directory (a GGUF carries its EOS id)."""
        return None if self.gguf is not None else self.path / "generation_config.json"


def open_model(model: str) -> ModelFiles:
    """Resolve ``model`` (see ``resolve_model_path``) and open it: a GGUF is read and checked."""
    with _timed("resolve"):
        path = resolve_model_path(model)
        return ModelFiles(path, GGUFModel(path) if is_gguf(path) else None)


def resolve_model_path(model: str) -> Path:
    """A built-in name -> its cached files; a ``.gguf`` file -> itself; a directory -> itself,
    or its one ``.gguf`` when it has no config.json; a hub id -> the local hub cache
    (downloaded first unless ``HF_HUB_OFFLINE=1``)."""
    if model in BUILTIN_MODELS:
        return builtin_model_path(model)
    path = Path(model).expanduser()
    if path.is_file():
        if not is_gguf(path):
            raise ValueError(
                f"model {model!r} is a file but not a .gguf; pass a GGUF file or a directory of "
                "Hugging Face files (config.json, *.safetensors, tokenizer)"
            )
        return path
    if path.is_dir():
        if (path / "config.json").exists():
            return path
        if gguf_file := find_gguf(path):
            return gguf_file
        raise ValueError(
            f"model directory {str(path)!r} has neither a config.json nor a .gguf file"
        )
    if path.is_absolute() or model.startswith(".") or path.suffix.lower() == ".gguf":
        raise ValueError(f"model {model!r} does not exist")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
    try:
        return Path(snapshot_download(model, allow_patterns=patterns, local_files_only=True))
    except Exception as cached_miss:  # not in the local cache: try the hub, if allowed
        if os.environ.get("HF_HUB_OFFLINE") == "1":
            raise ValueError(
                f"model {model!r} is not a directory, a built-in model ({', '.join(BUILTIN_MODELS)}) "
                "or a hub id in the local cache, and HF_HUB_OFFLINE=1 forbids downloading it"
            ) from cached_miss
    try:
        return Path(snapshot_download(model, allow_patterns=patterns))
    except Exception as exc:
        raise ValueError(
            f"model {model!r} is not a directory, a built-in model ({', '.join(BUILTIN_MODELS)}), "
            f"or a hub id that could be downloaded ({type(exc).__name__}: {exc})"
        ) from exc


def _refuse_quantized(values: dict) -> None:
    """A checkpoint of quantized weights (FP8, AWQ, GPTQ, bitsandbytes, compressed-tensors:
    a ``quantization_config`` in config.json, or in its text config) is refused before any
    weight is read, naming its method: Conveyor serves float weights and GGUF's types."""
    for where in (values, values.get("text_config") or {}):
        quant = where.get("quantization_config") if isinstance(where, dict) else None
        if quant:
            method = quant.get("quant_method", "unnamed") if isinstance(quant, dict) else quant
            raise ValueError(
                f"the checkpoint's weights are quantized (quantization_config: {method}); "
                "Conveyor serves float16, bfloat16 or float32 checkpoints and GGUF files: use "
                "the model's unquantized release, or a GGUF of it"
            )


def load_config(files: ModelFiles):
    """The model's config: Conveyor's own (``config.py``: no transformers import) where it
    models the config, transformers' where it does not."""
    with _timed("config"):
        if files.gguf is not None:
            return files.gguf.config()
        values = json.loads((files.path / "config.json").read_text())
        _refuse_quantized(values)
        config: Any = ModelConfig.from_values(values)  # or transformers' config, below
        if config is None:
            from transformers import AutoConfig

            readable = transformers_values(values)
            if readable is values:
                config = AutoConfig.from_pretrained(files.path)
            else:  # what from_pretrained reads, with what its class cannot derive spelled out
                config = AutoConfig.for_model(**readable)
            if values.get("model_type") in TEXT_OF_MULTIMODAL:
                log.info(
                    "%s is an image-text model: serving its text model (requests with images "
                    "are refused)",
                    values["model_type"],
                )
                # transformers ties the head by the whole model's config, not the text one's
                tied = getattr(config, "tie_word_embeddings", False)
                config = config.text_config
                config.tie_word_embeddings = tied
                if config.model_type in TEXT_MODEL_TYPES:
                    config.model_type = TEXT_MODEL_TYPES[config.model_type]
        if getattr(config, "tie_word_embeddings", False) and _holds_its_own_head(files):
            log.warning(
                "config.json ties the LM head to the embedding, but the checkpoint holds an "
                "lm_head.weight of other values: serving that head, as transformers does "
                "(set tie_word_embeddings to false to silence this)"
            )
            config.tie_word_embeddings = False
        return config


def _holds_its_own_head(files: ModelFiles) -> bool:
    """Whether the safetensors hold an ``lm_head.weight`` that differs from the embedding.
    transformers 5 then reads the config's ``tie_word_embeddings`` as wrong and loads the
    head untied (``PreTrainedModel.tie_weights``); an equal copy (as some checkpoints save
    beside the embedding) is tied. Only the files' headers are read unless both are there."""
    from safetensors import safe_open

    rename = checkpoint_names(files)
    found: dict[str, tuple[str, str]] = {}
    paths = sorted(glob.glob(str(files.path / "*.safetensors")))
    for file in paths:
        with safe_open(file, framework="pt", device="cpu") as f:
            for stored in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                name = rename(stored)
                if name in ("lm_head.weight", "model.embed_tokens.weight"):
                    found[name] = (file, stored)
    if len(found) < 2:
        return False
    head, embed = (
        _read_tensor(*found[name]) for name in ("lm_head.weight", "model.embed_tokens.weight")
    )
    return not torch.equal(head, embed)


def _read_tensor(file: str, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(file, framework="pt", device="cpu") as f:
        return f.get_tensor(name)


_LLAVA_NAMES = (
    ("language_model.model.", "model."),  # as Google's and Mistral's checkpoints name them
    ("model.language_model.", "model."),  # as transformers >= 4.52 saves them
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.", None),
    ("vision_tower.", None),
    ("model.multi_modal_projector.", None),
    ("multi_modal_projector.", None),
)
_QWEN_VL_NAMES = (
    ("model.language_model.", "model."),  # as transformers >= 4.52 saves them
    ("model.visual.", None),
    ("visual.", None),  # Qwen's own checkpoints: the text model's names are already a Qwen2's
)
TEXT_OF_MULTIMODAL = {
    "gemma3": _LLAVA_NAMES,
    "mistral3": _LLAVA_NAMES,
    "qwen2_vl": _QWEN_VL_NAMES,
    "qwen2_5_vl": _QWEN_VL_NAMES,
    "qwen3_vl": _QWEN_VL_NAMES,
}
"""Image-text model types whose text model Conveyor serves (Gemma 3 4B-27B: a Gemma 3 text
decoder beside a SigLIP image tower; Mistral 3, as Mistral Small 3.1 and 3.2: a Mistral text
decoder beside a Pixtral image tower; Qwen2-VL, Qwen2.5-VL and the dense Qwen3-VL: a Qwen2 or
Qwen3 text decoder beside a ViT), with their checkpoint's name prefixes -> the text model's
(None: the image part's, not read)."""

TEXT_MODEL_TYPES = {"qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3"}
"""Text models of image-text checkpoints that are, for text, another model type: Qwen-VL's
multimodal rope (``mrope_section``) gives a text token the same position in each of its
sections, which is the plain rope of that position, so text alone runs as Qwen2 or Qwen3."""


GLM4_NORMS = {
    "post_self_attn_layernorm": "post_attention_layernorm",
    "post_attention_layernorm": "pre_feedforward_layernorm",
    "post_mlp_layernorm": "post_feedforward_layernorm",
}
"""GLM-4-0414's sandwich norms -> Gemma 2's names for the same places (``llama.py``): the
attention's output norm, the MLP's input norm (which GLM calls post_attention_layernorm, as
Llama does), the MLP's output norm."""
_GLM4_NORM = re.compile(r"\.(" + "|".join(GLM4_NORMS) + r")\.")


def checkpoint_names(files: ModelFiles) -> Callable[[str], str | None]:
    """Checkpoint tensor name -> the decoder's name for it (None: not the decoder's): the
    names themselves, but for the text model of an image-text checkpoint and GLM-4-0414's
    norms (``GLM4_NORMS``)."""
    config = files.path / "config.json"
    kind = json.loads(config.read_text()).get("model_type") if files.gguf is None else None
    if kind == "glm4":
        return lambda name: _GLM4_NORM.sub(lambda m: f".{GLM4_NORMS[m.group(1)]}.", name)
    prefixes = TEXT_OF_MULTIMODAL.get(kind or "")
    if prefixes is None:
        return lambda name: name

    def rename(name: str) -> str | None:
        for old, new in prefixes:
            if name.startswith(old):
                return None if new is None else new + name.removeprefix(old)
        return name

    return rename


def load_tokenizer(files: ModelFiles):
    with _timed("tokenizer"):
        if files.gguf is not None:
            return files.gguf.tokenizer()
        if _declares_tokenizers_backend(files.path):
            from transformers import TokenizersBackend

            return TokenizersBackend.from_pretrained(files.path)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(files.path)


AUTO_TOKENIZER_KEEPS_BACKEND = (
    "llama", "mistral", "qwen3", "gemma", "gemma2", "gemma3_text", "mixtral", "qwen2_moe",
    "qwen3_moe", "granite", "granitemoe", "smollm3", "olmo2", "olmo3", "exaone4", "seed_oss",
    "glm", "glm4", "ministral", "ministral3", "helium",
)  # fmt: skip
"""Model types for which ``AutoTokenizer`` loads a tokenizer_config.json's
``TokenizersBackend`` as that class (transformers 5; for Qwen2 it substitutes
``Qwen2Tokenizer``). tests/engine/test_tokenizer_loading.py checks this against
transformers' own tables, which cost most of a second to import."""


def _declares_tokenizers_backend(path: Path) -> bool:
    """Whether ``AutoTokenizer`` would load ``path``'s tokenizer as the plain
    ``TokenizersBackend`` it names (as conveyor-tiny does) with no code of its own. Loading
    it directly skips ``AutoTokenizer``'s reading of the model's config with transformers'
    config classes (torch.distributed.tensor and sympy: 2-3 s of a start)."""
    try:
        declared = json.loads((path / "tokenizer_config.json").read_text())
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return False
    return (
        declared.get("tokenizer_class") == "TokenizersBackend"
        and "auto_map" not in declared
        and model_type in AUTO_TOKENIZER_KEEPS_BACKEND
        and (path / "tokenizer.json").is_file()
    )


def config_dtype(config) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype


@_timed("weights")
def build_model(
    config,
    files: ModelFiles,
    *,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str,
    seed: int,
    tp: TensorParallel = SINGLE,
    on_progress: Callable[[str], None] | None = None,
    context: int | None = None,
) -> LlamaForCausalLM:
    """Build the model directly on ``device`` in ``dtype`` and fill its weights; under tensor
    parallelism, this rank's part of the model, reading only its shard of each tensor.
    ``context``: the served ``--max-model-len`` (None: the model's), which picks a LongRoPE
    model's factors (``layers/rotary.py``)."""
    progress = on_progress or log.info
    started = time.monotonic()
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), _no_init():
            model = LlamaForCausalLM(config, backend, tp, context)
    finally:
        torch.set_default_dtype(default_dtype)
    # The rotary tables stay float32 (cast per step), as in the reference.
    model.rotaries.float()
    if load_format == "dummy":
        g = torch.Generator(device=device).manual_seed(seed + tp.rank)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.uniform_(-0.05, 0.05, generator=g)
        progress(
            f"built {config.model_type} with dummy weights in {time.monotonic() - started:.1f}s"
        )
    elif files.gguf is not None:
        with torch.no_grad():
            model.load_weights(files.gguf.weights(dtype, progress, model.weight_shard))
        progress(f"loaded {files.path.name} in {time.monotonic() - started:.1f}s")
    else:
        weights = sorted(glob.glob(str(files.path / "*.safetensors")))
        if not weights:
            raise ValueError(
                f"no *.safetensors files in {str(files.path)!r}; convert the checkpoint or use "
                "--load-format dummy"
            )
        with torch.no_grad():
            model.load_weights(
                _iter_safetensors(
                    weights, device, progress, model.weight_shard, checkpoint_names(files)
                )
            )
        progress(f"loaded {len(weights)} weight file(s) in {time.monotonic() - started:.1f}s")
    model.eval()
    return model


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """Build linear layers without their random initialisation (1.5 s of SmolLM2's start-up,
    with the embedding, which ``VocabParallelEmbedding`` leaves uninitialised too): every
    weight is overwritten right after, by the checkpoint (which must set all of them) or by
    the dummy fill."""
    saved = nn.Linear.reset_parameters

    def skip(self: nn.Module) -> None:
        """No initialisation: the checkpoint or the dummy fill sets every weight."""

    # Replacing a method on the class is the point here, which mypy flags as such.
    nn.Linear.reset_parameters = skip  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Linear.reset_parameters = saved  # type: ignore[method-assign]


def _iter_safetensors(
    files: list[str],
    device: torch.device,
    progress: Callable[[str], None],
    shard_of: Callable[[str], Shard | None],
    rename: Callable[[str], str | None],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor the decoder reads, under the decoder's name for it (``rename``; None: not
    read), whole or only the shard of it ``shard_of`` names (read from the memory map alone)."""
    from safetensors import safe_open

    for i, file in enumerate(files, 1):
        progress(f"loading weights {i}/{len(files)}: {os.path.basename(file)}")
        with safe_open(
            file, framework="pt", device=str(device) if device.type == "cuda" else "cpu"
        ) as f:
            for stored in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if (name := rename(stored)) is None:
                    continue
                shard = shard_of(name)
                if shard is None:
                    yield name, f.get_tensor(stored)
                    continue
                part = f.get_slice(stored)
                if shard.zero:
                    yield name, torch.zeros(part.get_shape())
                    continue
                index = [slice(None)] * shard.dim + [slice(shard.start, shard.start + shard.size)]
                yield name, part[tuple(index)]
