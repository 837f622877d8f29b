"""Fixtures shared by the cluster's tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conveyor.cluster.image_plan import DEPS_INPUTS, STEPS_SCRIPT, VLLM_DOCKERFILE, source_paths

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def image_repo(tmp_path: Path) -> Path:
    """A copy of what the image is built from (the source, the Dockerfile, the steps), to edit."""
    repo = tmp_path / "repo"
    inputs = [*source_paths(REPO), REPO / "Dockerfile", REPO / VLLM_DOCKERFILE, REPO / STEPS_SCRIPT]
    for path in inputs + [REPO / p for p in DEPS_INPUTS]:
        dest = repo / path.relative_to(REPO)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, dest)
    return repo
