"""The package layout that ARCHITECTURE.md promises."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {
    "conveyor": "conveyor",
    "runtime": "conveyor.runtime",
    "gateway": "conveyor.gateway",
    "operator": "conveyor.operator",
    "cluster": "conveyor.cluster",
    "bench": "conveyor.bench",
}


def test_every_package_folder_is_in_pyproject():
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = set()
    for folder, package in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *rel.parts]))
    missing = found - listed
    assert not missing, (
        f"add these packages to [tool.setuptools] packages in pyproject.toml: {missing}"
    )


def test_no_top_level_operator_package_shadows_the_standard_library():
    assert not (ROOT / "operator" / "__init__.py").exists()
    out = subprocess.run(
        [sys.executable, "-c", "import operator, enum; print(operator.__file__)"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert str(ROOT / "operator") not in out.stdout


def test_scheduler_block_manager_and_sequence_import_no_torch():
    code = (
        "import sys\n"
        "import conveyor.runtime, conveyor.runtime.sampling_params\n"
        "import conveyor.runtime.engine.scheduler, conveyor.runtime.engine.block_manager\n"
        "import conveyor.runtime.engine.sequence, conveyor.runtime.engine.outputs\n"
        "import conveyor.runtime.detokenizer\n"
        "heavy = [m for m in ('torch', 'transformers', 'fastapi', 'kopf') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT / "tests")


def test_test_module_names_are_unique():
    # Test folders have no __init__.py, so pytest imports modules by basename: two
    # test_x.py in different folders collide when the whole suite runs in one session.
    names: dict[str, Path] = {}
    for path in sorted([*(ROOT / "tests").rglob("*.py"), *(ROOT / "e2e").rglob("*.py")]):
        if path.name == "conftest.py" or "__pycache__" in path.parts:
            continue
        assert path.name not in names, (
            f"{path} and {names[path.name]} share a module name: rename one"
        )
        names[path.name] = path
