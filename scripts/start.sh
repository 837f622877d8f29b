#!/usr/bin/env bash
# One replica without Kubernetes (README, "Models"): set everything up, then serve the built-in model
# with an OpenAI-compatible API on http://127.0.0.1:8000/v1.
#
#   scripts/start.sh [conveyor serve flags...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/bootstrap.sh"
venv="${CONVEYOR_VENV:-$root/.venv}"
exec "$venv/bin/conveyor" serve --model smollm2-135m-instruct --host 127.0.0.1 --port 8000 "$@"
