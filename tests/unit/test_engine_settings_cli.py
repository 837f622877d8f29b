"""The engine's flags and its settings: every field comes from the command line."""

from __future__ import annotations

import argparse
import dataclasses

from conveyor.runtime.engine.settings import EngineSettings, LoRAModule


def _parse(*flags: str) -> EngineSettings:
    parser = argparse.ArgumentParser()
    EngineSettings.add_cli_args(parser)
    return EngineSettings.from_cli_args(parser.parse_args(list(flags)))


def test_no_flags_are_the_defaults():
    assert _parse() == EngineSettings()


def test_every_field_has_a_flag_that_sets_it():
    parsed = _parse(
        "--model", "m", "--tokenizer", "t", "--dtype", "bfloat16", "--load-format", "dummy",
        "--device", "cpu", "--seed", "7", "--max-running-requests", "3",
        "--chunked-prefill-size", "64", "--max-model-len", "99", "--block-size", "8",
        "--max-total-tokens", "1024", "--mem-fraction-static", "0.5",
        "--cpu-kv-cache-bytes", "1MiB", "--disable-prefix-caching", "--scheduler", "static",
        "--scheduling-policy", "priority", "--attention-backend", "torch", "--enforce-eager",
        "--piecewise-cuda-graph-max-tokens", "16", "--num-threads", "1",
        "--tensor-parallel-size", "2", "--generation-config", "vllm", "--lora-modules", "a=/x",
        "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "3", "--max-lora-rank", "4",
    )  # fmt: skip
    default = EngineSettings()
    same = [f.name for f in dataclasses.fields(EngineSettings)
            if getattr(parsed, f.name) == getattr(default, f.name)]  # fmt: skip
    assert same == []
    assert parsed.lora_modules == (LoRAModule("a", "/x"),)
    assert parsed.enable_prefix_caching is False and parsed.cpu_kv_cache_bytes == 1 << 20
