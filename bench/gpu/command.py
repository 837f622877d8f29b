"""``conveyor bench gpu``: the GPU path end to end, on one machine, in a few minutes.

Made for a machine lent for minutes at a time, with its own Python (torch,
triton, transformers; no pip, no network, maybe no pytest or matplotlib):
run it from the checkout with ``PYTHONPATH=.`` (``bench/gpu.sh`` does). It
makes its models itself, and writes ``gpu_bench.json`` to ``--out`` after
every stage, so a run cut short still reports what it measured:

1. ``kernels``: every Triton kernel against the torch reference on CUDA: the
   CI matrix of ``runtime/kernels/checks.py`` in float32/float16/bfloat16 plus
   the larger sweep, spread over worker processes (compiling is the cost); and
   the built-in model's greedy output with the Triton backend, from CUDA graphs
   and eager, against the torch backend's.
2. ``decode``: decode step time against batch size (1 to 256) for an
   8B-shaped Llama in bfloat16 (dummy weights made on the GPU), every sequence
   at ``--context-len`` tokens, through the engine's model runner with CUDA
   graphs; the model bandwidth utilisation (MBU) = (weight bytes + KV bytes
   read per step) / step time / the GPU's peak memory bandwidth.
3. ``offline``: ``conveyor bench offline --compare`` on a 1B-shaped Llama
   (random weights saved once, so Hugging Face ``generate`` loads the same).
4. ``plot``: a PNG of step time and MBU against batch size.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import platform
import struct
import sys
import tempfile
import time
import traceback
import zlib
from concurrent.futures import ProcessPoolExecutor, wait
from multiprocessing import get_context
from pathlib import Path

import torch

STAGES = ("kernels", "decode", "offline", "plot")
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12}
"""Bytes/s by device name; ``--peak-bandwidth`` overrides (H100: the SXM figure)."""

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "vocab_size": 128256,
    "torch_dtype": "bfloat16",
}
"""Llama-3-8B's shapes."""
LLAMA_1B = {
    **LLAMA_8B,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "tie_word_embeddings": True,
}
"""Llama-3.2-1B's shapes (without its rope scaling)."""
TINY = {
    **LLAMA_8B,
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
}
"""For ``--smoke`` (the script's own check on a machine without a GPU)."""


# -- stage 1: kernels ---------------------------------------------------------------------


def kernel_tasks() -> list[tuple]:
    from conveyor.runtime.kernels import checks

    tasks: list[tuple] = [("engine_greedy", ())]
    tasks += [("store_kv", (d,)) for d in checks.DTYPES]
    for d in checks.DTYPES:
        tasks += [("rms_norm", (*a, d)) for a in checks.ELEMENTWISE_CASES["rms_norm"]]
        tasks += [("rotary", (*a, d)) for a in checks.ELEMENTWISE_CASES["rotary"]]
        tasks += [("silu_and_mul", (*a, d)) for a in checks.ELEMENTWISE_CASES["silu_and_mul"]]
    for case in checks.attention_cases():
        tasks += [("attention", (case, d)) for d in checks.DTYPES]
        tasks.append(("decode_splits", (case, torch.float32, 5)))
    for case in checks.attention_cases(gpu_sweep=True):
        for d in (torch.float16, torch.bfloat16):
            tasks += [("attention", (case, d)), ("decode_splits", (case, d, 7))]
    return tasks


def check_engine_greedy() -> float:
    """The built-in model in float32 on CUDA: greedy ids with the Triton backend, replayed from
    CUDA graphs (batches padded to captured sizes) and eager, equal the torch backend's."""
    from conveyor.runtime import LLM, SamplingParams

    prompts = [
        "Hello there, how are you doing today?",
        "The quick brown fox",
        "a" * 70,
        "Hi",
        "1 2 3 4",
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (24, 5, 17, 30, 9)
    ]
    ids = {}
    for name, kw in {
        "torch": {"attention_backend": "torch"},
        "triton-eager": {"attention_backend": "triton", "enforce_eager": True},
        "triton-graphs": {"attention_backend": "triton"},
    }.items():
        llm = LLM(
            "conveyor-tiny",
            dtype="float32",
            device="cuda",
            max_total_tokens=4096,
            chunked_prefill_size=64,
            max_running_requests=8,
            **kw,
        )
        assert (llm.engine.runner.cuda_graphs is not None) == (name == "triton-graphs")
        ids[name] = [r.token_ids for r in llm.generate(prompts, params)]
    assert ids["triton-eager"] == ids["torch"], (
        f"triton eager {ids['triton-eager']} != torch {ids['torch']}"
    )
    assert ids["triton-graphs"] == ids["torch"], (
        f"graphs {ids['triton-graphs']} != torch {ids['torch']}"
    )
    return 0.0


def run_kernel_check(task: tuple) -> dict:
    """One check in a worker process; never raises (the failure is the result)."""
    from conveyor.runtime.kernels import checks

    name, args = task
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: --smoke
    fn = {
        "store_kv": checks.check_store_kv,
        "rms_norm": checks.check_rms_norm,
        "rotary": checks.check_rotary,
        "silu_and_mul": checks.check_silu_and_mul,
        "attention": checks.check_attention_backend,
        "decode_splits": lambda case, dtype, splits: checks.check_decode_splits(
            case, dtype, device, splits
        ),
        "engine_greedy": check_engine_greedy,
    }[name]
    label = (
        name
        + ":"
        + ",".join(a.id if hasattr(a, "id") else str(a).removeprefix("torch.") for a in args)
    )
    started = time.monotonic()
    try:
        err = fn(*args) if name in ("decode_splits", "engine_greedy") else fn(*args, device)
        return {
            "check": label,
            "ok": True,
            "max_abs_err": err,
            "s": round(time.monotonic() - started, 2),
        }
    except Exception as exc:  # a failing kernel is a result to report, not a crash
        return {
            "check": label,
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}"[:2000],
            "s": round(time.monotonic() - started, 2),
        }


def stage_kernels(args) -> dict:
    tasks = kernel_tasks()
    if args.smoke:  # a few checks in the interpreter: proves the worker plumbing, not the kernels
        os.environ["TRITON_INTERPRET"] = "1"
        tasks = [t for t in tasks if t[0] in ("store_kv", "silu_and_mul")][:4]
    started = time.monotonic()
    results: list[dict] = []
    # Spawned workers: CUDA cannot be forked, and each compiles its share of the kernels.
    with ProcessPoolExecutor(args.kernel_workers, mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(run_kernel_check, t) for t in tasks]
        done, pending = wait(futures, timeout=args.kernel_timeout)
        for f in pending:
            f.cancel()
        results = [f.result() for f in futures if f in done]
    failed = [r for r in results if not r["ok"]]
    return {
        "checks": len(tasks),
        "run": len(results),
        "passed": len(results) - len(failed),
        "failed": failed,
        "not_run": len(tasks) - len(results),
        "seconds": round(time.monotonic() - started, 1),
        "results": results,
    }


# -- stage 2: decode step time and MBU ------------------------------------------------------


def write_model_dir(path: Path, config: dict) -> Path:
    """config.json + the built-in byte-level tokenizer (small: the model's vocab stays as is)."""
    from conveyor.runtime.model.builtin import _write_config, _write_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(path, {**config, "vocab_size": 320})
    _write_config(path, config)
    return path


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
    from conveyor.runtime.config import EngineSettings
    from conveyor.runtime.engine.llm_engine import LLMEngine

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
    times.sort()
    return times[len(times) // 2]


def peak_bandwidth(device: str) -> float:
    if device != "cuda":
        return 50e9  # a nominal figure for --smoke
    name = torch.cuda.get_device_name()
    for key, value in PEAK_BANDWIDTH.items():
        if key in name:
            return value
    raise SystemExit(f"unknown peak bandwidth for {name!r}: pass --peak-bandwidth BYTES_PER_S")


# -- stage 3: the seed comparison on the GPU ----------------------------------------------


def stage_offline(args, workdir: Path) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from conveyor.bench.engine import offline

    shape = TINY if args.smoke else LLAMA_1B
    model_dir = write_model_dir(workdir / "llama-1b-shape", shape)
    started = time.monotonic()
    device = "cpu" if args.smoke else "cuda"
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(model_dir), dtype=torch.bfloat16
        )
    hf.save_pretrained(model_dir)  # random weights, so both engines load the same ones
    del hf
    saved = time.monotonic() - started
    out_json = workdir / "offline.json"
    argv = [
        "--model",
        str(model_dir),
        "--compare",
        "--json",
        str(out_json),
        "--sweep",
        "",
        "--device",
        device,
        "--dtype",
        "bfloat16" if not args.smoke else "float32",
        *args.offline_args.split(),
    ]
    print(f"[offline] conveyor bench offline {' '.join(argv)}", file=sys.stderr)
    rc = offline.main(argv)
    result = json.loads(out_json.read_text()) if out_json.exists() else {}
    modes = {m["mode"]: m for m in result.get("modes", [])}
    cont = modes.get("continuous", {}).get("output_throughput")
    ratios = {
        f"continuous/{k}": cont / m["output_throughput"]
        for k, m in modes.items()
        if cont and k != "continuous" and m.get("output_throughput")
    }
    return {"rc": rc, "weights_saved_s": round(saved, 1), "argv": argv, "ratios": ratios, **result}


# -- stage 4: the plot -------------------------------------------------------------------


def stage_plot(decode: dict, path: Path) -> dict:
    rows = [r for r in decode.get("rows", []) if "step_ms" in r]
    if not rows:
        return {"skipped": "no decode rows"}
    batch = [r["batch"] for r in rows]
    step = [r["step_ms"] for r in rows]
    mbu = [100 * r["mbu_step"] for r in rows]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        write_png_plot(path, batch, step, mbu)
        return {
            "png": str(path),
            "renderer": "built-in (no matplotlib): left step ms, right MBU %, "
            "x = log2 batch; no text",
        }
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(batch, step, "o-")
    a.set(
        xscale="log",
        xlabel="batch size",
        ylabel="decode step (ms)",
        title=f"{decode.get('model')}, {decode.get('dtype', '').removeprefix('torch.')}",
    )
    b.plot(batch, mbu, "o-", color="tab:green")
    b.axhline(60, ls="--", color="grey")
    b.set(
        xscale="log",
        xlabel="batch size",
        ylabel="MBU (%)",
        ylim=(0, 100),
        title=f"context {decode.get('context_len')} tokens per sequence",
    )
    for ax in (a, b):
        ax.minorticks_off()
        ax.set_xticks(batch, [str(x) for x in batch])
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return {"png": str(path), "renderer": "matplotlib"}


def write_png_plot(path: Path, xs: list[int], left: list[float], right: list[float]) -> None:
    """Two panels of dots joined by lines on a log2 x axis, as a PNG: no plotting library."""
    w, h, pad = 400, 300, 20
    img = [[(255, 255, 255)] * (2 * w) for _ in range(h)]

    def panel(x0: int, ys: list[float], top: float, color: tuple[int, int, int]) -> None:
        lx = [math.log2(x) for x in xs]
        span = (max(lx) - min(lx)) or 1.0
        pts = [
            (
                x0 + pad + int((v - min(lx)) / span * (w - 2 * pad)),
                h - pad - int(y / top * (h - 2 * pad)),
            )
            for v, y in zip(lx, ys, strict=True)
        ]
        for i in range(pad, w - pad):  # axes
            img[h - pad][x0 + i] = (0, 0, 0)
        for j in range(pad, h - pad + 1):
            img[j][x0 + pad] = (0, 0, 0)
        for (ax, ay), (bx, by) in itertools.pairwise(pts):
            n = max(abs(bx - ax), abs(by - ay), 1)
            for k in range(n + 1):
                img[ay + (by - ay) * k // n][ax + (bx - ax) * k // n] = color
        for px, py in pts:
            for dx in range(-2, 3):
                for dy in range(-2, 3):
                    img[py + dy][px + dx] = color

    panel(0, left, max(left) * 1.1, (31, 119, 180))
    panel(w, right, 100.0, (44, 160, 44))
    raw = b"".join(b"\x00" + bytes(c for px in row for c in px) for row in img)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 2 * w, h, 8, 2, 0, 0, 0))
    path.write_bytes(png + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


# -- driver -----------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="conveyor bench gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out",
        default=os.environ.get("OUT") or "gpu-bench-out",
        help="folder for gpu_bench.json, offline.json and the PNG (default: $OUT)",
    )
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {STAGES}")
    p.add_argument(
        "--batch-sizes",
        default="1,2,4,8,16,32,64,128,256",
        help="comma-separated decode batch sizes for the step-time stage",
    )
    p.add_argument(
        "--context-len", type=int, default=1024, help="tokens in each decoding sequence's context"
    )
    p.add_argument(
        "--steps", type=int, default=20, help="timed decode steps per batch size (median)"
    )
    p.add_argument(
        "--peak-bandwidth",
        type=float,
        default=None,
        help="GPU peak memory bandwidth in bytes/s (default: by device name; H200 4.8e12)",
    )
    p.add_argument(
        "--kernel-workers",
        type=int,
        default=min(12, os.cpu_count() or 1),
        help="processes running the kernel checks in parallel (default: cores, at most 12)",
    )
    p.add_argument(
        "--kernel-timeout",
        type=float,
        default=100.0,
        help="seconds for the kernel stage; checks not finished by then are reported as not run",
    )
    p.add_argument(
        "--offline-args",
        default="",
        help="extra flags for conveyor bench offline (e.g. '--num-requests 256')",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes on CPU, torch backend, four kernel checks in the interpreter: "
        "checks this script itself on a machine without a GPU",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import triton

    if not args.smoke and not torch.cuda.is_available():
        print(
            "conveyor bench gpu needs a CUDA device (or --smoke for a dry run on CPU)",
            file=sys.stderr,
        )
        return 2
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stages = [s for s in args.stages.split(",") if s]
    doc: dict = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else platform.processor() or "cpu",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "triton": triton.__version__,
        },
        "stages": {},
    }

    def report(name: str, value: dict) -> None:
        doc["stages"][name] = value
        (out / "gpu_bench.json").write_text(json.dumps(doc, indent=2, default=str))

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="conveyor-gpu-") as tmp:
        workdir = Path(tmp)
        for stage in STAGES:
            if stage not in stages:
                continue
            print(f"== {stage} ({time.monotonic() - t0:.0f}s in)", file=sys.stderr)
            started = time.monotonic()
            try:
                if stage == "kernels":
                    result = stage_kernels(args)
                elif stage == "decode":
                    result = stage_decode(args, workdir, lambda partial: report("decode", partial))
                elif stage == "offline":
                    result = stage_offline(args, workdir)
                    if (workdir / "offline.json").exists():
                        (out / "offline.json").write_text((workdir / "offline.json").read_text())
                else:
                    result = stage_plot(doc["stages"].get("decode", {}), out / "decode_mbu.png")
            except Exception:  # one stage failing must not lose the others' figures
                result = {"error": traceback.format_exc()[-4000:]}
                print(result["error"], file=sys.stderr)
            result["stage_s"] = round(time.monotonic() - started, 1)
            report(stage, result)
            print(f"== {stage} done in {result['stage_s']}s", file=sys.stderr)
    print(summary(doc))
    return 0 if all("error" not in v for v in doc["stages"].values()) else 1


def summary(doc: dict) -> str:
    lines = [f"device: {doc['device']}  versions: {doc['versions']}"]
    k = doc["stages"].get("kernels")
    if k and "checks" in k:
        lines.append(
            f"kernels: {k['passed']}/{k['checks']} passed, {len(k['failed'])} failed, "
            f"{k['not_run']} not run ({k['seconds']}s)"
        )
    d = doc["stages"].get("decode", {})
    for r in d.get("rows", []):
        if "step_ms" in r:
            lines.append(
                f"decode batch {r['batch']:>4}: {r['step_ms']:7.2f} ms/step  MBU {r['mbu_step']:6.1%} "
                f"(forward {r['forward_ms']:7.2f} ms, MBU {r['mbu_forward']:6.1%})"
            )
    o = doc["stages"].get("offline", {})
    for name, ratio in o.get("ratios", {}).items():
        lines.append(f"offline {name} throughput: {ratio:.2f}x")
    for name, v in doc["stages"].items():
        if "error" in v:
            lines.append(f"stage {name} FAILED: {v['error'].strip().splitlines()[-1]}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
