"""``conveyor bench peer --clients guidellm,inference-perf``: each community client is pinned in
its own environment with a Python new enough for it, given the peer bench's workload, and read
back into the peer bench's figures (from result documents shaped as each tool writes them)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from conveyor.bench import pinned_env
from conveyor.bench.peers import clients
from conveyor.bench.pinned_env import PinnedTool, ToolInstallError

ARGS = argparse.Namespace(num_prompts=64, input_len=128, output_len=32, max_concurrency=8)
TOKENIZER = Path("/models/smollm2")


def test_guidellm_gets_the_workload_as_completions_at_a_fixed_concurrency(tmp_path: Path):
    cmd = clients.guidellm_command(
        tmp_path, ARGS, TOKENIZER, "http://127.0.0.1:9", "m", tmp_path / "r.json"
    )
    assert cmd[:2] == [str(tmp_path / "bin" / "guidellm"), "run"]
    opts = dict(zip(cmd[2::2], cmd[3::2], strict=False))
    assert "request_format=/v1/completions" in opts["--backend"]
    assert "target=http://127.0.0.1:9" in opts["--backend"] and "model=m" in opts["--backend"]
    assert opts["--profile"] == "kind=concurrent,streams=8"
    assert opts["--constraint"] == "kind=max_requests,count=64"
    assert opts["--data"] == "kind=synthetic_text,prompt_tokens=128,output_tokens=32"
    assert opts["--tokenizer"] == f"kind=huggingface_auto,model={TOKENIZER}"


def test_inference_perf_gets_fixed_lengths_and_a_concurrent_stage(tmp_path: Path):
    cmd = clients.inference_perf_command(tmp_path, ARGS, TOKENIZER, "http://h:9", "m", tmp_path)
    opts = dict(zip(cmd[1::2], cmd[2::2], strict=False))
    assert opts["--server.ignore_eos"] == "true" and opts["--api.streaming"] == "true"
    assert opts["--api.type"] == "completion"
    for kind, n in (("input", "128"), ("output", "32")):
        assert opts[f"--data.{kind}_distribution.min"] == opts[f"--data.{kind}_distribution.max"]
        assert opts[f"--data.{kind}_distribution.mean"] == n
        assert opts[f"--data.{kind}_distribution.std_dev"] == "0"
    assert json.loads(opts["--load.stages"]) == [{"num_requests": 64, "concurrency_level": 8}]


def _dist(**percentiles: float) -> dict:
    return {"mean": 0.0, "percentiles": percentiles, "total_sum": 0.0}


def test_guidellm_figures_take_inter_token_latency_as_tpot():
    metrics = {
        "request_totals": {"successful": 62, "errored": 1, "incomplete": 1, "total": 64},
        "output_token_count": {"successful": {"total_sum": 1984.0}},
        "time_to_first_token_ms": {"successful": _dist(p50=120.0, p95=300.0)},
        "inter_token_latency_ms": {"successful": _dist(p50=40.0, p95=55.0)},
        "time_per_output_token_ms": {"successful": _dist(p50=99.0, p95=99.0)},
    }
    doc = {"benchmarks": [{"metrics": metrics, "duration": 8.0}]}
    assert clients.guidellm_figures(doc) == {
        "completed": 62, "failed": 2, "output_tok_s": 248.0, "ttft_p50_ms": 120.0,
        "ttft_p95_ms": 300.0, "tpot_p50_ms": 40.0, "tpot_p95_ms": 55.0,
    }  # fmt: skip


def test_inference_perf_figures_are_in_milliseconds():
    latency = {
        "time_to_first_token": {"median": 0.12, "p95": 0.3},
        "time_per_output_token": {"median": 0.04, "p95": 0.055},
    }
    doc = {
        "successes": {"count": 64, "latency": latency,
                      "throughput": {"output_tokens_per_sec": 250.5}},
        "failures": {"count": 0},
    }  # fmt: skip
    figures = clients.inference_perf_figures(doc)
    assert figures["completed"] == 64 and figures["failed"] == 0
    assert figures["output_tok_s"] == 250.5
    assert figures["ttft_p50_ms"] == pytest.approx(120.0)
    assert figures["tpot_p95_ms"] == pytest.approx(55.0)


def test_a_tool_gets_a_python_new_enough_or_a_message_saying_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    assert pinned_env.find_python(PinnedTool("t", "1", "t")) == sys.executable
    # on PATH for every version, as pyenv's shims are, but it does not run: passed over
    shim = tmp_path / "shim"
    shim.write_text("#!/bin/sh\necho 'pyenv: python3.99: command not found' >&2\nexit 127\n")
    shim.chmod(0o755)
    monkeypatch.setattr(pinned_env.shutil, "which", lambda name: str(shim))
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path))
    future = PinnedTool("t", "1", "t", min_python=(3, 99))
    with pytest.raises(ToolInstallError, match=r"needs Python >= 3.99.*install one"):
        pinned_env.find_python(future)
    interpreter = tmp_path / "versions" / "3.99.1" / "bin" / "python"
    interpreter.parent.mkdir(parents=True)
    interpreter.write_text("")
    assert pinned_env.find_python(future) == str(interpreter)
    create, install = pinned_env.install_commands(future, tmp_path / "venv")
    assert create[0] == str(interpreter) and "t==1" in install
