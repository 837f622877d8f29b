"""Helpers of the operator's e2e tests: the CRD, the operator's identity (RBAC from
``conveyor.operator.rbac``, never cluster admin), the operator as a local process, and
a check whether pods really run on this cluster.

The operator runs here as a process on the host with a kubeconfig that holds only its
ServiceAccount's token, so it has exactly the permissions it has in a pod: a missing rule
fails the test. Each test's operator watches only the test's namespace.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import yaml

from conveyor.cluster.api import ApiClient, ApiError
from conveyor.cluster.real_nodes import CONTROL_IMAGE
from conveyor.cluster.stack_images import holds_image
from conveyor.cluster.testing import KubeUnderTest
from conveyor.operator.crd import CRD_FILE
from conveyor.operator.install import operator_rbac
from conveyor.operator.names import IMAGE

REPO = Path(__file__).resolve().parent.parent
LLMSERVICES = "/apis/conveyor.dev/v1alpha1/namespaces/{ns}/llmservices"
RECONCILE_S = 60
"""Deadline for the operator to act on a change (it acts within a second or two here)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(
    what: str, check: Callable[[], Any], *, timeout_s: float, interval_s: float = 0.2
) -> Any:
    """Poll ``check`` (exceptions count as not yet) until truthy; TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while True:
        try:
            last = check()
        except (ApiError, OSError, KeyError, openai.APIError) as exc:
            # openai: a ClusterIP answers a moment after its endpoints appear (kube-proxy)
            last = exc
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"timed out after {timeout_s:.0f} s waiting for {what} (last: {last!r})"
            )
        time.sleep(interval_s)


def install_crd(kube: KubeUnderTest) -> None:
    """Apply ``crds/llmservice.yaml`` (server-side, as the chart's CRD would be) and wait until served."""
    kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/llmservices.conveyor.dev"

    def established() -> bool:
        conditions = (kube.api.get(path).get("status") or {}).get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

    wait_for("the LLMService CRD to be established", established, timeout_s=60)


def tiny_example() -> str:
    """``examples/llmservice.yaml`` renamed ``tiny`` and on ``conveyor-tiny``: for the tests of
    the operator's mechanics (children, drift, scale), whose pods should start in seconds.
    The example as written, on the real model, has tests of its own."""
    text = (REPO / "examples" / "llmservice.yaml").read_text()
    text = re.sub(r"(?m)^  name: \S+$", "  name: tiny", text, count=1)
    return re.sub(r"builtin: \S+", "builtin: conveyor-tiny", text, count=1)


def llmservice(name: str, **spec: Any) -> dict[str, Any]:
    """An LLMService on the built-in model, small enough for the one-machine cluster."""
    body: dict[str, Any] = {
        "model": {"builtin": "conveyor-tiny"},
        "resources": {"gpus": 1, "cpu": "500m", "memory": "1Gi"},
    }
    body.update(spec)
    return {
        "apiVersion": "conveyor.dev/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": name},
        "spec": body,
    }


def apply_yaml(
    kube: KubeUnderTest, namespace: str, *docs: dict[str, Any], check: bool = True
) -> subprocess.CompletedProcess[str]:
    return kube.kubectl(
        "-n", namespace, "apply", "-f", "-", input_=yaml.safe_dump_all(docs), check=check
    )


class OperatorIdentity:
    """The operator's ServiceAccount, ClusterRole and Lease Role in a namespace, and a kubeconfig
    that logs in with the ServiceAccount's token alone."""

    def __init__(self, kube: KubeUnderTest, namespace: str, workdir: Path) -> None:
        self.name = f"conveyor-operator-{namespace}"[:63]
        self.namespace = namespace
        self.kube = kube
        self.objects = operator_rbac(namespace, name=self.name)
        for obj in self.objects:
            kube.kubectl("apply", "-f", "-", input_=yaml.safe_dump(obj))
        token = kube.api.create(
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{self.name}/token",
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {"expirationSeconds": 7200},
            },
        )["status"]["token"]
        self.kubeconfig = kube.token_kubeconfig(token, workdir / f"{self.name}.kubeconfig")

    def close(self) -> None:
        for obj in self.objects:
            if obj["kind"] in ("ClusterRole", "ClusterRoleBinding"):  # the namespace takes the rest
                self.kube.kubectl(
                    "delete",
                    obj["kind"].lower(),
                    obj["metadata"]["name"],
                    "--ignore-not-found",
                    check=False,
                )


class OperatorProcess:
    """``conveyor operator`` as a local process (logs kept in a file, shown when a test fails)."""

    def __init__(
        self, identity: OperatorIdentity, log_dir: Path, *, name: str, extra: tuple[str, ...] = ()
    ) -> None:
        self.port = free_port()
        self.name = name
        self.log_path = log_dir / f"operator-{name}.log"
        argv = [
            sys.executable, "-m", "conveyor", "operator",
            "--kubeconfig", str(identity.kubeconfig),
            "--namespace", identity.namespace,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--lease-namespace", identity.namespace, "--lease-name", "conveyor-operator",
            "--identity", name,
            "--resync-interval", "5",
            "--lease-duration", "6", "--lease-renew-interval", "2", "--lease-retry-interval", "1",
            *extra,
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO
        )
        wait_for(
            f"operator {name}'s /healthz",
            lambda: self._get("/healthz") or self._dead(),
            timeout_s=60,
        )

    def _dead(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(
                f"operator {self.name} exited {self.proc.returncode}:\n{self.logs()}"
            )
        return False

    def _get(self, path: str) -> str:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"http://127.0.0.1:{self.port}{path}", timeout=5) as resp:
            return resp.read().decode()

    def metric(self, name: str) -> float | None:
        for line in self._get("/metrics").splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return None

    def is_leader(self) -> bool:
        return self.proc.poll() is None and self.metric("conveyor_operator_leader") == 1.0

    def logs(self) -> str:
        if not self._log.closed:  # still running; stop() closes it
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-20000:]

    def kill(self) -> None:
        """SIGKILL: no clean-up, no Lease release (a crash)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()


def gateway_image_flags(kube: KubeUnderTest) -> tuple[str, ...]:
    """On real nodes that hold the torch-less image (``conveyor image build --extras
    gateway,operator``), the gateways run from it, as ``conveyor up`` and a real cluster run
    them; elsewhere from the operator's default, the project's one image."""
    if kube.cluster is None or not holds_image(kube.cluster.settings, CONTROL_IMAGE):
        return ()
    return ("--gateway-image", f"{CONTROL_IMAGE}:{importlib.metadata.version('conveyor')}")


@contextlib.contextmanager
def operators(
    identity: OperatorIdentity, log_dir: Path
) -> Iterator[Callable[..., OperatorProcess]]:
    """Start operators with ``start(name)``; all stopped at exit; their logs printed on failure."""
    started: list[OperatorProcess] = []

    def start(name: str = "op-a", extra: tuple[str, ...] = ()) -> OperatorProcess:
        # Gateways of several test namespaces must fit the one CPU node (666m on 2 cores).
        extra = ("--gateway-cpu", "200m", *gateway_image_flags(identity.kube), *extra)
        process = OperatorProcess(identity, log_dir, name=name, extra=extra)
        started.append(process)
        return process

    try:
        yield start
    finally:
        release_llmservices(identity.kube, identity.namespace)
        for process in started:
            process.stop()
            # captured: pytest shows it only when the test failed
            print(f"\n----- operator {process.name} log -----\n{process.logs()}", file=sys.stderr)


def release_llmservices(kube: KubeUnderTest, namespace: str) -> None:
    """Delete the namespace's LLMServices while an operator may still remove its finalizer; strip
    the finalizer of any left (every operator killed), so the namespace can go."""
    kube.kubectl("-n", namespace, "delete", "llmservices", "--all", "--wait=false", check=False)
    path = LLMSERVICES.format(ns=namespace)
    try:
        wait_for("the LLMServices to go", lambda: not kube.api.get(path)["items"], timeout_s=20)
    except TimeoutError:
        for item in kube.api.get(path)["items"]:
            with contextlib.suppress(ApiError):
                kube.api.merge_patch(
                    f"{path}/{item['metadata']['name']}", {"metadata": {"finalizers": None}}
                )


def pods_run(kube: KubeUnderTest, namespace: str) -> str | None:
    """None when a pod really runs on this cluster, else why not (a cluster from ``KUBECONFIG``
    may schedule pods that nothing runs)."""
    api = kube.api
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "probe-pods-run"},
        "spec": {
            "containers": [{"name": "c", "image": IMAGE, "command": ["sleep", "600"]}],
            "terminationGracePeriodSeconds": 1,
        },
    }
    api.create(f"/api/v1/namespaces/{namespace}/pods", pod)
    path = f"/api/v1/namespaces/{namespace}/pods/probe-pods-run"
    try:
        wait_for(
            "a probe pod to run",
            lambda: api.get(path).get("status", {}).get("phase") == "Running",
            timeout_s=45,
        )
        return None
    except TimeoutError:
        status = api.get(path).get("status", {})
        return (
            "pods are scheduled but nothing runs them on this cluster: "
            f"a probe pod stayed {status.get('phase')} ({status.get('conditions')})"
        )
    finally:
        with contextlib.suppress(ApiError):
            api.delete(path)


def llmservice_status(api: ApiClient, namespace: str, name: str) -> dict[str, Any]:
    return api.get(f"{LLMSERVICES.format(ns=namespace)}/{name}").get("status") or {}


def children(
    api: ApiClient, namespace: str, *, component: str | None = None
) -> list[dict[str, Any]]:
    """Every object the operator made in ``namespace`` (Deployments, Services, PDBs, RBAC)."""
    selector = "app.kubernetes.io/managed-by=conveyor-operator" + (
        f",app.kubernetes.io/component={component}" if component else ""
    )
    paths = [
        f"/apis/apps/v1/namespaces/{namespace}/deployments",
        f"/api/v1/namespaces/{namespace}/services",
        f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets",
        f"/api/v1/namespaces/{namespace}/serviceaccounts",
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles",
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings",
    ]
    found = []
    for path in paths:
        for item in api.get(path, labelSelector=selector)["items"]:
            item.setdefault("kind", path.rsplit("/", 1)[1])
            found.append(item)
    return found


def scale_events(kube: KubeUnderTest, namespace: str, name: str) -> list[tuple[str, str]]:
    """(reason, message) of the autoscaler's Events on the LLMService."""
    items = kube.api.get(
        f"/api/v1/namespaces/{namespace}/events",
        fieldSelector=f"involvedObject.name={name},involvedObject.kind=LLMService",
    )["items"]
    return [
        (e["reason"], e.get("message", ""))
        for e in items
        if e["reason"] in ("ScaledUp", "ScaledDown")
    ]


def decisions(operator: OperatorProcess, name: str, direction: str) -> float:
    """``conveyor_autoscaler_decisions_total`` of one LLMService and direction, all reasons."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(operator._get("/metrics")):
        for sample in family.samples:
            if (
                sample.name == "conveyor_autoscaler_decisions_total"
                and sample.labels.get("llmservice") == name
                and sample.labels.get("direction") == direction
            ):
                total += sample.value
    return total


def path_of(namespace: str, name: str) -> str:
    return f"{LLMSERVICES.format(ns=namespace)}/{name}"


def deployment(kube: KubeUnderTest, namespace: str, name: str) -> dict[str, Any]:
    return kube.api.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}")


def reconciled(kube: KubeUnderTest, namespace: str, name: str) -> dict[str, Any] | None:
    """The status once it reflects the current generation (with an endpoint), else None."""
    obj = kube.api.get(path_of(namespace, name))
    status = obj.get("status") or {}
    if status.get("observedGeneration") == obj["metadata"]["generation"] and status.get("endpoint"):
        return status
    return None
