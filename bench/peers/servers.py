"""The servers ``conveyor bench peer`` measures, Conveyor and vLLM for CPU, and the peak RSS
of each one's process tree."""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path

from conveyor.bench.peers import vllm_env
from conveyor.bench.procs import ChildProcess, conveyor_serve

SERVED_NAME = "peer-model"
"""The model name both servers serve, so both are driven by the same requests."""


class RssSampler:
    """The peak resident memory of a child's whole process tree, sampled twice a second."""

    def __init__(self, child: ChildProcess) -> None:
        self.child = child
        self.peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                root = psutil.Process(self.child.pid)
                procs = [root, *root.children(recursive=True)]
                rss = sum(p.memory_info().rss for p in procs if p.is_running())
                self.peak_rss = max(self.peak_rss, rss)
            except psutil.Error:
                pass  # the process tree changed under the sample: the next one counts
            self._stop.wait(0.5)


def _log(log_dir: Path, name: str) -> Path:
    return log_dir / f"{name}-{int(time.time())}.log"


def conveyor_server(args: argparse.Namespace, path: Path, log_dir: Path) -> ChildProcess:
    """``conveyor serve`` on the port it binds and reports."""
    flags = [
        "--model", str(path), "--served-model-name", SERVED_NAME, "--dtype", args.dtype,
        "--max-running-requests", str(args.max_running_requests),
        "--cpu-kv-cache-bytes", str(int(args.kv_cache_gib * (1 << 30))),
        "--log-stats-interval", "0", *args.conveyor_arg,
    ]  # fmt: skip
    return conveyor_serve(
        flags,
        ready_timeout=args.startup_timeout,
        log_path=_log(log_dir, "conveyor"),
    )


def vllm_server(args: argparse.Namespace, venv: Path, path: Path, log_dir: Path) -> ChildProcess:
    """``vllm serve`` from the peer's own environment, on a free port."""
    cores = len(os.sched_getaffinity(0))
    env = {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": f"{args.kv_cache_gib:g}",
        # By default vLLM computes on all cores but one; given all of them it is faster here.
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
    }

    def command(port: int) -> list[str]:
        return [
            str(vllm_env.vllm_command(venv)), "serve", str(path), "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", SERVED_NAME, "--dtype", args.dtype,
            "--max-num-seqs", str(args.max_running_requests), *args.vllm_arg,
        ]  # fmt: skip

    return ChildProcess(
        "vllm",
        command,
        ready_path="/health",
        ready_timeout=args.startup_timeout,
        env=env,
        log_path=_log(log_dir, "vllm"),
    )
