"""The cluster side of ``conveyor bench autoscale``: kubectl and the API, one namespace of its
own, and the operator as a local process."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import yaml

from conveyor.bench.autoscale.settings import MODEL, NAME, BenchSettings
from conveyor.bench.procs import ChildProcess
from conveyor.bench.wait import wait_until
from conveyor.operator.names import IMAGE


class Env:
    """kubectl and the API of the cluster, one namespace, the operator process."""

    def __init__(self, kubeconfig: Path, kubectl: str) -> None:
        from conveyor.cluster.api import ApiClient

        self.kubeconfig, self.kubectl_path = kubeconfig, kubectl
        self.api = ApiClient.from_kubeconfig(kubeconfig)
        self.namespace = f"bench-autoscale-{uuid.uuid4().hex[:6]}"
        self.operator: ChildProcess | None = None
        self.log = Path(f"/tmp/{self.namespace}-operator.log")

    def kubectl(self, *args: str, input_: str | None = None) -> str:
        proc = subprocess.run(
            [self.kubectl_path, f"--kubeconfig={self.kubeconfig}", *args],
            capture_output=True, text=True, input=input_,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {proc.stderr.strip()}")
        return proc.stdout

    @property
    def path(self) -> str:
        return f"/apis/conveyor.dev/v1alpha1/namespaces/{self.namespace}/llmservices/{NAME}"

    def llmservice(self) -> dict[str, Any]:
        return self.api.get(self.path)

    def pods_run(self) -> str | None:
        """None when a pod of the runtime's image really runs here, else why not (the
        container's waiting reason: no such image on the nodes, nothing running pods, ...)."""
        pods = f"/api/v1/namespaces/{self.namespace}/pods"
        self.api.create(pods, {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe"},
            "spec": {"containers": [{"name": "c", "image": IMAGE, "command": ["sleep", "60"]}],
                     "terminationGracePeriodSeconds": 1},
        })  # fmt: skip
        status: dict[str, Any] = {}

        def running() -> bool:
            nonlocal status
            status = self.api.get(f"{pods}/probe").get("status") or {}
            return status.get("phase") == "Running"

        try:
            wait_until(running, 90, "the probe pod to run", interval=0.5)
            return None
        except TimeoutError:
            waiting = [
                f"{w.get('reason')}: {w.get('message', '')}".strip(": ")
                for c in status.get("containerStatuses") or []
                if (w := (c.get("state") or {}).get("waiting"))
            ]
            why = "; ".join(waiting) or f"phase {status.get('phase', 'unknown')}"
            return f"a pod of image {IMAGE} does not run on this cluster ({why})"
        finally:
            self.api.request("DELETE", f"{pods}/probe")

    def start(self, s: BenchSettings) -> None:
        from conveyor.operator.crd import CRD_FILE

        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))

        def command(port: int) -> list[str]:
            return [
                sys.executable, "-m", "conveyor", "operator", "--kubeconfig", str(self.kubeconfig),
                "--namespace", self.namespace, "--no-leader-election", "--host", "127.0.0.1",
                "--port", str(port), "--autoscale-interval", str(s.interval_s),
                "--gateway-cpu", "300m", "--resync-interval", "10",
                "--gateway-queue" if s.gateway_queue else "--no-gateway-queue",
            ]  # fmt: skip

        # Not waited for: the LLMService turning Ready is what says the operator works.
        self.operator = ChildProcess("operator", command, ready_path=None, log_path=self.log)
        self.operator.start()

    def stop(self, keep: bool) -> None:
        if self.operator is not None and not keep:
            self.kubectl("-n", self.namespace, "delete", "llmservices", "--all", "--wait=true")
        if self.operator is not None:
            self.operator.stop()
        if not keep:
            self.kubectl("delete", "namespace", self.namespace, "--wait=false")

    def apply(
        self,
        s: BenchSettings,
        min_replicas: int,
        idle_s: int = 600,
        autoscale: bool = True,
        max_replicas: int | None = None,
    ) -> None:
        """Create or update the benchmark's LLMService; ``max_replicas`` None: the settings'."""
        body = {
            "apiVersion": "conveyor.dev/v1alpha1", "kind": "LLMService",
            "metadata": {"name": NAME},
            "spec": {
                "model": {"builtin": "conveyor-tiny", "servedName": MODEL},
                "resources": {"gpus": 1, "cpu": s.replica_cpu, "memory": "1Gi"},
                "runtime": {"maxRunningRequests": 2},
                "replicas": 1,
                "autoscaling": {
                    "enabled": autoscale, "minReplicas": min_replicas,
                    "maxReplicas": max_replicas or s.max_replicas,
                    "targetQueueDepthPerReplica": s.target_queue,
                    "targetTTFTP95Seconds": s.target_ttft_s,
                    "scaleDownStabilizationSeconds": s.scale_down_window_s,
                    "backlogDrainSeconds": s.backlog_drain_s,
                    "scaleToZeroIdleSeconds": idle_s,
                },
            },
        }  # fmt: skip
        self.kubectl("-n", self.namespace, "apply", "-f", "-", input_=yaml.safe_dump(body))

    def crash_looping(self) -> str | None:
        """Why a pod of the benchmark keeps crashing, if one does."""
        for pod in self.api.get(f"/api/v1/namespaces/{self.namespace}/pods")["items"]:
            for c in (pod.get("status") or {}).get("containerStatuses") or []:
                waiting = (c.get("state") or {}).get("waiting") or {}
                if waiting.get("reason") == "CrashLoopBackOff" and c.get("restartCount", 0) >= 3:
                    last = (c.get("lastState") or {}).get("terminated") or {}
                    return (
                        f"pod {pod['metadata']['name']} keeps crashing (exit code "
                        f"{last.get('exitCode')}): kubectl -n {self.namespace} logs "
                        f"{pod['metadata']['name']} --previous says why"
                    )
        return None

    def wait(self, what: str, check: Any, timeout_s: float = 600) -> Any:
        """Until ``check()`` is truthy (its value), failing early if a pod keeps crashing."""

        def done() -> Any:
            value = check()
            if not value and (why := self.crash_looping()):
                raise RuntimeError(f"while waiting for {what}: {why}")
            return value

        try:
            return wait_until(done, timeout_s, what, interval=0.5)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; operator log: {self.log}") from None
