"""Names shared by the operator's builders, handlers and tests (ARCHITECTURE.md's contracts)."""

from __future__ import annotations

from conveyor import __version__

GROUP = "conveyor.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "LLMService"
PLURAL = "llmservices"

RUNTIME_PORT = 8000
GATEWAY_PORT = 8080
OPERATOR_PORT = 8081
PORT_NAME = "http"

IMAGE = f"conveyor:{__version__}"
"""The project's one image, tagged with this release as `conveyor image build` and the chart tag it:
an untagged name means `:latest`, which no release publishes and an offline node cannot pull."""

APP_LABEL = "app.kubernetes.io/name"
APP = "conveyor"
COMPONENT_LABEL = "app.kubernetes.io/component"
INSTANCE_LABEL = "app.kubernetes.io/instance"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "conveyor-operator"
LLMSERVICE_LABEL = "conveyor.dev/llmservice"

GATEWAY_NAME = "conveyor-gateway"
"""The namespace's shared gateway: its Deployment, Service, ServiceAccount, Role and RoleBinding."""

FIELD_MANAGER = "conveyor-operator"
"""Server-side apply field manager of everything the operator writes."""

CACHE_MOUNT = "/var/cache/conveyor"
"""Where the model cache volume is mounted in runtime pods ($CONVEYOR_CACHE, $HF_HOME below it)."""
VOLUME_MODEL_MOUNT = "/models/volume"
"""Where a model.volume claim is mounted (read-only)."""


def managed_labels(component: str) -> dict[str, str]:
    """Labels on every object the operator creates for ``component`` (runtime or gateway)."""
    return {APP_LABEL: APP, COMPONENT_LABEL: component, MANAGED_BY_LABEL: MANAGED_BY}


def runtime_selector(name: str) -> dict[str, str]:
    """The labels that pick one LLMService's runtime pods (Deployment, Service, PDB, scale)."""
    return {APP_LABEL: APP, COMPONENT_LABEL: "runtime", LLMSERVICE_LABEL: name}


def gateway_selector() -> dict[str, str]:
    """The labels that pick the namespace gateway's pods."""
    return {APP_LABEL: APP, COMPONENT_LABEL: "gateway"}


def selector_string(labels: dict[str, str]) -> str:
    """``a=b,c=d``, as label selectors are written in status and on the command line."""
    return ",".join(f"{k}={v}" for k, v in labels.items())


def scrape_annotations(port: int) -> dict[str, str]:
    """The annotations by which Prometheus finds a runtime or gateway pod's ``/metrics``."""
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": "/metrics",
    }


def rolling_update() -> dict[str, object]:
    """The update strategy of the runtime and gateway Deployments: a new pod is Ready before
    an old one goes, so serving capacity never drops during a rollout."""
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
