"""Stage ``kernels`` of ``conveyor bench gpu``: every Triton kernel against the torch
reference, and the engine's greedy output with the Triton backend, in worker processes."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, wait
from multiprocessing import get_context
from typing import Any, cast

import torch


def kernel_tasks() -> list[tuple]:
    from conveyor.runtime.kernels import checks

    tasks: list[tuple] = [("engine_greedy", ())]
    tasks += [("store_kv", (d,)) for d in checks.DTYPES]
    cases = cast(dict[str, list[tuple[Any, ...]]], checks.ELEMENTWISE_CASES)
    for d in checks.DTYPES:
        tasks += [("rms_norm", (*a, d)) for a in cases["rms_norm"]]
        tasks += [("rotary", (*a, d)) for a in cases["rotary"]]
        tasks += [("silu_and_mul", (*a, d)) for a in cases["silu_and_mul"]]
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
    backends: dict[str, dict[str, Any]] = {
        "torch": {"attention_backend": "torch"},
        "triton-eager": {"attention_backend": "triton", "enforce_eager": True},
        "triton-graphs": {"attention_backend": "triton"},
    }
    for name, kw in backends.items():
        llm = LLM(
            "conveyor-tiny",
            dtype="float32",
            device="cuda",
            max_total_tokens=4096,
            chunked_prefill_size=64,
            max_running_requests=8,
            **kw,
        )
        runner = llm.engine.runner
        assert (runner.cuda_graphs is not None) == (name == "triton-graphs")
        ids[name] = [r.token_ids for r in llm.generate(prompts, params)]
        if runner.piecewise_graphs is not None:  # the prompts' chunks ran in pieces
            assert runner.piecewise_graphs.replays > 0, "no step ran the piecewise graphs"
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
    by_name: dict[str, Callable[..., float]] = {
        "store_kv": checks.check_store_kv,
        "rms_norm": checks.check_rms_norm,
        "rotary": checks.check_rotary,
        "silu_and_mul": checks.check_silu_and_mul,
        "attention": checks.check_attention_backend,
        "decode_splits": lambda case, dtype, splits: checks.check_decode_splits(
            case, dtype, device, splits
        ),
        "engine_greedy": check_engine_greedy,
    }
    fn = by_name[name]
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
