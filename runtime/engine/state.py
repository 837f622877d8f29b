"""Values derived at start-up (KV blocks, context length, EOS ids), kept apart from settings."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from conveyor.runtime.engine.settings import EngineSettings

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from conveyor.runtime.engine.model_runner import ModelRunner

log = logging.getLogger("conveyor.runtime")


@dataclass(frozen=True)
class EngineState:
    num_blocks: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    num_threads: int

    @classmethod
    def derive(
        cls,
        settings: EngineSettings,
        config: PretrainedConfig,
        tokenizer: PreTrainedTokenizerBase,
        generation_config: Path | None,
        runner: ModelRunner,
        threads: int,
    ) -> EngineState:
        """Size the KV cache for ``settings`` on ``runner``'s device; ValueError when the
        settings cannot fit the model or its cache."""
        model_limit = int(getattr(config, "max_position_embeddings", 0) or 4096)
        limit, why = _served_limit(config, model_limit)
        wanted = settings.max_model_len or _default_context(config, limit)
        if wanted > limit:
            raise ValueError(f"--max-model-len {wanted} exceeds {why} {limit}")
        num_blocks = runner.num_blocks_for_memory(wanted * settings.max_running_requests)
        capacity = num_blocks * settings.block_size
        if capacity < wanted:
            if settings.max_model_len is not None:
                raise ValueError(
                    f"the KV cache holds {capacity} tokens, fewer than --max-model-len {wanted}: "
                    "lower --max-model-len, or raise --max-total-tokens / the memory budget"
                )
            log.warning(
                "max model len clamped from %d to the KV cache's %d tokens", wanted, capacity
            )
            wanted = capacity
        return cls(
            num_blocks=num_blocks,
            max_model_len=wanted,
            eos_token_ids=_eos_ids(config, tokenizer, generation_config),
            num_threads=threads,
        )


def _served_limit(config: PretrainedConfig, model_limit: int) -> tuple[int, str]:
    """The longest context Conveyor serves the model with, and what sets it: the model's
    ``max_position_embeddings``, but Ministral 3's original context where its rope asks for
    Llama 4's query scale (``llama_4_scaling_beta``): ``1 + beta * log(1 + floor(position /
    original_max_position_embeddings))``, which is 1 before that position and which Conveyor's
    attention does not apply past it."""
    params = getattr(config, "rope_parameters", None) or {}
    original = params.get("original_max_position_embeddings")
    if params.get("llama_4_scaling_beta") and original and int(original) < model_limit:
        log.info(
            "contexts up to %d tokens: past its original_max_position_embeddings this model "
            "scales its queries by llama_4_scaling_beta, which Conveyor does not",
            int(original),
        )
        return int(original), (
            "the context Conveyor serves this model with (its original_max_position_embeddings, "
            "past which its llama_4_scaling_beta scales queries, which Conveyor does not do)"
        )
    return model_limit, "the model's max_position_embeddings"


def _default_context(config: PretrainedConfig, model_limit: int) -> int:
    """The context served when ``--max-model-len`` is not given: the model's own, but a
    LongRoPE model's original one (``original_max_position_embeddings``), as vLLM serves it:
    its short rope factors are the ones trained for short sequences (``layers/rotary.py``)."""
    from conveyor.runtime.layers.rotary import rope_type

    if rope_type(config) != "longrope":
        return model_limit
    params = getattr(config, "rope_parameters", None) or {}
    original = params.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None
    )
    if not original or int(original) >= model_limit:
        return model_limit
    log.info(
        "LongRoPE: max model len %d, the model's original context, as vLLM serves it; "
        "--max-model-len up to %d serves longer sequences with the long rope factors",
        int(original),
        model_limit,
    )
    return int(original)


def _eos_ids(
    config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, generation_config: Path | None
) -> tuple[int, ...]:
    """EOS ids from generation_config.json (what HF generate stops on), the config and tokenizer."""
    ids: list[int] = []

    def add(value: object) -> None:
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, list):
            ids.extend(v for v in value if isinstance(v, int))

    if generation_config is not None and generation_config.exists():
        add(json.loads(generation_config.read_text()).get("eos_token_id"))
    add(getattr(config, "eos_token_id", None))
    add(getattr(tokenizer, "eos_token_id", None))
    return tuple(dict.fromkeys(ids))
