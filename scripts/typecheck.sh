#!/usr/bin/env bash
# Types and layering of the product code: mypy (mypy.ini), then import-linter (.importlinter).
#
#   scripts/typecheck.sh          exits non-zero when either finds an error
#
# The folders runtime/, gateway/, operator/, bench/ ... are the packages conveyor.runtime,
# conveyor.gateway, ... (pyproject.toml's package-dir). Both tools find modules by walking
# folders and cannot follow the editable install's import hook, so the packages are laid out
# under .typecheck/src/conveyor/ (rebuilt from package-dir on every run: real folders, each
# source file a link to the real one). mypy checks `-p conveyor` there and its messages are
# turned back into the real paths; lint-imports runs from that folder, so `conveyor` is the tree.
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${CONVEYOR_VENV:-$root/.venv}"
tree=.typecheck/src
# One run at a time: each rebuilds the tree the other reads.
mkdir -p .typecheck
exec 9>.typecheck/lock
flock 9

# Prints the sed script that maps the tree's paths back to the real ones.
real_paths="$("$venv/bin/python" - "$tree" <<'PY'
import os
import shutil
import sys
import tomllib
from pathlib import Path

tree = Path(sys.argv[1])
setuptools = tomllib.loads(Path("pyproject.toml").read_text())["tool"]["setuptools"]
mapping = setuptools["package-dir"]
mapped_folders = {Path(folder).resolve() for folder in mapping.values()}
shutil.rmtree(tree / "conveyor", ignore_errors=True)
for package, folder in mapping.items():
    base = tree.joinpath(*package.split("."))
    for dirpath, dirnames, filenames in os.walk(folder):
        # A subfolder that is another package's folder is laid out from that package.
        dirnames[:] = [
            d for d in dirnames
            if d != "__pycache__" and (Path(dirpath) / d).resolve() not in mapped_folders
        ]
        for name in filenames:
            if name.endswith((".py", ".pyi")):
                link = base / os.path.relpath(dirpath, folder) / name
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(os.path.relpath(Path(dirpath) / name, link.parent))
# A package without an __init__.py (operator/, which must not shadow the standard library's
# operator module from the checkout's root) is a regular package in the tree, as installed.
for package in setuptools["packages"]:
    tree.joinpath(*package.split(".")).mkdir(parents=True, exist_ok=True)
    tree.joinpath(*package.split("."), "__init__.py").touch()
for package, folder in sorted(mapping.items(), key=lambda item: -item[0].count(".")):
    print(f"s#^{tree}/{package.replace('.', '/')}/#{folder}/#")
PY
)" || exit 1

rc=0
printf '[typecheck] mypy -p conveyor (%s): strict on conveyor.runtime.engine, conveyor.gateway, conveyor.operator\n' \
    "$(cd "$tree/conveyor" && ls -d */ | tr -d / | tr '\n' ' ' | sed 's/ $//')"
"$venv/bin/mypy" --config-file mypy.ini -p conveyor 2>&1 | sed -E "$real_paths"
[[ ${PIPESTATUS[0]} -eq 0 ]] || rc=1

printf '[typecheck] lint-imports: the layering contracts in .importlinter\n'
(cd "$tree" && "$venv/bin/lint-imports" "$root/.importlinter" --no-logo \
    --cache-dir "$root/.typecheck/import-linter-cache") || rc=1

exit $rc
