"""The Kubernetes serving community's benchmark clients, as clients of ``conveyor bench peer``.

``guidellm`` (vLLM's project's benchmark client) and ``inference-perf`` (the Kubernetes
serving working group's) each drive a server with the peer bench's workload: ``num_prompts``
completions of ``input_len`` random tokens and exactly ``output_len`` output tokens
(``ignore_eos``), streamed, ``max_concurrency`` at a time, counted by the model's tokenizer.
Each is pinned in its own cached environment (``bench/pinned_env.py``): guidellm with its
torch (about 6 GB, minutes on a cold pip cache), inference-perf small but needing Python
3.12, which is looked for on PATH and under pyenv. Their own result files are read, and
their figures returned under the peer bench's names, in milliseconds: TPOT is the time
between output tokens after the first in both (guidellm's ``inter_token_latency_ms``,
inference-perf's ``time_per_output_token``), as ``vllm bench serve`` counts it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conveyor.bench import pinned_env
from conveyor.bench.pinned_env import PinnedTool

GUIDELLM = PinnedTool("guidellm", "0.8.1", command="guidellm")
INFERENCE_PERF = PinnedTool("inference-perf", "0.7.0", command="inference-perf", min_python=(3, 12))
TOOLS = {"guidellm": GUIDELLM, "inference-perf": INFERENCE_PERF}


def ensure(name: str, progress: Callable[[str], None]) -> Path:
    """The client's environment, installed first if needed (ToolInstallError says why not)."""
    return pinned_env.ensure(TOOLS[name], progress)


def run_client(
    name: str, venv: Path, args: argparse.Namespace, tokenizer: Path, url: str, model: str
) -> dict[str, Any]:
    """One run of client ``name`` against the server at ``url``; the peer bench's figures."""
    with tempfile.TemporaryDirectory(prefix=f"bench-peer-{name}-") as tmp:
        out = Path(tmp)
        if name == "guidellm":
            cmd = guidellm_command(venv, args, tokenizer, url, model, out / "result.json")
        else:
            cmd = inference_perf_command(venv, args, tokenizer, url, model, out)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
            raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{tail}")
        if name == "guidellm":
            return guidellm_figures(json.loads((out / "result.json").read_text()))
        return inference_perf_figures(
            json.loads((out / "summary_lifecycle_metrics.json").read_text())
        )


def guidellm_command(
    venv: Path, args: argparse.Namespace, tokenizer: Path, url: str, model: str, result: Path
) -> list[str]:
    return [
        str(pinned_env.executable(GUIDELLM, venv)), "run",
        "--backend", f"kind=openai_http,target={url},model={model},request_format=/v1/completions",
        "--profile", f"kind=concurrent,streams={args.max_concurrency}",
        "--constraint", f"kind=max_requests,count={args.num_prompts}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.input_len},"
                  f"output_tokens={args.output_len}",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
        "--output", f"kind=json,path={result}",
        "--disable-console",
    ]  # fmt: skip


def inference_perf_command(
    venv: Path, args: argparse.Namespace, tokenizer: Path, url: str, model: str, out: Path
) -> list[str]:
    def fixed(kind: str, n: int, count: int) -> list[str]:
        return [
            f"--data.{kind}_distribution.min", str(n), f"--data.{kind}_distribution.max", str(n),
            f"--data.{kind}_distribution.mean", str(n),
            f"--data.{kind}_distribution.std_dev", "0",
            f"--data.{kind}_distribution.total_count", str(count),
        ]  # fmt: skip

    stage = {"num_requests": args.num_prompts, "concurrency_level": args.max_concurrency}
    return [
        str(pinned_env.executable(INFERENCE_PERF, venv)),
        "--server.type", "vllm", "--server.model_name", model, "--server.base_url", url,
        "--server.ignore_eos", "true",
        "--api.type", "completion", "--api.streaming", "true",
        "--data.type", "random",
        *fixed("input", args.input_len, args.num_prompts),
        *fixed("output", args.output_len, args.num_prompts),
        "--load.type", "concurrent", "--load.stages", json.dumps([stage]),
        "--tokenizer.pretrained_model_name_or_path", str(tokenizer),
        "--storage.local_storage.path", str(out),
    ]  # fmt: skip


def guidellm_figures(doc: dict[str, Any]) -> dict[str, Any]:
    """guidellm's JSON report (its one benchmark) -> the peer bench's figures."""
    (bench,) = doc["benchmarks"]
    m = bench["metrics"]
    totals = m["request_totals"]
    ok = lambda name: m[name]["successful"]  # noqa: E731
    return {
        "completed": totals["successful"],
        "failed": totals["errored"] + totals["incomplete"],
        "output_tok_s": ok("output_token_count")["total_sum"] / bench["duration"],
        "ttft_p50_ms": ok("time_to_first_token_ms")["percentiles"]["p50"],
        "ttft_p95_ms": ok("time_to_first_token_ms")["percentiles"]["p95"],
        "tpot_p50_ms": ok("inter_token_latency_ms")["percentiles"]["p50"],
        "tpot_p95_ms": ok("inter_token_latency_ms")["percentiles"]["p95"],
    }


def inference_perf_figures(doc: dict[str, Any]) -> dict[str, Any]:
    """inference-perf's ``summary_lifecycle_metrics.json`` -> the peer bench's figures."""
    ok = doc["successes"]
    latency = ok["latency"]
    ms = lambda metric, q: 1000 * latency[metric][q]  # noqa: E731
    return {
        "completed": ok["count"],
        "failed": doc["failures"]["count"],
        "output_tok_s": ok["throughput"]["output_tokens_per_sec"],
        "ttft_p50_ms": ms("time_to_first_token", "median"),
        "ttft_p95_ms": ms("time_to_first_token", "p95"),
        "tpot_p50_ms": ms("time_per_output_token", "median"),
        "tpot_p95_ms": ms("time_per_output_token", "p95"),
    }
