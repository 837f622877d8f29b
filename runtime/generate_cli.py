"""``conveyor generate``: generate text for a few prompts on a model, offline (no server)."""

from __future__ import annotations

import argparse
import sys

from conveyor.runtime.engine.settings import EngineSettings
from conveyor.runtime.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="conveyor generate", description=__doc__)
    parser.add_argument("prompts", nargs="+", help="prompts to complete")
    parser.add_argument(
        "--max-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default)"
    )
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling mass, 0-1 (default 1: off)"
    )
    parser.add_argument(
        "--sampling-seed",
        type=int,
        default=None,
        help="seed of the sampling generator, for repeatable sampled output (default: none)",
    )
    EngineSettings.add_cli_args(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        settings = EngineSettings.from_cli_args(args)
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.sampling_seed,
        )
    except ValueError as exc:
        parser.error(str(exc))
    from conveyor.runtime.engine.llm import LLM

    llm = LLM.from_settings(settings)
    try:
        results = llm.generate(args.prompts, params)
    except ValueError as exc:
        print(f"conveyor generate: {exc}", file=sys.stderr)
        return 2
    for prompt, r in zip(args.prompts, results, strict=True):
        ttft = "none" if r.ttft is None else f"{r.ttft * 1000:.1f} ms"
        print(f"--- {prompt!r} -> {len(r.token_ids)} tokens, finish {r.finish_reason}, TTFT {ttft}")
        print(r.text)
    return 0
