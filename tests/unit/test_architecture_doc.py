"""docs/architecture.md stays true: every file and function it names exists.

The document follows one request from the gateway to the sampler and back; each hop is
written as `` `path/to/file.py` · `Class.method` `` (or a plain function name). A rename
that forgets the document fails here, with the hop that went stale.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
HOP = re.compile(r"`([\w./-]+\.py)` · `([\w.]+)`")


def hops() -> list[tuple[str, str]]:
    return HOP.findall(DOC.read_text())


def defined_names(path: Path) -> set[str]:
    """Top-level functions, classes and assignments, and ``Class.member`` for class members."""
    names: set[str] = set()

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(prefix + node.name)
            elif isinstance(node, ast.ClassDef):
                names.add(prefix + node.name)
                visit(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, ast.Assign):
                names.update(prefix + t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(prefix + node.target.id)

    visit(ast.parse(path.read_text()).body, "")
    return names


def test_the_request_path_is_documented_hop_by_hop():
    # The walk from the client to the sampler and back names a couple of dozen places.
    assert len(hops()) >= 20, "docs/architecture.md should name each hop as `file.py` · `symbol`"


@pytest.mark.parametrize("path,symbol", hops(), ids=lambda v: str(v))
def test_every_named_hop_exists(path, symbol):
    file = ROOT / path
    assert file.is_file(), f"docs/architecture.md names {path}, which does not exist"
    assert symbol in defined_names(file), (
        f"docs/architecture.md names {symbol} in {path}: not defined there"
    )
