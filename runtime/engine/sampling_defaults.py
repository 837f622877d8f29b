"""A model's own default sampling parameters, from its ``generation_config.json``.

Model authors put their recommended sampling there (Qwen2.5-Instruct: temperature 0.7,
top_p 0.8, top_k 20, repetition_penalty 1.05). vLLM applies them by default
(``--generation-config auto``) to every request that leaves them out, and so does Conveyor:
``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, and
``max_new_tokens`` as the default ``max_tokens``. A request's own value always wins.
``--generation-config vllm`` ignores the file (the OpenAI defaults apply); a folder instead
takes its ``generation_config.json``.

The file is read with transformers' ``GenerationConfig``, as vLLM reads it, and only the
values it sets count (``to_diff_dict``); ``do_sample`` is not read (a request samples unless
its temperature is 0).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conveyor.runtime.sampling_params import SamplingParams

GENERATION_CONFIG_CHOICES = ("auto", "vllm")
"""``--generation-config``'s keywords; anything else names a folder."""

FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
"""generation_config.json's name -> ``SamplingParams``' name."""


def sampling_defaults(source: str, model_file: Path | None) -> dict[str, Any]:
    """The defaults ``source`` (``auto``: ``model_file``, the model's generation_config.json
    where it has one; ``vllm``: none; else a folder) sets, under ``SamplingParams``' names.
    ValueError, saying what to do, for a folder without the file or a value out of range."""
    if source == "vllm":
        return {}
    if source == "auto":
        if model_file is None or not model_file.is_file():
            return {}
        path = model_file
    else:
        path = Path(source) / "generation_config.json"
        if not path.is_file():
            raise ValueError(
                f"--generation-config {source!r}: there is no {path}; give a folder holding a "
                "generation_config.json, 'auto' (the model's own) or 'vllm' (none)"
            )
    from transformers import GenerationConfig

    try:
        given = GenerationConfig.from_pretrained(path.parent, path.name).to_diff_dict()
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"{path} cannot be read as a generation config ({exc}); fix it, or pass "
            "--generation-config vllm to ignore it"
        ) from None
    defaults = {
        ours: given[theirs] for theirs, ours in FIELDS.items() if given.get(theirs) is not None
    }
    if defaults.get("top_k") == 0:
        defaults["top_k"] = -1  # transformers' "no top-k"
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"{path} sets a default sampling parameter Conveyor refuses: {exc}; fix it, or pass "
            "--generation-config vllm to ignore the file"
        ) from None
    return defaults
