"""``conveyor bench lora``: what serving LoRA adapters costs, beside the base model.

Random adapters of the model (``--rank``, all seven projections of every layer) are loaded
into the engine's slots; then, with the same engine, the fastest decode step of a batch and
the fastest prefill step of one prompt chunk are timed with every request on the base model,
all on one adapter, and spread over ``--adapters`` adapters. A step that holds an adapter's
tokens runs the layers one by one with the LoRA matmuls (``layers/lora.py``); a base-only
step runs as without LoRA. Prints figures and ratios to the base model; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from conveyor.bench.engine.lora_adapters import write_adapter
from conveyor.bench.engine.steps import fastest_decode_step
from conveyor.runtime.engine.llm_engine import LLMEngine
from conveyor.runtime.engine.settings import EngineSettings
from conveyor.runtime.layers.lora import module_dims
from conveyor.runtime.sampling_params import SamplingParams

PREFILL_RUNS = 3


def decode_ms(engine: LLMEngine, loras: list[str | None], prompt_len: int, tag: str) -> float:
    rng = random.Random(1)
    vocab = min(engine.runner.vocab_size, 1000)

    def add() -> None:
        for i, lora in enumerate(loras):
            prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
            params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
            engine.add_request(f"lora-{tag}-{i}", prompt, params, lora=lora)

    return fastest_decode_step(engine, add, len(loras))


def prefill_ms(engine: LLMEngine, lora: str | None, tokens: int, tag: str) -> float:
    """Fastest step (ms) that prefills one prompt of ``tokens`` tokens (no prefix-cache hit:
    each run's prompt differs)."""
    rng = random.Random(2)
    vocab = min(engine.runner.vocab_size, 1000)
    times = []
    for run in range(PREFILL_RUNS):
        prompt = [rng.randrange(vocab) for _ in range(tokens)]
        engine.add_request(f"prefill-{tag}-{run}", prompt, SamplingParams(max_tokens=1), lora=lora)
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        while engine.has_unfinished_requests():
            engine.step()
    return min(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="conveyor bench lora",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--batch", type=int, default=32, help="requests per decode step (32)")
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens per decode prompt (64)")
    parser.add_argument(
        "--prefill-tokens", type=int, default=512, help="tokens of the timed prefill chunk (512)"
    )
    parser.add_argument("--adapters", type=int, default=4, help="adapters loaded (default 4)")
    parser.add_argument("--rank", type=int, default=16, help="the adapters' rank (default 16)")
    parser.add_argument("--json", dest="json_path", help="write the figures to this JSON file")
    EngineSettings.add_cli_args(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    settings = EngineSettings.from_cli_args(args).replace(
        enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank
    )
    print(f"loading {settings.model} with {args.adapters} LoRA slots", file=sys.stderr)
    engine = LLMEngine(settings, on_progress=lambda m: print(f"[engine] {m}", file=sys.stderr))
    model = engine.runner.model
    names = [f"adapter-{i}" for i in range(args.adapters)]
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-lora-") as tmp:
        shape = (model.shape.num_layers, module_dims(model))
        for i, name in enumerate(names):
            folder = Path(tmp) / name
            write_adapter(folder, shape, seed=i, rank=args.rank, alpha=2 * args.rank, std=0.02)
            engine.loras.load(engine.runner.read_lora(name, str(folder)))
    b = args.batch
    mixes: dict[str, list[str | None]] = {
        "base model": [None] * b,
        "half base, half one adapter": [None if i % 2 else names[0] for i in range(b)],
        "one adapter": [names[0]] * b,
        f"{args.adapters} adapters": [names[i % len(names)] for i in range(b)],
    }
    rows = []
    print(f"\ndecode step, batch {b} (fastest of 16):")
    base = None
    for label, loras in mixes.items():
        print(f"  timing {label} ...", file=sys.stderr)
        ms = decode_ms(engine, loras, args.prompt_len, label.replace(" ", "-"))
        base = base or ms
        rows.append({"step": "decode", "mix": label, "ms": ms, "vs_base": ms / base})
        print(f"  {label:<32} {ms:8.2f} ms  {ms / base:5.2f}x base  {b / ms * 1e3:8.0f} tok/s")
    print(f"\nprefill step, {args.prefill_tokens} tokens (fastest of {PREFILL_RUNS}):")
    base = None
    for label, lora in (("base model", None), ("one adapter", names[0])):
        ms = prefill_ms(engine, lora, args.prefill_tokens, label.replace(" ", "-"))
        base = base or ms
        rows.append({"step": "prefill", "mix": label, "ms": ms, "vs_base": ms / base})
        print(f"  {label:<32} {ms:8.2f} ms  {ms / base:5.2f}x base")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"batch": b, "rank": args.rank, "rows": rows}, f, indent=2)
        print(f"wrote {args.json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
