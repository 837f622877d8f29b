"""Stage ``tp`` of ``conveyor bench gpu``: tensor parallelism over two GPUs (NCCL).

Needs two CUDA devices (reported as skipped otherwise). First the built-in tiny model's
greedy output at TP=2 against TP=1 (Triton kernels, NCCL all-reduces), then output tokens
per second and weight bytes per rank at TP=1 and TP=2 for the 8B shape in bfloat16 (dummy
weights): the same requests, one engine after the other, both eager (a tensor-parallel
replica does not capture CUDA graphs yet). ``--smoke`` runs it on CPU over gloo with tiny
shapes, to check the stage itself.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch

from conveyor.bench.gpu.shapes import LLAMA_8B, TINY, write_model_dir


def stage_tp(args, workdir: Path) -> dict:
    from conveyor.runtime.engine.llm_engine import LLMEngine
    from conveyor.runtime.engine.settings import EngineSettings

    device = "cpu" if args.smoke else "cuda"
    if not args.smoke and torch.cuda.device_count() < 2:
        return {"skipped": f"needs 2 CUDA devices, this machine has {torch.cuda.device_count()}"}
    result: dict = {}

    def engine(model: str, tp: int, **settings) -> LLMEngine:
        print(f"[tp] {model} at TP={tp}", file=sys.stderr)
        return LLMEngine(
            EngineSettings(model=model, device=device, tensor_parallel_size=tp, **settings)
        )

    # 1. greedy equality: TP=2 against TP=1 on the built-in tiny model
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 256) for _ in range(rng.randint(4, 200))] for _ in range(16)]
    outputs = []
    for tp in (1, 2):
        e = engine("conveyor-tiny", tp, max_total_tokens=16384)
        try:
            outputs.append(_greedy(e, prompts, 32)[0])
        finally:
            e.close()
    result["tiny_greedy_equal"] = outputs[0] == outputs[1]
    result["tiny_differing_requests"] = sum(a != b for a, b in zip(*outputs, strict=True))

    # 2. throughput and weights per rank, 8B shape
    shape = TINY if args.smoke else LLAMA_8B
    model_dir = write_model_dir(workdir / "llama-8b-shape-tp", shape)
    n, out_len = (8, 16) if args.smoke else (64, 128)
    prompts = [[rng.randrange(1, 256) for _ in range(512)] for _ in range(n)]
    rows = []
    for tp in (1, 2):
        e = engine(
            str(model_dir),
            tp,
            load_format="dummy",
            dtype="float32" if args.smoke else "bfloat16",
            max_running_requests=n,
            max_model_len=2048,
            enforce_eager=True,
        )
        try:
            _greedy(e, prompts[:2], 4)  # warm-up: kernels compiled, graphs captured
            _, seconds = _greedy(e, prompts, out_len)
            rows.append(
                {
                    "tp": tp,
                    "output_tok_s": round(n * out_len / seconds, 1),
                    "weight_gib_rank0": round(e.runner.weight_bytes / 2**30, 3),
                    "kv_blocks": e.state.num_blocks,
                }
            )
        finally:
            e.close()
    result["rows"] = rows
    result["tp2_over_tp1_throughput"] = round(rows[1]["output_tok_s"] / rows[0]["output_tok_s"], 2)
    return result


def _greedy(engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    """Every prompt to ``max_tokens`` greedy tokens at once; (outputs in order, seconds)."""
    from conveyor.runtime import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = [f"tp-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params)
    done: dict[str, list[int]] = {}
    started = time.monotonic()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.output_token_ids
    return [done[rid] for rid in ids], time.monotonic() - started
