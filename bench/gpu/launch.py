"""Stage ``launch`` of ``conveyor bench gpu``: what launching each kernel of an eager forward
costs the CPU.

A step that holds a prefill runs eagerly (decode-only steps replay CUDA graphs), and on the
H200 its forward took 12-22 ms for an 8B shape at any batch: launch-bound
(docs/profiles/gpu-engine-step.md). This times, per call, the Python side of each Triton
kernel the layers launch against the torch operation it replaces, on a decode-sized input
(8 tokens of the 8B shape), so the next change to the launch path can be measured: the
CPU microseconds of 300 calls (timed without waiting for the GPU; the queue holds them)
and the wall microseconds until the GPU has run them all.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

CALLS = 300


def stage_launch(args) -> dict:
    if args.smoke or not torch.cuda.is_available():
        return {"skipped": "times CUDA launches; nothing to time on CPU"}
    rows = []
    for name, call in launch_cases(torch.device("cuda")).items():
        for _ in range(20):
            call()  # compiled, cached
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(CALLS):
            call()
        launched = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
        rows.append(
            {
                "kernel": name,
                "cpu_us_per_call": round((launched - started) / CALLS * 1e6, 1),
                "wall_us_per_call": round((done - started) / CALLS * 1e6, 1),
            }
        )
    return {"rows": rows, "calls": CALLS, "tokens": TOKENS}


TOKENS = 8


def launch_cases(dev: torch.device) -> dict[str, Callable[[], object]]:
    """Each kernel an eager decoder layer launches, on 8 decoding tokens of the 8B shape
    (bfloat16 on a GPU; float32 elsewhere, for the kernels' tests under the interpreter)."""
    from conveyor.runtime.kernels.decode_attention import paged_decode_attention
    from conveyor.runtime.kernels.rmsnorm import rms_norm
    from conveyor.runtime.kernels.rotary import apply_rotary
    from conveyor.runtime.kernels.silu_and_mul import silu_and_mul
    from conveyor.runtime.kernels.store_kv import store_kv_cache

    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tokens, hidden, heads, kv_heads, head_dim, inter = TOKENS, 4096, 32, 8, 128, 14336
    blocks, block_size, context = 512, 16, 1024
    x = torch.randn(tokens, hidden, device=dev, dtype=dt)
    res = torch.randn_like(x)
    w = torch.ones(hidden, device=dev, dtype=dt)
    q = torch.randn(tokens, heads, head_dim, device=dev, dtype=dt)
    k = torch.randn(tokens, kv_heads, head_dim, device=dev, dtype=dt)
    cache = torch.zeros(blocks, block_size, kv_heads, head_dim, device=dev, dtype=dt)
    slots = torch.arange(tokens, device=dev, dtype=torch.int64)
    positions = torch.arange(tokens, device=dev, dtype=torch.int64) + context - 1
    cos = torch.randn(8192, head_dim, device=dev)
    sin = torch.randn(8192, head_dim, device=dev)
    per_seq = context // block_size
    tables = torch.arange(tokens * per_seq, device=dev, dtype=torch.int32).view(tokens, per_seq)
    lens = torch.full((tokens,), context, device=dev, dtype=torch.int32)
    gate_up = torch.randn(tokens, 2 * inter, device=dev, dtype=dt)
    weight = torch.randn(hidden, hidden, device=dev, dtype=dt)
    return {
        "triton rms_norm": lambda: rms_norm(x, w, 1e-5),
        "torch rms_norm": lambda: torch.nn.functional.rms_norm(x, (hidden,), w, 1e-5),
        "triton fused add + rms_norm": lambda: rms_norm(x, w, 1e-5, res),
        "triton rotary": lambda: apply_rotary(positions, q, k, cos, sin),
        "triton store_kv": lambda: store_kv_cache(k, k, cache, cache, slots),
        "triton decode attention": lambda: paged_decode_attention(
            q, cache, cache, tables, lens, head_dim**-0.5
        ),
        "triton silu_and_mul": lambda: silu_and_mul(gate_up),
        "torch silu * mul": lambda: (
            torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        ),
        "torch linear 4096x4096": lambda: torch.nn.functional.linear(x, weight),
    }
