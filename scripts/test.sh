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
#   5. the Go build and vLLM for CPU's install (started after phase 2) are waited
#      for, then the end-to-end tests (e2e/) run on one cluster for the whole session,
#   6. the README's walk-through runs as written (`conveyor up` ... `conveyor down`),
#   7. an LLMService on real nodes (e2e/test_real_nodes.py): kubelets and containerd running
#      the project's image. As root, the image and the nodes' seed are built in the background
#      from phase 3 on (`conveyor image build --seed`: ~4 min cold, seconds warm), and the node
#      tools (kubelet) after the cluster's (niced, beside phase 5). CONVEYOR_REAL_NODES=0 skips
#      both builds (phase 7 then skips in seconds, as it does without root).
# pytest's "no tests collected" (exit 5) fails the run: a suite that runs
# nothing must not pass. CONVEYOR_E2E=0 skips phases 1 and 5 (no cluster).
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
summary() {
    echo
    echo "== phase times =="
    printf '  %s\n' "${phases[@]}"
    printf '  %-28s %5ds\n' "total" "$(( SECONDS - t_start ))"
}

build_pid=""
run_e2e="${CONVEYOR_E2E:-1}"
if [[ "$run_e2e" != 0 && -x cluster/build-tools.sh && -z "${KUBECONFIG:-}" ]]; then
    say "phase 1: building the cluster's tools in the background (log: $logs/build-tools.log)"
    t_build=$SECONDS
    cluster/build-tools.sh > "$logs/build-tools.log" 2>&1 &
    build_pid=$!
fi

say "phase 2: virtual environment"
t=$SECONDS
if ! scripts/bootstrap.sh; then
    echo "bootstrap failed"; exit 1
fi
phase_done "python install" $t

real_nodes=0
if [[ "$run_e2e" != 0 && "${CONVEYOR_REAL_NODES:-1}" != 0 && $(id -u) -eq 0 ]]; then
    real_nodes=1
    say "building the project's image and the real nodes' seed in the background (log: $logs/image-build.log)"
    # Each background build writes how long it took itself: waited for later, its wall time
    # from the start would include the phases in between.
    ( t0=$SECONDS; nice -n 5 "$venv/bin/conveyor" image build --seed; rc=$?
      echo $(( SECONDS - t0 )) > "$logs/image-build.seconds"; exit $rc ) > "$logs/image-build.log" 2>&1 &
    image_pid=$!
fi

vllm_pid=""
if [[ "$run_e2e" != 0 ]]; then
    # vLLM for CPU, which the cluster's node agent runs for vLLM's image (e2e/test_engines.py):
    # its own cached environment, pinned; a no-op once installed, minutes cold, overlapped
    # with lint and the unit tests.
    say "installing vLLM for CPU in the background (log: $logs/vllm-install.log)"
    t_vllm=$SECONDS
    "$venv/bin/python" -m conveyor.bench.peers.vllm_env install > "$logs/vllm-install.log" 2>&1 &
    vllm_pid=$!
fi

say "phase 3: lint (ruff, then types and layering: scripts/typecheck.sh)"
t=$SECONDS
"$venv/bin/ruff" check . || { phase_done "lint" $t; summary; exit 1; }
CONVEYOR_VENV="$venv" scripts/typecheck.sh || { phase_done "lint" $t; summary; exit 1; }
phase_done "lint" $t

run_pytest() {  # name, then pytest args; exit 5 (no tests) is a failure
    local name=$1; shift
    local t=$SECONDS
    "$venv/bin/pytest" "$@"
    local rc=$?
    phase_done "$name" $t
    if [[ $rc -eq 5 ]]; then
        echo "pytest collected no tests for '$name': that is a failure, not a pass"
        return 1
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
            phase_done "go build (waited)" $t
            summary
            exit 1
        fi
        tail -n 3 "$logs/build-tools.log"
        phase_done "go build (waited)" $t
        phases+=("$(printf '%-28s %5ds' "go build (wall, overlapped)" "$(( SECONDS - t_build ))")")
    fi
    if [[ $real_nodes -eq 1 ]]; then
        # The real nodes' binaries reuse what the cluster's build left in Go's cache; niced,
        # so that the e2e tests beside it keep the cores they ask for.
        say "building the node tools in the background (log: $logs/build-node.log)"
        ( t0=$SECONDS; nice -n 10 cluster/build-tools.sh --set node; rc=$?
          echo $(( SECONDS - t0 )) > "$logs/build-node.seconds"; exit $rc ) > "$logs/build-node.log" 2>&1 &
        node_pid=$!
    fi
    if [[ -n "$vllm_pid" ]]; then
        t=$SECONDS
        if ! wait "$vllm_pid"; then
            tail -n 20 "$logs/vllm-install.log"
            echo "installing vLLM for CPU failed"
            phase_done "vllm install (waited)" $t
            summary
            exit 1
        fi
        phase_done "vllm install (waited)" $t
        phases+=("$(printf '%-28s %5ds' "vllm install (wall, overlapped)" "$(( SECONDS - t_vllm ))")")
    fi
    say "phase 5b: end-to-end tests on the one-machine cluster"
    run_pytest "e2e tests" e2e --ignore=e2e/walkthrough --ignore=e2e/test_real_nodes.py \
        -p no:cacheprovider --durations=12 "$@"
    rc_e2e=$?
    say "phase 6: the README walk-through, as written, on a cluster of its own"
    run_pytest "README walk-through" e2e/walkthrough -p no:cacheprovider "$@"
    rc_walk=$?
    [[ $rc_e2e -eq 0 ]] && rc_e2e=$rc_walk
    # Real nodes (kubelet + containerd, pods from the project's image) on a cluster of their
    # own, from what the background builds made (without root it skips in seconds).
    rc_real=0
    if [[ $real_nodes -eq 1 ]]; then
        say "phase 7a: waiting for the image, the seed and the node tools"
        t=$SECONDS
        if ! wait "$image_pid"; then
            tail -n 30 "$logs/image-build.log"
            echo "building the image or the real nodes' seed failed (log: $logs/image-build.log)"
            rc_real=1
        fi
        tail -n 5 "$logs/image-build.log"
        phases+=("$(printf '%-28s %5ss' "image + seed (overlapped)" "$(cat "$logs/image-build.seconds" 2>/dev/null || echo '?')")")
        if ! wait "$node_pid"; then
            tail -n 30 "$logs/build-node.log"
            echo "building the node tools failed (log: $logs/build-node.log)"
            rc_real=1
        fi
        phases+=("$(printf '%-28s %5ss' "node tools (overlapped)" "$(cat "$logs/build-node.seconds" 2>/dev/null || echo '?')")")
        phase_done "real-node builds (waited)" $t
    fi
    if [[ $rc_real -eq 0 ]]; then
        say "phase 7: an LLMService on real nodes, from the project's image"
        # Built above, so a reason to skip is a failure here.
        CONVEYOR_REAL_NODES_REQUIRED=$real_nodes run_pytest "e2e on real nodes" \
            e2e/test_real_nodes.py -p no:cacheprovider -rs "$@"
        rc_real=$?
    fi
    [[ $rc_e2e -eq 0 ]] && rc_e2e=$rc_real
elif [[ -n "$build_pid" ]]; then
    wait "$build_pid" || true
fi
[[ $real_nodes -eq 1 ]] && wait "$image_pid" 2>/dev/null
[[ -n "$vllm_pid" ]] && wait "$vllm_pid" 2>/dev/null

summary
if [[ $rc_tests -ne 0 || $rc_e2e -ne 0 ]]; then
    echo "FAILED (tests rc=$rc_tests, e2e rc=$rc_e2e)"
    exit 1
fi
echo "all phases passed"
