"""``conveyor bench offline``: continuous vs static vs one-at-a-time scheduling, side by side.

The workload: many requests submitted at once, prompt lengths uniform in
a range, output lengths exponential (so a static batch waits for its longest
member), ``ignore_eos`` so every request runs to its length. The same requests
go through the engine in each scheduling mode, and through Hugging Face
``generate`` on padded static batches, side by side in one run.

Besides wall-clock figures it prints the ideal ratios: the schedule each mode
produced, replayed with every step costing the same (as a GPU decode step
nearly does). On CPU a step's cost grows with its batch, so the measured
ratio falls short of the ideal one; the step-time table shows by how much.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass

from conveyor.bench.engine.hf_generate import run_hf
from conveyor.bench.engine.results import ModeResult, summarise
from conveyor.runtime.engine.llm_engine import LLMEngine
from conveyor.runtime.engine.settings import EngineSettings
from conveyor.runtime.sampling_params import SamplingParams

MODES = ("continuous", "static", "none")


@dataclass(frozen=True)
class Workload:
    num_requests: int = 128
    """Requests, all submitted at once."""
    prompt_len_min: int = 16
    prompt_len_max: int = 128
    output_len_mean: float = 64.0
    """Mean of the exponential output-length distribution (tokens)."""
    output_len_max: int = 256
    seed: int = 0

    def requests(self, vocab: int) -> list[tuple[list[int], int]]:
        rng = random.Random(self.seed)
        out = []
        for _ in range(self.num_requests):
            n = rng.randint(self.prompt_len_min, self.prompt_len_max)
            prompt = [rng.randrange(vocab) for _ in range(n)]
            length = min(
                self.output_len_max, max(1, round(rng.expovariate(1 / self.output_len_mean)))
            )
            out.append((prompt, length))
        return out


def run_engine(engine: LLMEngine, requests, mode: str) -> ModeResult:
    """Submit every request at once and step until done, recording the schedule."""
    # Same engine, model and KV cache for every mode: only admission differs.
    engine.scheduler.set_mode(mode, engine.settings.max_running_requests)
    engine.block_manager.reset_prefix_cache()
    before = engine.stats()
    start = time.monotonic()
    for i, (prompt, length) in enumerate(requests):
        params = SamplingParams(max_tokens=length, temperature=0, ignore_eos=True)
        engine.add_request(f"{mode}-{i}", prompt, params, arrival_time=start)
    running, occupancy, step_times = [], [], []
    finals = {}
    while engine.has_unfinished_requests():
        waiting = len(engine.scheduler.waiting)
        t0 = time.perf_counter()
        outputs = engine.step()
        step_times.append((len(engine.scheduler.running), time.perf_counter() - t0))
        n_running = len(engine.scheduler.running) + sum(o.finished for o in outputs)
        running.append(n_running)
        if waiting:
            occupancy.append(n_running / engine.scheduler.max_running)
        for o in outputs:
            if o.finished:
                finals[o.request_id] = o
    duration = time.monotonic() - start
    after = engine.stats()
    ttfts, tpots = [], []
    for o in finals.values():
        assert o.first_token_time is not None and o.finish_time is not None, "finished: both set"
        ttfts.append(o.first_token_time - o.arrival_time)
        if len(o.output_token_ids) > 1:
            tpots.append((o.finish_time - o.first_token_time) / (len(o.output_token_ids) - 1))
    tokens = sum(len(o.output_token_ids) for o in finals.values())
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    return summarise(
        mode,
        duration,
        len(finals),
        tokens,
        ttfts,
        tpots,
        mean_running=statistics.fmean(running) if running else 0.0,
        max_running=max(running, default=0),
        occupancy_while_waiting=statistics.fmean(occupancy) if occupancy else None,
        preemptions=after.preemptions - before.preemptions,
        prefix_cache_hit_rate=hits / queries if queries else 0.0,
        steps=len(running),
        step_times=step_times,
    )


def step_time_by_batch(engine: LLMEngine, sizes: list[int], prompt_len: int = 64) -> list[dict]:
    """Decode step time against batch size: what a step costs as the batch grows."""
    rows = []
    rng = random.Random(1)
    vocab = engine.runner.vocab_size
    for size in sizes:
        engine.scheduler.set_mode("continuous", max(sizes))
        for i in range(size):
            prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
            engine.add_request(
                f"sweep-{size}-{i}",
                prompt,
                SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
            )
        while (
            any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running)
            or engine.scheduler.waiting
        ):
            engine.step()  # prefill until everyone decodes
        times = []
        for _ in range(16):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        while engine.has_unfinished_requests():
            engine.step()
        # The fastest of 16 steps: on a shared machine the others measure the neighbours.
        ms = min(times) * 1000
        rows.append({"batch": size, "step_ms": ms, "tokens_per_s": size / ms * 1000})
    return rows


def print_table(results: list[ModeResult], out=sys.stdout) -> None:
    header = (
        f"{'mode':<12} {'tok/s':>9} {'req/s':>7} {'TTFT p50':>9} {'p95':>8} {'p99':>8} "
        f"{'TPOT p50':>9} {'p95':>8} {'p99':>8} {'mean run':>8} {'occup.':>6} {'preempt':>7} "
        f"{'prefix hit':>10} {'vs cont.':>8}"
    )
    print(header, file=out)
    print("-" * len(header), file=out)
    for r in results:
        occ = "-" if r.occupancy_while_waiting is None else f"{r.occupancy_while_waiting:.2f}"
        ratio = (
            "-"
            if r.throughput_ratio_to_continuous is None
            else f"{r.throughput_ratio_to_continuous:.2f}x"
        )
        print(
            f"{r.mode:<12} {r.output_throughput:>9.1f} {r.request_throughput:>7.2f} "
            f"{r.ttft_p50:>8.3f}s {r.ttft_p95:>7.3f}s {r.ttft_p99:>7.3f}s "
            f"{r.tpot_p50 * 1000:>7.2f}ms {r.tpot_p95 * 1000:>6.2f}ms {r.tpot_p99 * 1000:>6.2f}ms "
            f"{r.mean_running:>8.1f} {occ:>6} {r.preemptions:>7} {r.prefix_cache_hit_rate:>10.1%} "
            f"{ratio:>8}",
            file=out,
        )


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, EngineSettings, Workload]:
    parser = argparse.ArgumentParser(
        prog="conveyor bench offline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    w = Workload()
    parser.add_argument(
        "--num-requests",
        "--num-prompts",
        type=int,
        default=w.num_requests,
        help=f"requests, all submitted at once (default {w.num_requests})",
    )
    parser.add_argument(
        "--prompt-len-min",
        type=int,
        default=w.prompt_len_min,
        help=f"shortest prompt in tokens; lengths are uniform in [min, max] (default {w.prompt_len_min})",
    )
    parser.add_argument(
        "--prompt-len-max",
        type=int,
        default=w.prompt_len_max,
        help=f"longest prompt in tokens (default {w.prompt_len_max})",
    )
    parser.add_argument(
        "--output-len-mean",
        type=float,
        default=w.output_len_mean,
        help=f"mean of the exponential output lengths in tokens (default {w.output_len_mean:g})",
    )
    parser.add_argument(
        "--output-len-max",
        type=int,
        default=w.output_len_max,
        help=f"cap on an output length in tokens (default {w.output_len_max})",
    )
    parser.add_argument(
        "--workload-seed",
        type=int,
        default=w.seed,
        help=f"seed of the prompts and output lengths, so runs compare (default {w.seed})",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="run continuous, static, none and HF generate side by side",
    )
    parser.add_argument(
        "--skip-hf", action="store_true", help="with --compare: leave out HF generate"
    )
    parser.add_argument("--skip-none", action="store_true", help="with --compare: leave out 'none'")
    parser.add_argument(
        "--sweep", default="1,2,4,8,16,32", help="batch sizes for the step-time table ('' to skip)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="cProfile the continuous run's steps"
    )
    parser.add_argument(
        "--warmup-runs",
        type=int,
        default=1,
        help="unmeasured passes of the workload in each mode before any is measured: on a GPU "
        "Triton compiles a kernel the first time it meets a shape, and the mode measured first "
        "would pay for it (default 1)",
    )
    parser.add_argument("--json", dest="json_path", help="write results to this JSON file")
    EngineSettings.add_cli_args(parser)
    parser.set_defaults(max_running_requests=32)
    args = parser.parse_args(argv)
    settings = EngineSettings.from_cli_args(args)
    workload = Workload(
        args.num_requests,
        args.prompt_len_min,
        args.prompt_len_max,
        args.output_len_mean,
        args.output_len_max,
        args.workload_seed,
    )
    if args.warmup_runs < 0:
        parser.error("--warmup-runs must be 0 or more")
    if workload.prompt_len_min < 1 or workload.prompt_len_max < workload.prompt_len_min:
        parser.error("need 1 <= --prompt-len-min <= --prompt-len-max")
    return args, settings, workload


def main(argv: list[str] | None = None) -> int:
    args, settings, workload = parse_args(sys.argv[1:] if argv is None else argv)
    engine = LLMEngine(settings, on_progress=lambda m: print(f"[engine] {m}", file=sys.stderr))
    vocab = engine.runner.vocab_size
    # Ordinary tokens only: the built-in model's ids past 256 are special, as are a real model's last ids.
    requests = workload.requests(min(vocab, 256) if vocab <= 512 else min(vocab, 32000))
    modes = (
        [m for m in MODES if not (m == "none" and args.skip_none)]
        if args.compare
        else [settings.scheduler]
    )
    print(
        f"workload: {workload.num_requests} requests at once, prompts {workload.prompt_len_min}-"
        f"{workload.prompt_len_max} tokens, outputs exp(mean {workload.output_len_mean:g}) capped at "
        f"{workload.output_len_max}, ignore_eos; model {settings.model}; max running "
        f"{settings.max_running_requests}; chunked prefill {engine.scheduler.token_budget}; "
        f"{engine.runner.device}, {engine.state.num_threads} threads"
    )
    print(engine.kv_cache_summary())
    for mode in modes:
        for i in range(args.warmup_runs):
            print(f"warming up {mode} ({i + 1}/{args.warmup_runs}) ...", file=sys.stderr)
            run_engine(engine, requests, mode)
    results: list[ModeResult] = []
    profile_text = None
    for mode in modes:
        print(f"running {mode} ...", file=sys.stderr)
        if args.profile and mode == "continuous":
            prof = cProfile.Profile()
            prof.enable()
            results.append(run_engine(engine, requests, mode))
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(15)
            profile_text = buf.getvalue()
        else:
            results.append(run_engine(engine, requests, mode))
    if args.compare and not args.skip_hf:
        print("running hf-generate ...", file=sys.stderr)
        results.append(
            run_hf(
                str(engine.model_path),
                requests,
                settings.max_running_requests,
                settings.device,
                engine.state.num_threads,
            )
        )
    by_mode = {r.mode: r for r in results}
    cont = by_mode.get("continuous")
    for r in results:
        if cont:
            r.throughput_ratio_to_continuous = r.output_throughput / cont.output_throughput
    print()
    print_table(results)
    ideal = {}
    if cont:
        for r in results:
            if r.mode in ("static", "none"):
                ideal[r.mode] = r.steps / cont.steps
        print()
        print(
            "ideal continuous/X throughput ratio (every step costs the same, as on a GPU decode):"
        )
        for mode, ratio in ideal.items():
            measured = cont.output_throughput / by_mode[mode].output_throughput
            print(
                f"  vs {mode:<7}: ideal {ratio:5.2f}x ({by_mode[mode].steps} vs {cont.steps} steps), "
                f"measured {measured:5.2f}x"
            )
        if "static" in by_mode:
            st = by_mode["static"]
            print(
                f"  TTFT p50 static/continuous: {st.ttft_p50 / cont.ttft_p50:.2f}x; "
                f"slot occupancy while requests wait (continuous): {cont.occupancy_while_waiting or 0:.2f}"
            )
        if "hf-generate" in by_mode:
            print(
                f"  continuous / HF generate throughput: "
                f"{cont.output_throughput / by_mode['hf-generate'].output_throughput:.2f}x"
            )
    sweep = []
    if args.sweep:
        sizes = [int(x) for x in args.sweep.split(",") if x]
        sweep = step_time_by_batch(engine, sizes)
        print()
        print("decode step time against batch size (why CPU falls short of the ideal ratio):")
        base = sweep[0]
        for row in sweep:
            print(
                f"  batch {row['batch']:>4}: {row['step_ms']:7.2f} ms/step "
                f"({row['step_ms'] / base['step_ms']:5.2f}x batch {base['batch']}), "
                f"{row['tokens_per_s']:8.1f} tok/s"
            )
    if profile_text:
        print()
        print("profile of the continuous run (top 15 by own time):")
        print(profile_text)
    if args.json_path:
        doc = {
            "workload": asdict(workload),
            "settings": asdict(settings),
            "warmup_runs": args.warmup_runs,
            "modes": [{k: v for k, v in asdict(r).items() if k != "step_times"} for r in results],
            "ideal_static_ratio": ideal.get("static"),
            "ideal_none_ratio": ideal.get("none"),
            "step_time_by_batch": sweep,
        }
        with open(args.json_path, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"wrote {args.json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
