#!/usr/bin/env bash
# The README's test command (and CI's: .ci/run calls exactly this).
#
#   scripts/test.sh [pytest args...]
#
# Phases, each timed:
#   1. the Go build of the cluster's tools starts in the background (cold:
#      ~15 minutes on 2 cores; cached by a hash of the pins afterwards),
#   2. the virtual environment is created or refreshed alongside it,
#   3. lint: ruff, then mypy and import-linter (scripts/typecheck.sh),
#   4. unit and integration tests (tests/),
#   5. the Go build and the images (started after phase 2) are waited for, then the
#      end-to-end tests (e2e/) run on one cluster for the whole session, whose nodes are
#      kubelets with their own containerd running the project's image and vLLM for CPU's
#      (the images and the nodes' seed are built in the background from phase 2 on,
#      `conveyor image build --engine vllm`, `--extras gateway,operator`, then `--seed`:
#      ~7 min cold, seconds warm; the node tools right after the cluster's),
#   6. the README's walk-through runs as written (`conveyor up` ... `conveyor down`),
#   7. an LLMService from the project's image on a cluster of its own (e2e/test_real_nodes.py).
# The cluster needs root (mounts, cgroups, network namespaces): without it the run stops at
# once and says so, unless CONVEYOR_E2E=0, which skips phases 1 and 5-7 (lint and unit
# tests only). With KUBECONFIG set, phase 5 runs against that cluster instead (no images).
# pytest's "no tests collected" (exit 5) fails the run: a suite that runs
# nothing must not pass.
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${CONVEYOR_VENV:-$root/.venv}"
logs="${CONVEYOR_TEST_LOGS:-$root/.test-logs}"
mkdir -p "$logs"
t_start=$SECONDS
phases=()
say() { printf '\n[test %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
phase_done() { phases+=("$(printf '%-28s %5ds' "$1" "$(( SECONDS - $2 ))")"); }
failures=()  # what failed and why, printed last: CI shows only the output's tail
failed() { failures+=("$@"); }
# Free space where the caches live (the images, the nodes' seed, Go's build cache): a cold
# run writes about 40 GiB there, a warm one little beyond the checkout's .venv (6 GiB).
cache_dir="${XDG_CACHE_HOME:-$HOME/.cache}"
mkdir -p "$cache_dir"
disk_free() { df -BG --output=avail "$cache_dir" | tail -n 1 | tr -dc '0-9'; }
free_start=$(disk_free)
summary() {
    echo
    echo "== phase times =="
    printf '  %s\n' "${phases[@]}"
    printf '  %-28s %5ds\n' "total" "$(( SECONDS - t_start ))"
    echo "disk free under $cache_dir: ${free_start} GiB at the start, $(disk_free) GiB at the end"
    if [[ ${#failures[@]} -gt 0 ]]; then
        echo "== what failed =="
        printf '  %s\n' "${failures[@]}"
    fi
}

if (( free_start < 10 )); then
    echo "only ${free_start} GiB is free under $cache_dir: a run needs up to 40 GiB cold (images," \
        "the nodes' seed, Go's build cache) and a full disk fails it midway; free space first" >&2
fi

build_pid=""
run_e2e="${CONVEYOR_E2E:-1}"
# The one-machine cluster (phases 5-7 without KUBECONFIG): its nodes are kubelets with their
# own containerd, which need root.
own_cluster=0
if [[ "$run_e2e" != 0 && -z "${KUBECONFIG:-}" ]]; then
    own_cluster=1
    if [[ $(id -u) -ne 0 ]]; then
        echo "the end-to-end phases start a cluster whose nodes are kubelets with their own" \
            "containerd, which needs root: run this as root, or with CONVEYOR_E2E=0 for lint" \
            "and the unit tests only, or with KUBECONFIG naming a cluster to test against" >&2
        exit 2
    fi
fi
if [[ "$run_e2e" != 0 && -x cluster/build-tools.sh && -z "${KUBECONFIG:-}" ]]; then
    say "phase 1: building the cluster's tools in the background (log: $logs/build-tools.log)"
    t_build=$SECONDS
    # The real nodes' binaries (kubelet) reuse what the cluster's build left in Go's cache.
    ( cluster/build-tools.sh || exit 1
      if [[ $own_cluster -eq 1 ]]; then
          t0=$SECONDS; cluster/build-tools.sh --set node || exit 1
          echo $(( SECONDS - t0 )) > "$logs/build-node.seconds"
      fi ) > "$logs/build-tools.log" 2>&1 &
    build_pid=$!
fi

say "phase 2: virtual environment"
t=$SECONDS
if ! scripts/bootstrap.sh; then
    echo "bootstrap failed"; exit 1
fi
phase_done "python install" $t

if [[ $own_cluster -eq 1 ]]; then
    say "building the images (the project's, vLLM for CPU's, the torch-less control image) and the nodes' seed in the background (log: $logs/image-build.log)"
    # Each background build writes how long it took itself: waited for later, its wall time
    # from the start would include the phases in between.
    ( t0=$SECONDS
      nice -n 5 "$venv/bin/conveyor" image build --engine vllm \
          && nice -n 5 "$venv/bin/conveyor" image build --extras gateway,operator \
          && nice -n 5 "$venv/bin/conveyor" image build --seed; rc=$?
      echo $(( SECONDS - t0 )) > "$logs/image-build.seconds"; exit $rc ) > "$logs/image-build.log" 2>&1 &
    image_pid=$!
fi

say "phase 3: lint (ruff, then types and layering: scripts/typecheck.sh)"
t=$SECONDS
"$venv/bin/ruff" check . || { phase_done "lint" $t; failed "lint: ruff (above)"; summary; exit 1; }
CONVEYOR_VENV="$venv" scripts/typecheck.sh \
    || { phase_done "lint" $t; failed "lint: scripts/typecheck.sh (above)"; summary; exit 1; }
phase_done "lint" $t

run_pytest() {  # name, then pytest args; exit 5 (no tests) is a failure
    local name=$1; shift
    local t=$SECONDS
    local log="$logs/pytest-${name//[^a-zA-Z0-9]/-}.log"
    "$venv/bin/pytest" "$@" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    phase_done "$name" $t
    if [[ $rc -eq 5 ]]; then
        echo "pytest collected no tests for '$name': that is a failure, not a pass"
        failed "$name: pytest collected no tests"
        return 1
    fi
    if [[ $rc -ne 0 ]]; then
        failed "$name (pytest exit $rc; $log):"
        # The short summary's lines: pyproject's -ra prints them (an -r of a phase's own, as
        # -rs once did, replaces it and left this list empty).
        local line
        while IFS= read -r line; do failed "  $line"; done \
            < <(grep -E '^(FAILED|ERROR) ' "$log" | cut -c1-300 | head -n 12)
    fi
    return $rc
}

say "phase 4: unit and integration tests"
run_pytest "unit + integration tests" tests -p no:cacheprovider "$@"
rc_tests=$?

rc_e2e=0
if [[ "$run_e2e" != 0 ]] && ls e2e/test_*.py >/dev/null 2>&1; then
    if [[ -n "$build_pid" ]]; then
        say "phase 5a: waiting for the cluster's tools (tail of $logs/build-tools.log follows)"
        t=$SECONDS
        if ! wait "$build_pid"; then
            tail -n 40 "$logs/build-tools.log"
            echo "building the cluster's tools failed"
            failed "building the cluster's tools ($logs/build-tools.log): its tail is above"
            phase_done "go build (waited)" $t
            summary
            exit 1
        fi
        tail -n 3 "$logs/build-tools.log"
        phase_done "go build (waited)" $t
        phases+=("$(printf '%-28s %5ds' "go build (wall, overlapped)" "$(( SECONDS - t_build ))")")
    fi
    if [[ $own_cluster -eq 1 ]]; then
        phases+=("$(printf '%-28s %5ss' "node tools (overlapped)" "$(cat "$logs/build-node.seconds" 2>/dev/null || echo '?')")")
    fi
    rc_images=0
    if [[ $own_cluster -eq 1 ]]; then
        say "phase 5a: waiting for the images and the nodes' seed"
        t=$SECONDS
        if ! wait "$image_pid"; then
            tail -n 30 "$logs/image-build.log"
            echo "building the images or the nodes' seed failed (log: $logs/image-build.log)"
            failed "building the images or the nodes' seed ($logs/image-build.log), its tail:"
            while IFS= read -r line; do failed "  ${line:0:300}"; done \
                < <(tail -n 12 "$logs/image-build.log")
            rc_images=1
        fi
        tail -n 5 "$logs/image-build.log"
        phases+=("$(printf '%-28s %5ss' "image + seed (overlapped)" "$(cat "$logs/image-build.seconds" 2>/dev/null || echo '?')")")
        phase_done "image + seed (waited)" $t
    fi
    rc_e2e=$rc_images
    if [[ $rc_images -eq 0 ]]; then
        say "phase 5b: end-to-end tests on one cluster (kubelets, containerd, the project's and vLLM's images)"
        # Built above, so a reason the cluster cannot start here is a failure, not a skip.
        CONVEYOR_REAL_NODES_REQUIRED=$own_cluster run_pytest "e2e tests" e2e \
            --ignore=e2e/walkthrough --ignore=e2e/test_real_nodes.py -p no:cacheprovider \
            --durations=12 "$@"
        rc_e2e=$?
    fi
    if [[ $own_cluster -eq 1 && $rc_images -eq 0 ]]; then
        say "phase 6: the README walk-through, as written, on a cluster of its own"
        run_pytest "README walk-through" e2e/walkthrough -p no:cacheprovider "$@"
        rc_walk=$?
        [[ $rc_e2e -eq 0 ]] && rc_e2e=$rc_walk
        say "phase 7: an LLMService from the project's image, on a cluster of its own"
        CONVEYOR_REAL_NODES_REQUIRED=1 run_pytest "e2e on a cluster of its own" \
            e2e/test_real_nodes.py -p no:cacheprovider "$@"
        rc_own=$?
        [[ $rc_e2e -eq 0 ]] && rc_e2e=$rc_own
    fi
elif [[ -n "$build_pid" ]]; then
    wait "$build_pid" || true
fi
[[ $own_cluster -eq 1 ]] && wait "$image_pid" 2>/dev/null

summary
if [[ $rc_tests -ne 0 || $rc_e2e -ne 0 ]]; then
    echo "FAILED (tests rc=$rc_tests, e2e rc=$rc_e2e)"
    exit 1
fi
echo "all phases passed"
