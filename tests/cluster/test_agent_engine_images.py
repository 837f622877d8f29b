"""The node agent's image map: vLLM's image runs as vLLM for CPU from its cached environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.bench.peers import vllm_env
from conveyor.cluster import agent_settings
from conveyor.cluster.agent_settings import AgentSettings, default_images
from conveyor.cluster.podspec import ConfigError, image_name, image_path
from conveyor.operator.engines import VLLM_IMAGE


def test_vllm_image_maps_to_the_vllm_environment_once_installed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path))
    assert image_name(VLLM_IMAGE) == agent_settings.VLLM_IMAGE  # the operator's default image
    with pytest.raises(ConfigError, match="not one this node agent can run"):
        image_path(VLLM_IMAGE, default_images())  # not installed: ErrImagePull, said so
    venv = vllm_env.env_dir()
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "vllm").write_text("#!/bin/sh\n")
    (venv / vllm_env.STAMP).write_text("done\n")
    settings = AgentSettings(work_dir=tmp_path)
    path = image_path(VLLM_IMAGE, settings.images)
    assert path.split(":")[0] == str(venv / "bin")
    assert settings.entrypoints[agent_settings.VLLM_IMAGE] == ("vllm", "serve")
    env = settings.image_env[agent_settings.VLLM_IMAGE]
    assert env["VLLM_TARGET_DEVICE"] == "cpu"
    assert float(env["VLLM_CPU_KVCACHE_SPACE"]) > 0
    assert env["VLLM_CPU_OMP_THREADS_BIND"].startswith("0-")
    assert "conveyor" not in settings.image_env  # only images that set an environment
