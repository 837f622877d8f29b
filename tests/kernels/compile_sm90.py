"""Compile every kernel for sm_90 (H100/H200) with Triton's bundled ptxas, no GPU needed.

Run in a fresh process (``test_kernel_compile.py``): the interpreter, which the
other tests use on CPU, never lowers a kernel, so it cannot see a kernel that
fails to compile, and it runs bfloat16 dots in float32. This lowers the real
thing, tensor-core bfloat16/float16 dots included, for the shapes the engine
launches. Prints one line per kernel; exits non-zero on the first failure.
"""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from conveyor.runtime.kernels import (
    decode_attention,
    fused_moe,
    gelu_and_mul,
    prefill_attention,
    rmsnorm,
    rotary,
    silu_and_mul,
    store_kv,
)

TARGET = GPUTarget("cuda", 90, 32)


def compile_kernel(fn, types: dict[str, str], constants: dict, num_warps: int = 4) -> int:
    """Lower ``fn`` to a cubin; ``types`` for the runtime arguments ('*bf16', 'i32', 'fp32')."""
    signature = {name: "constexpr" if name in constants else types[name] for name in fn.arg_names}
    kernel = triton.compile(
        ASTSource(fn, signature, constexprs=constants),
        target=TARGET,
        options={"num_warps": num_warps, "num_stages": 2},
    )
    return len(kernel.asm["cubin"])


def i32(*names: str) -> dict[str, str]:
    return dict.fromkeys(names, "i32")


def main() -> int:
    for dt in ("bf16", "fp16", "fp32"):
        precision = "ieee" if dt == "fp32" else None
        # Every GQA/head-dim/page shape in bfloat16 (the serving dtype), one in the others;
        # Gemma's head dim 256, uncapped (Gemma 3) and with soft-capped scores (Gemma 2).
        shapes = (
            (1, 64, 1, False),
            (4, 128, 16, False),
            (7, 64, 32, False),
            (8, 128, 16, False),
            (2, 256, 16, False),
            (2, 256, 16, True),
        )
        for group, head_dim, page, softcap in shapes if dt == "bf16" else shapes[1:2]:
            cache = {"k_cache_ptr": f"*{dt}", "v_cache_ptr": f"*{dt}", "block_tables_ptr": "*i32"}
            tiles = {"GROUP": group, "HEAD_DIM": head_dim, "PAGE_SIZE": page, "BLOCK_D": head_dim}
            tiles |= {"SOFTCAP": softcap, "DOT_FP32": False, "PRECISION": precision}
            n1 = compile_kernel(
                decode_attention._decode_stage1_kernel,
                {
                    "q_ptr": f"*{dt}",
                    **cache,
                    "context_lens_ptr": "*i32",
                    "o_part_ptr": "*fp32",
                    "lse_ptr": "*fp32",
                    "scale": "fp32",
                    "softcap": "fp32",
                    **i32(
                        "stride_qt",
                        "stride_qh",
                        "stride_bt",
                        "stride_slot",
                        "stride_ob",
                        "stride_oh",
                        "stride_os",
                        "stride_lb",
                        "stride_lh",
                        "num_splits",
                        "window",
                    ),
                },
                {
                    **tiles,
                    "BLOCK_H": max(16, triton.next_power_of_2(group)),
                    "BLOCK_N": decode_attention.BLOCK_N,
                },
            )
            n2 = compile_kernel(
                decode_attention._decode_stage2_kernel,
                {
                    "o_part_ptr": "*fp32",
                    "lse_ptr": "*fp32",
                    "out_ptr": f"*{dt}",
                    **i32(
                        "stride_ob",
                        "stride_oh",
                        "stride_os",
                        "stride_lb",
                        "stride_lh",
                        "stride_outt",
                        "stride_outh",
                        "num_splits",
                    ),
                },
                {"HEAD_DIM": head_dim, "BLOCK_S": decode_attention.MAX_SPLITS, "BLOCK_D": head_dim},
                num_warps=2,
            )
            n3 = compile_kernel(
                prefill_attention._prefill_kernel,
                {
                    "q_ptr": f"*{dt}",
                    **cache,
                    "query_start_ptr": "*i32",
                    "context_lens_ptr": "*i32",
                    "out_ptr": f"*{dt}",
                    "scale": "fp32",
                    "softcap": "fp32",
                    **i32(
                        "stride_qt",
                        "stride_qh",
                        "stride_bt",
                        "stride_slot",
                        "stride_ot",
                        "stride_oh",
                        "window",
                    ),
                },
                {
                    **tiles,
                    "BLOCK_M": prefill_attention.BLOCK_M,
                    "BLOCK_N": prefill_attention.BLOCK_N,
                },
            )
            print(
                f"{dt} group {group} head_dim {head_dim} page {page}"
                + (" softcap" if softcap else "")
                + f": decode {n1}+{n2} B, prefill {n3} B"
            )
        act = {"x_ptr": f"*{dt}", "out_ptr": f"*{dt}"}
        norm = {
            **act,
            "res_ptr": f"*{dt}",
            "w_ptr": f"*{dt}",
            "res_out_ptr": f"*{dt}",
            "stride_x": "i32",
            "stride_res": "i32",
            "eps": "fp32",
        }
        sizes = [
            compile_kernel(
                store_kv._store_kv_kernel,
                {
                    "k_ptr": f"*{dt}",
                    "v_ptr": f"*{dt}",
                    "k_cache_ptr": f"*{dt}",
                    "v_cache_ptr": f"*{dt}",
                    "slot_ptr": "*i64",
                    **i32("stride_kt", "stride_vt"),
                },
                {"ROW": 1024, "BLOCK": 1024},
            ),
            compile_kernel(
                rotary._rotary_kernel,
                {
                    "q_ptr": f"*{dt}",
                    "k_ptr": f"*{dt}",
                    "cos_ptr": "*fp32",
                    "sin_ptr": "*fp32",
                    "pos_ptr": "*i64",
                    **i32("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_cos"),
                },
                {"NUM_Q_HEADS": 32, "NUM_KV_HEADS": 8, "HALF": 64, "BLOCK_H": 32, "BLOCK_HALF": 64},
            ),
            *(
                compile_kernel(
                    rmsnorm._rmsnorm_kernel,
                    {**norm, "w_ptr": f"*{dt}" if rounded else "*fp32"},
                    {"N": 4096, "BLOCK": 4096, "HAS_RESIDUAL": r, "ROUND_NORMED": rounded},
                    num_warps=16,
                )
                for r in (False, True)
                for rounded in (True, False)  # Llama's norm, Gemma's (a float32 weight)
            ),
            compile_kernel(
                silu_and_mul._silu_and_mul_kernel,
                {**act, "stride_x": "i32"},
                {"N": 14336, "BLOCK": 1024},
            ),
            compile_kernel(
                gelu_and_mul._gelu_tanh_and_mul_kernel,
                {**act, "stride_x": "i32"},
                {"N": 14336, "BLOCK": 1024},
            ),
        ]
        print(f"{dt} store_kv, rotary, rms_norm (x2), silu_and_mul, gelu_tanh_and_mul: {sizes} B")
        # Mixtral's experts (H 4096, I 14336): the gate/up GEMM with decode's blocks, the
        # down GEMM, weighted into float32, with prefill's.
        gemm = {
            "a_ptr": f"*{dt}",
            "w_ptr": f"*{dt}",
            "topk_weights_ptr": "*fp32",
            "sorted_slots_ptr": "*i32",
            "block_experts_ptr": "*i32",
            **i32("num_slots", "stride_am", "stride_we", "stride_wn", "stride_om"),
        }
        tiles = {"NUM_EXPERTS": 8, "BLOCK_N": fused_moe.BLOCK_N, "BLOCK_K": fused_moe.BLOCK_K}
        tiles |= {"DOT_FP32": False, "PRECISION": precision}
        sizes = [
            compile_kernel(
                fused_moe._moe_gemm_kernel,
                {**gemm, "out_ptr": f"*{dt}"},
                {
                    **tiles,
                    "topk_weights_ptr": None,
                    "N": 2 * 14336,
                    "K": 4096,
                    "SLOTS_PER_ROW": 2,
                    "WEIGHTED": False,
                    "BLOCK_M": 16,
                },
            ),
            compile_kernel(
                fused_moe._moe_gemm_kernel,
                {**gemm, "out_ptr": "*fp32"},
                {
                    **tiles,
                    "N": 4096,
                    "K": 14336,
                    "SLOTS_PER_ROW": 1,
                    "WEIGHTED": True,
                    "BLOCK_M": 64,
                },
            ),
        ]
        print(f"{dt} fused_moe gate/up, down: {sizes} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
