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
3. ``launch``: the CPU cost of launching each kernel of an eager forward, Triton's
   against the torch operations they replace (``launch.py``).
4. ``offline``: ``conveyor bench offline --compare`` on a 1B-shaped Llama
   (random weights saved once, so Hugging Face ``generate`` loads the same).
5. ``profile``: a warm engine's steps under cProfile on the 1B shape; the stats file
   (``engine_step.pstats``) comes back with the results (``profile.py``); then the same
   run unprofiled with and without piecewise CUDA graphs for the steps that hold a prefill.
6. ``tp``: tensor parallelism over two GPUs: greedy output at TP=2 against TP=1, and
   throughput and weights per rank at TP=1 and TP=2 for the 8B shape; on one GPU, an NCCL
   all-reduce captured in a CUDA graph against the same eagerly (``tensor_parallel.py``).
7. ``plot``: a PNG of step time and MBU against batch size (skipped without matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from conveyor.bench.gpu.decode import stage_decode
from conveyor.bench.gpu.kernels import stage_kernels
from conveyor.bench.gpu.launch import stage_launch
from conveyor.bench.gpu.plot import stage_plot
from conveyor.bench.gpu.profile import stage_profile
from conveyor.bench.gpu.shapes import LLAMA_1B, TINY, write_model_dir
from conveyor.bench.gpu.tensor_parallel import stage_tp

STAGES = ("kernels", "decode", "launch", "offline", "profile", "tp", "plot")


# -- stage 3: the scheduling comparison on the GPU ----------------------------------------


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
                elif stage == "launch":
                    result = stage_launch(args)
                elif stage == "offline":
                    result = stage_offline(args, workdir)
                    if (workdir / "offline.json").exists():
                        (out / "offline.json").write_text((workdir / "offline.json").read_text())
                elif stage == "profile":
                    result = stage_profile(args, workdir, out)
                elif stage == "tp":
                    result = stage_tp(args, workdir)
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
    for r in doc["stages"].get("launch", {}).get("rows", []):
        lines.append(
            f"launch {r['kernel']:<28} {r['cpu_us_per_call']:7.1f} us CPU, "
            f"{r['wall_us_per_call']:7.1f} us wall per call"
        )
    p = doc["stages"].get("profile", {})
    if "step_p50_ms" in p:
        lines.append(
            f"profile: {p['output_tok_s']} tok/s, step p50 {p['step_p50_ms']} ms "
            f"({p['step_p50_ms_profiled']} ms profiled); seconds in {p['seconds_in']}"
        )
        lines.append(
            f"profile: prefill steps eager {p['output_tok_s_prefill_steps_eager']} tok/s; "
            f"piecewise graphs / eager: {p['piecewise_over_eager']:.2f}x"
        )
    tp = doc["stages"].get("tp", {})
    if "skipped" in tp:
        lines.append(f"tp: skipped ({tp['skipped']})")
        if "nccl_all_reduce_in_cuda_graph" in tp:
            lines.append(
                f"tp: NCCL all-reduce in a CUDA graph: {tp['nccl_all_reduce_in_cuda_graph']}"
            )
    elif "rows" in tp:
        lines.append(
            f"tp: TP=2 greedy equals TP=1: {tp['tiny_greedy_equal']}; TP=2/TP=1 throughput "
            f"{tp['tp2_over_tp1_throughput']:.2f}x; "
            + ", ".join(
                f"TP={r['tp']} {r['output_tok_s']} tok/s, {r['weight_gib_rank0']} GiB on rank 0"
                for r in tp["rows"]
            )
        )
    for name, v in doc["stages"].items():
        if "error" in v:
            lines.append(f"stage {name} FAILED: {v['error'].strip().splitlines()[-1]}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
