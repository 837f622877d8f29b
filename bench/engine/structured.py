"""``conveyor bench structured``: what structured outputs cost.

Grammar compile time of a JSON schema (cold: its first compile; cached: the same schema
again, as every later request with it), and decode step time of one batch with 0, 50 and
100 % of its requests constrained by that schema, so the price of the masks per step shows
beside the free step. Prints figures; asserts nothing on time.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

from conveyor.bench.engine.steps import fastest_decode_step
from conveyor.runtime.engine.llm_engine import LLMEngine
from conveyor.runtime.engine.settings import EngineSettings
from conveyor.runtime.sampling_params import SamplingParams, StructuredOutputParams

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
"""The schema the structured-output tests validate against: enums, bounded integers and
strings, an array, no extra properties."""


def compile_times(engine: LLMEngine, schema: dict[str, Any]) -> dict[str, float]:
    grammars = engine.structured_outputs
    t0 = time.perf_counter()
    grammars.compile(StructuredOutputParams(json_object=True))  # builds the compiler
    t1 = time.perf_counter()
    spec = StructuredOutputParams(json=json.dumps(schema))
    grammars.compile(spec)
    t2 = time.perf_counter()
    grammars.compile(spec)
    t3 = time.perf_counter()
    return {
        "compiler_setup_ms": (t1 - t0) * 1e3,
        "cold_ms": (t2 - t1) * 1e3,
        "cached_us": (t3 - t2) * 1e6,
    }


def step_time(
    engine: LLMEngine, batch: int, constrained: int, spec: StructuredOutputParams, prompt_len: int
) -> float:
    """Fastest decode step (ms) of ``batch`` requests, ``constrained`` of them by ``spec``."""
    rng = random.Random(1)
    vocab = min(engine.runner.vocab_size, 256)

    def add() -> None:
        for i in range(batch):
            prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
            if i < constrained:
                params = SamplingParams(max_tokens=200, temperature=1.0, structured_output=spec)
            else:
                params = SamplingParams(max_tokens=200, temperature=1.0, ignore_eos=True)
            engine.add_request(f"structured-{batch}-{constrained}-{i}", prompt, params)

    return fastest_decode_step(engine, add, batch)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="conveyor bench structured",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--batch", type=int, default=32, help="requests per step (default 32)")
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    parser.add_argument("--json", dest="json_path", help="write the figures to this JSON file")
    EngineSettings.add_cli_args(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    settings = EngineSettings.from_cli_args(args)
    engine = LLMEngine(settings, on_progress=lambda m: print(f"[engine] {m}", file=sys.stderr))
    compiled = compile_times(engine, SCHEMA)
    print(
        f"grammar compile: compiler setup {compiled['compiler_setup_ms']:.1f} ms (once per "
        f"server), test schema cold {compiled['cold_ms']:.2f} ms, cached "
        f"{compiled['cached_us']:.1f} us"
    )
    spec = StructuredOutputParams(json=json.dumps(SCHEMA))
    rows = []
    free_ms = None
    for percent in (0, 50, 100):
        constrained = args.batch * percent // 100
        ms = step_time(engine, args.batch, constrained, spec, args.prompt_len)
        free_ms = ms if free_ms is None else free_ms
        rows.append({"constrained_percent": percent, "step_ms": ms, "vs_free": ms / free_ms})
        print(
            f"batch {args.batch}, {percent:>3}% constrained: decode step {ms:.2f} ms "
            f"({ms / free_ms:.2f}x the free step)"
        )
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"compile": compiled, "batch": args.batch, "steps": rows}, f, indent=2)
        print(f"wrote {args.json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
