#!/usr/bin/env bash
# Build the one-machine cluster's tools from the pinned Go modules in
# cluster/go/ into a cache directory keyed by a hash of the pins.
#
#   cluster/build-tools.sh              build what is missing, then print the directory
#   cluster/build-tools.sh --print-dir  print the directory (built or not) and exit
#   cluster/build-tools.sh --check      exit 0 when everything is built, 1 otherwise
#   cluster/build-tools.sh kubectl ...  build (or wait for) only the binaries named
#   cluster/build-tools.sh --set node [...]  the same for the real nodes' binaries (kubelet,
#                                       fake-gpu-plugin; module cluster/go/node), built on demand
#                                       into a directory of their own key, so that the node
#                                       module's pins never change the control plane's key
#
# Idempotent: when the directory for the current pins is complete it exits at
# once. A second build started while one runs waits for the first (a lock
# file) and then finds everything built. Progress (which binary, elapsed
# time) goes to stderr; the last line on stdout is the directory.
#
# Settings (environment):
#   CONVEYOR_TOOLS_CACHE  root of the cache (default ~/.cache/conveyor/bin)
#   GOFLAGS               default -mod=mod (go.sum is committed; nothing is vendored)
set -euo pipefail

# The whole script is one function, read before it runs: editing this file (a pull, a
# checkout) while a 15-minute build runs cannot change what the running build does.
main() {
    # Bump when the recipe below changes in a way that changes the binaries.
    RECIPE=1

    here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
    mods="$here/go"
    cache_root="${CONVEYOR_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/conveyor/bin}"
    export GOFLAGS="${GOFLAGS:--mod=mod}"
    export CGO_ENABLED=0

    say() { printf '[build-tools %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

    if ! command -v go >/dev/null 2>&1 && [[ -x /usr/local/go/bin/go ]]; then
        export PATH="$PATH:/usr/local/go/bin"
    fi
    if ! command -v go >/dev/null 2>&1; then
        say "the Go toolchain is missing: install Go (1.26 or newer) and put it on PATH"
        exit 2
    fi

    # Which set: the cluster's tools (default) or the real nodes' (--set node).
    set=cluster
    if [[ "${1:-}" == "--set" ]]; then
        set="${2:?usage: $0 --set cluster|node ...}"
        shift 2
    fi

    # The binaries: name, module folder, package.
    binaries=(
        "etcd etcd go.etcd.io/etcd/server/v3"
        "kube-apiserver kubernetes k8s.io/kubernetes/cmd/kube-apiserver"
        "kube-controller-manager kubernetes k8s.io/kubernetes/cmd/kube-controller-manager"
        "kube-scheduler kubernetes k8s.io/kubernetes/cmd/kube-scheduler"
        "kube-proxy kubernetes k8s.io/kubernetes/cmd/kube-proxy"
        "kubectl kubernetes k8s.io/kubernetes/cmd/kubectl"
        "coredns coredns conveyor.dev/cluster/tools/coredns/cmd/coredns"
        "helm helm helm.sh/helm/v3/cmd/helm"
        "prometheus prometheus github.com/prometheus/prometheus/cmd/prometheus"
        "promtool prometheus github.com/prometheus/prometheus/cmd/promtool"
    )

    modules=(etcd kubernetes coredns helm prometheus)
    lock="$cache_root/.build.lock"
    prefix=""
    case "$set" in
        cluster) ;;
        node)
            binaries=(
                "kubelet node k8s.io/kubernetes/cmd/kubelet"
                "fake-gpu-plugin node conveyor.dev/cluster/tools/node/cmd/fake-gpu-plugin"
            )
            modules=(node)
            lock="$cache_root/.build-node.lock"
            prefix="node-"
            ;;
        *) echo "unknown set $set (cluster or node)" >&2; exit 2 ;;
    esac

    key="$( {
        echo "recipe $RECIPE"
        go env GOVERSION GOOS GOARCH
        for d in "${modules[@]}"; do
            cat "$mods/$d/go.mod" "$mods/$d/go.sum"
            # The project's own Go sources in the module (the node set has a device plugin).
            if [[ -d "$mods/$d/cmd" ]]; then find "$mods/$d/cmd" -name '*.go' | sort | xargs cat; fi
        done
    } | sha256sum | cut -c1-16)"
    out="$cache_root/$prefix$key"

    case "${1:-}" in
        --print-dir) echo "$out"; exit 0 ;;
        --check) [[ -f "$out/.complete" ]] && exit 0 || exit 1 ;;
        -*) echo "usage: $0 [--set cluster|node] [--print-dir|--check|BINARY...]" >&2; exit 2 ;;
    esac

    # Named binaries: build only those (the cluster needs seven of the ten; helm and
    # Prometheus can follow later). None named: all of them.
    local wanted=("$@")
    if [[ ${#wanted[@]} -eq 0 ]]; then
        for entry in "${binaries[@]}"; do wanted+=("${entry%% *}"); done
    fi
    have_wanted() { local b; for b in "${wanted[@]}"; do [[ -x "$out/$b" ]] || return 1; done; }

    if [[ -f "$out/.complete" ]] || have_wanted; then
        echo "$out"
        exit 0
    fi

    mkdir -p "$out"
    exec 9>"$lock"
    if ! flock -n 9; then
        # Each binary is moved into place when it is done: stop waiting as soon as the
        # ones asked for are there, even if the other build goes on with the rest.
        say "another build is running (lock $lock); waiting for ${wanted[*]}"
        local waited=0
        until flock -n 9; do
            if have_wanted; then
                say "the other build has built ${wanted[*]}"
                echo "$out"
                exit 0
            fi
            sleep 2
            waited=$((waited + 2))
            if (( waited % 60 == 0 )); then say "still waiting for the other build, ${waited} s"; fi
        done
    fi
    if have_wanted; then
        say "the other build finished what was asked for"
        echo "$out"
        exit 0
    fi

    # The version of a module as the build list of one of our modules resolved it.
    modver() { (cd "$mods/$1" && go list -m -f '{{.Version}}' "$2"); }

    ldflags_for() {
        local dir="$1" v major minor
        case "$dir" in
            kubernetes|node)
                v="$(modver "$dir" k8s.io/kubernetes)"
                major="${v#v}"; major="${major%%.*}"
                minor="${v#v*.}"; minor="${minor%%.*}"
                for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
                    printf -- '-X %s.gitVersion=%s -X %s.gitMajor=%s -X %s.gitMinor=%s -X %s.gitTreeState=clean ' \
                        "$pkg" "$v" "$pkg" "$major" "$pkg" "$minor" "$pkg"
                done
                ;;
            helm)
                v="$(modver helm helm.sh/helm/v3)"
                local cg; cg="$(modver helm k8s.io/client-go)"; cg="${cg#v0.}"
                printf -- '-X helm.sh/helm/v3/internal/version.version=%s -X helm.sh/helm/v3/internal/version.gitTreeState=clean ' "$v"
                for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
                    printf -- '-X %s.k8sVersionMajor=1 -X %s.k8sVersionMinor=%s ' "$pkg" "$pkg" "${cg%%.*}"
                done
                ;;
            prometheus)
                # Module v0.3MM.P is Prometheus 3.MM.P.
                v="$(modver prometheus github.com/prometheus/prometheus)"
                local mm="${v#v0.3}"; mm="${mm%%.*}"; mm="$((10#$mm))"
                local patch="${v##*.}"
                printf -- '-X github.com/prometheus/common/version.Version=3.%s.%s -X github.com/prometheus/common/version.Branch=HEAD -X github.com/prometheus/common/version.BuildUser=conveyor ' "$mm" "$patch"
                ;;
        esac
    }

    tags_for() {
        case "$1" in
            # Only the Kubernetes and file/http service discovery: the cloud SDKs
            # are most of Prometheus' build time and nothing here uses them.
            prometheus) echo "netgo,remove_all_sd,enable_kubernetes_sd" ;;
            *) echo "" ;;
        esac
    }

    total_start=$SECONDS
    built_any=0
    n=${#binaries[@]}
    i=0
    times="$out/build-times.tsv"
    for entry in "${binaries[@]}"; do
        i=$((i + 1))
        read -r name dir pkg <<<"$entry"
        if [[ " ${wanted[*]} " != *" $name "* ]]; then
            continue
        fi
        if [[ -x "$out/$name" ]]; then
            say "($i/$n) $name: already built"
            continue
        fi
        say "($i/$n) building $name from $pkg (module cluster/go/$dir)"
        start=$SECONDS
        ( cd "$mods/$dir" && go build -trimpath -tags "$(tags_for "$dir")" \
            -ldflags "-s -w $(ldflags_for "$dir")" -o "$out/.$name.partial" "$pkg" ) &
        pid=$!
        # A line every 30 s, so that a long build never looks hung.
        while kill -0 "$pid" 2>/dev/null; do
            for _ in $(seq 30); do
                kill -0 "$pid" 2>/dev/null || break 2
                sleep 1
            done
            say "($i/$n) $name: still building, $((SECONDS - start)) s"
        done
        if ! wait "$pid"; then
            say "($i/$n) building $name FAILED after $((SECONDS - start)) s"
            exit 1
        fi
        mv -f "$out/.$name.partial" "$out/$name"
        built_any=1
        printf '%s\t%s\n' "$name" "$((SECONDS - start))" >>"$times"
        say "($i/$n) built $name in $((SECONDS - start)) s"
    done

    if [[ $built_any == 1 ]]; then
        printf 'total\t%s\n' "$((SECONDS - total_start))" >>"$times"
    fi
    local all=1
    for entry in "${binaries[@]}"; do [[ -x "$out/${entry%% *}" ]] || all=0; done
    if [[ $all == 1 ]]; then
        date -u +%Y-%m-%dT%H:%M:%SZ >"$out/.complete"
    fi
    say "${wanted[*]} built in $out ($((SECONDS - total_start)) s)"
    echo "$out"
}

main "$@"
exit
