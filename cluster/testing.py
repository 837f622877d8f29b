"""Helpers for tests against a cluster (``e2e/`` and any test given a cluster): no pytest inside.

``KubeUnderTest`` is the cluster a test run uses, ours or the one ``KUBECONFIG`` names;
``leftovers_of`` lists what a cluster left on the host; ``end_on_sigterm`` makes a stopped
run take its clusters down.
"""

from __future__ import annotations

import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from conveyor.cluster.api import ApiClient, kubeconfig, write_kubeconfig
from conveyor.cluster.cluster import Cluster
from conveyor.cluster.leftovers import find_leftovers


def end_on_sigterm() -> None:
    """Make a SIGTERM end this process as Ctrl-C does, by a ``KeyboardInterrupt``: pytest then
    tears its fixtures down, so the clusters they started (in sessions of their own, which a
    signal to the test run's process group does not reach) are stopped. Otherwise a run
    stopped by a CI timeout or a cancel leaves its cluster up, and the next run on the machine
    finds one running and cannot start its own. Call from the main thread (``pytest_configure``)."""

    def interrupt(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def leftovers_of(cluster: Cluster) -> dict[str, list[str]]:
    """What ``cluster``, stopped, left on the host: the kinds with something (empty: nothing)."""
    tools = cluster.tools.directory if cluster.tools is not None else None
    left = find_leftovers(cluster.plan, cluster_name=cluster.settings.name, tools_dir=tools)
    return {kind: found for kind, found in left.items() if found}


@dataclass
class KubeUnderTest:
    """The cluster the tests run against: ours (``cluster`` set) or the one ``KUBECONFIG`` names."""

    kubeconfig: Path
    kubectl_path: str
    cluster: Cluster | None
    baseline_rulesets: dict[str, str] = field(default_factory=dict)
    owned: bool = True
    """False when the tests found a cluster already running and only use it."""

    @property
    def api(self) -> ApiClient:
        if self.cluster is not None:
            return self.cluster.api
        return ApiClient.from_kubeconfig(self.kubeconfig)

    def token_kubeconfig(self, token: str, path: Path) -> Path:
        """Write a kubeconfig for the same server that logs in with ``token`` alone."""
        creds = self.api.credentials
        write_kubeconfig(
            path,
            kubeconfig(server=creds.server, ca=creds.ca_file, user="token-user", token=token),
        )
        return path

    def kubectl(
        self,
        *args: str,
        input_: str | None = None,
        check: bool = True,
        kubeconfig_path: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against the cluster, as a user would (as admin unless told another kubeconfig)."""
        proc = subprocess.run(
            [self.kubectl_path, f"--kubeconfig={kubeconfig_path or self.kubeconfig}", *args],
            capture_output=True,
            text=True,
            input=input_,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr}"
            )
        return proc
