"""The generated reference docs match their sources (run `python -m conveyor.docs` to refresh)."""

from __future__ import annotations

import pytest

from conveyor.docs import ROOT, generated


@pytest.mark.parametrize("path", sorted(generated()), ids=lambda p: p.name)
def test_reference_doc_is_current(path):
    expected = generated()[path]
    assert path.exists(), f"{path.relative_to(ROOT)} is missing: run `python -m conveyor.docs`"
    assert path.read_text() == expected, (
        f"{path.relative_to(ROOT)} is stale: run `python -m conveyor.docs` and commit the result"
    )
