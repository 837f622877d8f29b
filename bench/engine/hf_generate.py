"""Hugging Face ``generate`` on padded static batches: ``conveyor bench offline``'s baseline."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from conveyor.bench.engine.results import ModeResult, summarise


def run_hf(model_path: str, requests, batch_size: int, device: str, threads: int) -> ModeResult:
    """Hugging Face ``generate`` on padded static batches: the baseline users know."""
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    torch.set_num_threads(threads)
    dev = torch.device(
        "cuda"
        if device == "auto" and torch.cuda.is_available()
        else ("cpu" if device == "auto" else device)
    )
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    path = Path(model_path)
    source: dict[str, Any]
    if path.suffix.lower() == ".gguf":  # transformers dequantizes the same file itself
        source = {"pretrained_model_name_or_path": path.parent, "gguf_file": path.name}
    else:
        source = {"pretrained_model_name_or_path": path}
    model = AutoModelForCausalLM.from_pretrained(**source, dtype=dtype)
    # transformers types ``to`` through a decorator that mypy reads as taking the model
    model = model.to(dev).eval()  # type: ignore[arg-type]
    pad = model.generation_config.pad_token_id or 0

    class FirstToken(LogitsProcessor):
        def __init__(self) -> None:
            self.at: float | None = None

        def __call__(self, input_ids, scores):
            if self.at is None:
                self.at = time.monotonic()
            return scores

    start = time.monotonic()
    ttfts, tpots, tokens, batches = [], [], 0, 0
    for b in range(0, len(requests), batch_size):
        batch = requests[b : b + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch], device=dev)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=dev)
        longest = max(n for _, n in batch)
        first = FirstToken()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad,
                logits_processor=LogitsProcessorList([first]),
            )
        end = time.monotonic()
        assert first.at is not None, "generate made no token"
        for _, n in batch:
            ttfts.append(first.at - start)
            tpots.append((end - first.at) / max(1, longest - 1))
            tokens += n  # only the tokens the request asked for are useful
        batches += 1
    duration = time.monotonic() - start
    return summarise(
        "hf-generate",
        duration,
        len(requests),
        tokens,
        ttfts,
        tpots,
        mean_running=float(batch_size),
        max_running=batch_size,
        occupancy_while_waiting=None,
        preemptions=0,
        prefix_cache_hit_rate=0.0,
        steps=batches,
    )
