"""Stage ``tp`` of ``conveyor bench gpu``: tensor parallelism over two GPUs (NCCL).

First the built-in tiny model's greedy output at TP=2 against TP=1 (Triton kernels, NCCL
all-reduces, CUDA graphs), then output tokens per second and weight bytes per rank at TP=1
and TP=2 for the 8B shape in bfloat16 (dummy weights): the same requests, one engine after
the other. That needs two CUDA devices; on one, the stage checks what a rank's graphs rely
on there: an all-reduce of the ranks' own NCCL group, captured in a CUDA graph between two
matrix products, replays to what it computes eagerly. ``--smoke`` runs the engine part on
CPU (shared memory) with tiny shapes, to check the stage itself.
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
        return {
            "skipped": f"needs 2 CUDA devices, this machine has {torch.cuda.device_count()}",
            "nccl_all_reduce_in_cuda_graph": nccl_all_reduce_in_cuda_graph(),
        }
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


def nccl_all_reduce_in_cuda_graph() -> dict:
    """A group of one rank on this GPU, built as a replica's ranks build theirs: its
    all-reduce between two matrix products, captured in a CUDA graph (as a rank captures its
    decode step), against the same eagerly. A single rank's all-reduce goes through the same
    ProcessGroupNCCL calls as several ranks', so this is what capture relies on there."""
    from conveyor.runtime.engine.tensor_parallel import free_port, process_group
    from conveyor.runtime.layers.parallel import TensorParallel

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    tp = TensorParallel(0, 1, process_group(0, 1, free_port(), device))
    g = torch.Generator(device=device).manual_seed(0)
    w1, w2 = (torch.randn(1024, 1024, device=device, generator=g) / 32 for _ in range(2))
    x = torch.randn(64, 1024, device=device, generator=g)

    def step(x: torch.Tensor) -> torch.Tensor:
        return tp.all_reduce(x @ w1) @ w2

    eager = step(x)
    static_x = torch.zeros_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(static_x)  # warm-up on a side stream, as torch's graph docs ask
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            out = step(static_x)
    except RuntimeError as exc:
        return {"ok": False, "error": f"capture failed: {exc}"[:2000]}
    static_x.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    diff = (out - eager).abs().max().item()
    return {"ok": torch.allclose(out, eager, rtol=1e-4, atol=1e-5), "max_abs_diff": diff}
