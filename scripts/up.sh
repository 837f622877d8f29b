#!/usr/bin/env bash
# The README's first command: set everything up, then `conveyor up` (the whole
# stack on this machine). Extra arguments go to `conveyor up`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/bootstrap.sh"
venv="${CONVEYOR_VENV:-$root/.venv}"
cd "$root"
exec "$venv/bin/conveyor" up "$@"
