#!/usr/bin/env bash
# The GPU benchmark (`conveyor bench gpu`) on a machine that has its own python3 with torch,
# triton and transformers but no pip: runs from this checkout, nothing is installed.
# Results (gpu_bench.json, offline.json, engine_step.pstats; decode_mbu.png where matplotlib is installed) go to
# $OUT, or ./gpu-bench-out.
#   bash bench/gpu.sh [--stages kernels,decode,launch,offline,profile,tp,plot] [--context-len 1024] ...
# (tp compares TP=2 with TP=1 where two GPUs are lent; on one it checks an NCCL all-reduce in a CUDA graph)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if [[ -z "${CONVEYOR_CACHE:-}" ]]; then  # the built-in model, made on the spot and removed after
  CONVEYOR_CACHE="$(mktemp -d -t conveyor-gpu-bench.XXXXXX)"
  trap 'rm -rf "$CONVEYOR_CACHE"' EXIT
  export CONVEYOR_CACHE
fi
"${PYTHON:-python3}" -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())'
"${PYTHON:-python3}" -m conveyor bench gpu --out "${OUT:-gpu-bench-out}" "$@"
