"""``conveyor bench gateway --peers``: the Rust routers' install steps and command lines, the
stub's pacing and the side-by-side summary, without a network or a router."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.bench import pinned_env
from conveyor.bench.gateway import report, routers
from conveyor.bench.gateway.command import _numbers
from conveyor.bench.gateway.stub import _pace


def test_router_commands_name_workers_policy_and_ports(tmp_path: Path) -> None:
    workers = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    vllm = routers.command(routers.VLLM_ROUTER, tmp_path, port=9000, workers=workers,
                           policy="consistent_hash", metrics_port=9001)  # fmt: skip
    assert vllm[0] == str(tmp_path / "bin" / "vllm-router")
    i = vllm.index("--worker-urls")
    assert vllm[i + 1 : i + 3] == workers
    assert vllm[vllm.index("--policy") + 1] == "consistent_hash"
    assert vllm[vllm.index("--port") + 1] == "9000"
    assert vllm[vllm.index("--prometheus-port") + 1] == "9001"
    assert vllm[vllm.index("--host") + 1] == "127.0.0.1"

    sglang = routers.command(routers.SGLANG_ROUTER, tmp_path, port=9000, workers=workers,
                             policy="cache_aware", metrics_port=9002)  # fmt: skip
    assert sglang[:2] == [str(tmp_path / "bin" / "sglang-router"), "launch"]
    assert sglang[sglang.index("--log-level") + 1] == "warn"


def test_router_command_refuses_what_the_router_cannot_do(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no policy 'consistent_hash'"):
        routers.command(routers.SGLANG_ROUTER, tmp_path, port=1, workers=["http://x:1"],
                        policy="consistent_hash", metrics_port=2)  # fmt: skip
    with pytest.raises(ValueError, match="at least one worker"):
        routers.command(routers.VLLM_ROUTER, tmp_path, port=1, workers=[],
                        policy="cache_aware", metrics_port=2)  # fmt: skip


def test_parse_peers() -> None:
    assert routers.parse_peers("") == []
    assert routers.parse_peers("vllm-router, sglang-router,vllm-router") == [
        routers.VLLM_ROUTER,
        routers.SGLANG_ROUTER,
    ]
    with pytest.raises(ValueError, match=r"unknown peer 'nginx'.*vllm-router, sglang-router"):
        routers.parse_peers("vllm-router,nginx")


def test_install_is_pinned_and_wheels_only(tmp_path: Path) -> None:
    venv = routers.env_dir(routers.VLLM_ROUTER, tmp_path)
    assert venv == tmp_path / "vllm-router-0.1.17"
    create, install = pinned_env.install_commands(routers.VLLM_ROUTER.tool, venv, "python3")
    assert create == ["python3", "-m", "venv", "--clear", str(venv)]
    assert install[0] == str(venv / "bin" / "python")
    assert "vllm-router==0.1.17" in install
    assert install[install.index("--only-binary") + 1] == ":all:"


def _installed(router: routers.RustRouter, root: Path) -> Path:
    venv = routers.env_dir(router, root)
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / router.name).write_text("#!/bin/sh\n")
    (venv / pinned_env.STAMP).write_text(router.requirement + "\n")
    return venv


def test_ensure_reuses_a_complete_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    venv = _installed(routers.SGLANG_ROUTER, tmp_path)

    def no_subprocess(*args: object, **kwargs: object) -> None:
        raise AssertionError("nothing may run for a complete environment")

    monkeypatch.setattr(subprocess, "Popen", no_subprocess)
    said: list[str] = []
    assert routers.ensure(routers.SGLANG_ROUTER, said.append, root=tmp_path) == venv
    assert said == [f"sglang-router==0.3.2 already installed: {venv}"]


def test_ensure_redoes_an_environment_of_another_version(tmp_path: Path) -> None:
    venv = _installed(routers.VLLM_ROUTER, tmp_path)
    (venv / pinned_env.STAMP).write_text("vllm-router==0.1.16\n")
    assert not routers.is_installed(routers.VLLM_ROUTER, venv)


def test_a_failed_install_says_why_and_leaves_no_stamp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing = [sys.executable, "-c",
               "import sys; print('Collecting vllm-router==0.1.17'); print('no wheel'); sys.exit(3)"]  # fmt: skip
    monkeypatch.setattr(pinned_env, "install_commands", lambda tool, venv: [failing])
    said: list[str] = []
    with pytest.raises(routers.RouterInstallError, match=r"exit 3(.|\n)*no wheel"):
        routers.ensure(routers.VLLM_ROUTER, said.append, root=tmp_path)
    assert "  Collecting vllm-router==0.1.17" in said
    assert not (routers.env_dir(routers.VLLM_ROUTER, tmp_path) / pinned_env.STAMP).exists()


def test_stub_pace_comes_from_the_prompt() -> None:
    assert _pace("pace 1000", 0.0) == 1000.0
    assert _pace("pace soon", 5.0) == 5.0
    assert _pace("x", 5.0) == 5.0
    assert _pace(["pace 10"], 0.0) == 0.0


def test_numbers_option() -> None:
    assert _numbers("16, 200", "--x") == [16, 200]
    with pytest.raises(ValueError, match="--max-streams takes comma-separated whole numbers"):
        _numbers("1000,lots", "--max-streams")


def test_summary_puts_conveyor_over_the_best_peer() -> None:
    proxies = ["conveyor", "vllm-router", "sglang-router"]
    overhead: report.Overhead = {
        200: {
            "conveyor": {"whole_added_p50": 0.002, "whole_added_p99": 0.004,
                         "ttft_added_p50": 0.001, "ttft_added_p99": 0.003},
            "vllm-router": {"whole_added_p50": 0.001, "whole_added_p99": 0.002,
                            "ttft_added_p50": 0.001, "ttft_added_p99": 0.001},
            "sglang-router": {"whole_added_p50": 0.004, "whole_added_p99": 0.008,
                              "ttft_added_p50": 0.040, "ttft_added_p99": 0.050},
        }
    }  # fmt: skip
    held = {"direct": 6000, "conveyor": 4000, "vllm-router": 2000, "sglang-router": 1000}
    base = {"ttft_p95": 1.0, "req_s": 1.0, "hit": 0.5, "spread": 1.0}
    routing: report.Routing = {
        "conveyor round-robin": {**base, "ttft_p50": 0.9},
        "conveyor prefix-aware": {**base, "ttft_p50": 0.4, "req_s": 3.0},
        "vllm-router cache_aware": {**base, "ttft_p50": 0.5, "req_s": 2.0},
        "vllm-router consistent_hash": {**base, "ttft_p50": 0.8},
        "sglang-router cache_aware": {**base, "ttft_p50": 0.6},
    }
    lines = report.summary(proxies, overhead, held, routing).splitlines()

    def row(metric: str) -> list[str]:
        return next(re.split(r"\s{2,}", line) for line in lines if line.startswith(metric))

    assert row("added p99 ms, non-streamed, 200 streams")[1:] == [
        "+4.00", "+2.00", "+8.00", "2.00x", "<= +2 ms, <= 2x peer",
    ]  # fmt: skip
    assert row("added p99 ms, streamed TTFT")[1:5] == ["+3.00", "+1.00", "+50.00", "3.00x"]
    assert row("most streams held")[1:] == ["4000", "2000", "1000", "2.00x", ">= 4000"]
    # the gateway's prefix-aware against the best policy of the best peer (500 ms)
    assert row("routing: TTFT p50 ms")[1:5] == ["400", "500", "600", "0.80x"]
    assert row("routing: req/s")[1:5] == ["3.00", "2.00", "1.00", "1.50x"]
    assert row("routing: policy")[-1] == (
        "conveyor: prefix-aware, vllm-router: cache_aware, sglang-router: cache_aware"
    )
