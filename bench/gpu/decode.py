"""Stage ``decode`` of ``conveyor bench gpu``: decode step time against batch size for an
8B-shaped Llama, and the model bandwidth utilisation (MBU) it reaches."""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

import torch

from conveyor.bench.gpu.shapes import LLAMA_8B, TINY, write_model_dir
from conveyor.bench.stats import percentile

PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12}
"""Bytes/s by device name; ``--peak-bandwidth`` overrides (H100: the SXM figure)."""


def decode_batch(size: int, context_len: int, block_size: int):
    """``size`` sequences, each decoding its token ``context_len``, on blocks of their own."""
    from conveyor.runtime.engine.scheduler import ScheduledBatch
    from conveyor.runtime.engine.sequence import Sequence
    from conveyor.runtime.sampling_params import SamplingParams

    per_seq = -(-context_len // block_size)
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    seqs = []
    for i in range(size):
        seq = Sequence(
            f"decode-{size}-{i}", [1] * context_len, context_len - 1, params, arrival_time=0.0
        )
        seq.num_computed_tokens = context_len - 1
        seq.block_table = list(range(i * per_seq, (i + 1) * per_seq))
        seqs.append(seq)
    return ScheduledBatch(seqs=seqs, num_new_tokens=[1] * size, num_decodes=size), per_seq


def stage_decode(args, workdir: Path, report) -> dict:
    from conveyor.runtime.engine.llm_engine import LLMEngine
    from conveyor.runtime.engine.settings import EngineSettings

    device = "cpu" if args.smoke else "cuda"
    shape = TINY if args.smoke else LLAMA_8B
    model_dir = write_model_dir(workdir / "llama-8b-shape", shape)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    settings = EngineSettings(
        model=str(model_dir),
        load_format="dummy",
        dtype="bfloat16" if not args.smoke else "float32",
        device=device,
        max_running_requests=max(sizes),
        attention_backend="auto",
        max_model_len=args.context_len + 16,
        max_total_tokens=None if not args.smoke else 1 << 16,
    )
    started = time.monotonic()
    engine = LLMEngine(settings, on_progress=lambda m: print(f"[engine] {m}", file=sys.stderr))
    runner = engine.runner
    built = time.monotonic() - started
    model, s = runner.model, runner.model.shape
    elem = torch.tensor([], dtype=runner.dtype).element_size()
    weight_bytes = (
        sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n) * elem
    )
    if model.lm_head is None:  # tied: the embedding is read in full as the LM head
        weight_bytes += model.embed_tokens.weight.numel() * elem
    kv_bytes_per_token = 2 * s.num_layers * s.num_kv_heads * s.head_dim * elem
    peak = args.peak_bandwidth or peak_bandwidth(device)
    rows = []
    for size in sizes:
        batch, per_seq = decode_batch(size, args.context_len, settings.block_size)
        if size * per_seq > engine.state.num_blocks:
            rows.append({"batch": size, "skipped": "KV cache too small"})
            continue
        step_s, eager_s, graph_s = time_decode(runner, batch, args.steps, device)
        moved = weight_bytes + size * args.context_len * kv_bytes_per_token
        forward_s = graph_s or eager_s
        row = {
            "batch": size,
            "step_ms": step_s * 1e3,
            "forward_ms": forward_s * 1e3,
            "eager_forward_ms": eager_s * 1e3,
            "graph_forward_ms": None if graph_s is None else graph_s * 1e3,
            "bytes_per_step": moved,
            "mbu_step": moved / step_s / peak,
            "mbu_forward": moved / forward_s / peak,
            "tokens_per_s": size / step_s,
        }
        rows.append(row)
        print(
            f"[decode] batch {size:>4}: step {row['step_ms']:7.2f} ms, forward {row['forward_ms']:7.2f} ms "
            f"(eager {row['eager_forward_ms']:7.2f}), MBU {row['mbu_step']:.1%} step / "
            f"{row['mbu_forward']:.1%} forward",
            file=sys.stderr,
        )
        report({"rows": rows})  # partial results survive a cut
    result = {
        "model": "llama-8b-shape" if not args.smoke else "tiny",
        "dtype": str(runner.dtype),
        "context_len": args.context_len,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_bytes_per_token,
        "peak_bandwidth": peak,
        "cuda_graph_sizes": runner.cuda_graphs.sizes if runner.cuda_graphs else None,
        "kv_cache_blocks": engine.state.num_blocks,
        "engine_start_s": round(built, 1),
        "rows": rows,
    }
    del engine, runner, model
    gc.collect()  # the next stage's engine sizes its KV cache from what is free
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


@torch.inference_mode()
def time_decode(runner, batch, steps: int, device: str) -> tuple[float, float, float | None]:
    """Median seconds of: the engine's step on ``batch`` (inputs, forward, sampling), the eager
    forward alone, and the forward replayed from a CUDA graph (None without graphs)."""
    for _ in range(3):
        runner.execute(batch)
    step_s = _median_time(lambda: runner.execute(batch), steps, device)  # syncs: .tolist()
    input_ids, positions, meta, _ = runner._prepare(batch)
    eager_s = _median_time(
        lambda: runner.model(input_ids, positions, runner.kv_cache, meta), steps, device
    )
    graphs = runner.cuda_graphs
    graph_s = None
    if graphs is not None and graphs.can_run(len(batch.seqs), len(batch.seqs)):
        graph_s = _median_time(lambda: graphs.run(input_ids, positions, meta), steps, device)
    return step_s, eager_s, graph_s


def _median_time(fn, steps: int, device: str) -> float:
    times = []
    for _ in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    median = percentile(times, 50)
    assert median is not None, "no steps timed"
    return median


def peak_bandwidth(device: str) -> float:
    if device != "cuda":
        return 50e9  # a nominal figure for --smoke
    name = torch.cuda.get_device_name()
    for key, value in PEAK_BANDWIDTH.items():
        if key in name:
            return value
    raise SystemExit(f"unknown peak bandwidth for {name!r}: pass --peak-bandwidth BYTES_PER_S")
