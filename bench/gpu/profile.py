"""Stage ``profile`` of ``conveyor bench gpu``: where a warm engine's step time goes.

The offline bench's workload (128 requests at once, continuous batching) on the 1B shape
with dummy weights, run twice to compile the kernels and settle the allocator, then once
more under cProfile and once without it. The stats file (``engine_step.pstats``) comes
back with the results; ``python -m pstats`` reads it on any machine. The summary gives the
steps' median time with and without the profiler, the time in eager forward passes (prefill
and mixed steps) against CUDA-graph replays (decode-only steps), and the top functions by
their own time.
"""

from __future__ import annotations

import cProfile
import gc
import io
import pstats
import sys
from pathlib import Path

from conveyor.bench.gpu.shapes import LLAMA_1B, TINY, write_model_dir


def stage_profile(args, workdir: Path, out: Path) -> dict:
    import torch

    from conveyor.bench.engine.offline import Workload, run_engine
    from conveyor.runtime.engine.cuda_graphs import DecodeCudaGraphs
    from conveyor.runtime.engine.llm_engine import LLMEngine
    from conveyor.runtime.engine.piecewise_graphs import PiecewiseCudaGraphs
    from conveyor.runtime.engine.sampling_inputs import SamplingInputs
    from conveyor.runtime.engine.scheduler import Scheduler
    from conveyor.runtime.engine.settings import EngineSettings
    from conveyor.runtime.model.llama import LlamaForCausalLM

    model = write_model_dir(workdir / "profile-model", TINY if args.smoke else LLAMA_1B)
    settings = EngineSettings(
        model=str(model),
        load_format="dummy",
        device="cpu" if args.smoke else "cuda",
        dtype="float32" if args.smoke else "bfloat16",
        max_running_requests=32,
    )
    engine = LLMEngine(settings)
    try:
        requests = Workload().requests(min(engine.runner.vocab_size, 32000))
        for _ in range(2):
            run_engine(engine, requests, "continuous")  # warm-up
        prof = cProfile.Profile()
        prof.enable()
        profiled = run_engine(engine, requests, "continuous")
        prof.disable()
        plain = run_engine(engine, requests, "continuous")
    finally:
        engine.close()
    del engine  # its KV cache and graphs, before the next engine sizes its own
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    # The same run with the steps that hold a prefill launched kernel by kernel.
    engine = LLMEngine(settings.replace(piecewise_cuda_graph_max_tokens=0))
    try:
        run_engine(engine, requests, "continuous")  # warm-up
        eager = run_engine(engine, requests, "continuous")
    finally:
        engine.close()
    stats_path = out / "engine_step.pstats"
    prof.dump_stats(str(stats_path))
    stats = pstats.Stats(prof)
    result = {
        "steps": len(plain.step_times),
        "output_tok_s": round(plain.output_throughput, 1),
        "step_p50_ms": _median_ms(plain.step_times),
        "step_p50_ms_profiled": _median_ms(profiled.step_times),
        "output_tok_s_prefill_steps_eager": round(eager.output_throughput, 1),
        "piecewise_over_eager": round(plain.output_throughput / eager.output_throughput, 2),
        "seconds_in": {  # cumulative, under the profiler
            "eager_forward": _cumulative(stats, LlamaForCausalLM.forward),
            "cuda_graph_replay": _cumulative(stats, DecodeCudaGraphs.run),
            "piecewise_graphs": _cumulative(stats, PiecewiseCudaGraphs.run),
            "schedule": _cumulative(stats, Scheduler.schedule),
            "postprocess": _cumulative(stats, LLMEngine.postprocess),
            "sampling_tensors": _cumulative(stats, SamplingInputs.tensors),
        },
        "pstats": str(stats_path),
    }
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(20)
    print(buf.getvalue(), file=sys.stderr)
    return result


def _median_ms(step_times: list[tuple[int, float]]) -> float:
    times = sorted(t for _, t in step_times)
    return round(times[len(times) // 2] * 1e3, 2) if times else 0.0


def _cumulative(stats: pstats.Stats, function) -> float:
    """Cumulative seconds in ``function`` (a plain function or method) during the run."""
    code = function.__code__
    key = (code.co_filename, code.co_firstlineno, code.co_name)
    entry = stats.stats.get(key)  # type: ignore[attr-defined]
    return round(entry[3], 3) if entry else 0.0
