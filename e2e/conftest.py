"""End-to-end fixtures: one Kubernetes cluster per test session, a namespace per test.

Without ``KUBECONFIG`` the session uses the one-machine cluster (``conveyor.cluster``)
that ``conveyor cluster up`` left running, or else starts one, building the pinned tools
first if needed (waiting for a build already running), and stops it at the end. Its nodes
are real (a kubelet, containerd and runc each) and hold the images built here
(``default_node_images``); where they cannot run, every test that needs the cluster skips
with the reason, or fails with ``CONVEYOR_REAL_NODES_REQUIRED=1``. With ``KUBECONFIG`` the
tests use that cluster and start nothing; tests that need the one-machine cluster's own
processes or host network skip with a reason. When a test fails, the tail of every
component's log is added to its report.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from operator_helpers import (
    OperatorIdentity,
    OperatorProcess,
    install_crd,
    operators,
    pods_run,
    wait_for,
)
from real_nodes_helpers import cannot_run, why_no_real_nodes

from conveyor.cluster import Cluster, ClusterAlreadyRunning, ClusterSettings
from conveyor.cluster.leftovers import rulesets
from conveyor.cluster.real_nodes import default_node_images
from conveyor.cluster.testing import KubeUnderTest, end_on_sigterm

E2E_DIR = Path(__file__).parent
_KUBE = pytest.StashKey[KubeUnderTest]()
E2E_TIMEOUT_S = 1800


def _why_no_local_cluster() -> str | None:
    if os.geteuid() != 0:
        return "the one-machine cluster needs root (network namespaces, routes, nftables); or set KUBECONFIG"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            return f"`{tool}` is missing: run cluster/install-system-deps.sh"
    if shutil.which("go") is None and not Path("/usr/local/go/bin/go").exists():
        return "the Go toolchain is missing (needed to build the pinned cluster tools)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_timeout = config.pluginmanager.hasplugin("timeout")
    for item in items:
        if E2E_DIR in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)
            # The first test's setup may wait for the cold build of the tools (~15 min on
            # 2 cores), which pytest-timeout counts against that test.
            if has_timeout and item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(E2E_TIMEOUT_S))


def _running_cluster() -> KubeUnderTest | None:
    """The one-machine cluster already running here, if any, to be used and left running."""
    running = Cluster.attach()
    if running is None or running.tools is None:
        return None
    print(f"\n[e2e] using the running cluster {running.settings.name!r}", file=sys.stderr)
    kubectl = str(running.tools.path("kubectl"))
    return KubeUnderTest(running.kubeconfig_path, kubectl, running, owned=False)


@pytest.fixture(scope="session")
def kube(request: pytest.FixtureRequest) -> Iterator[KubeUnderTest]:
    """The session's cluster."""
    external = os.environ.get("KUBECONFIG")
    if external:
        kubectl = shutil.which("kubectl")
        if kubectl is None:
            pytest.skip("KUBECONFIG is set but no kubectl is on PATH")
        under_test = KubeUnderTest(Path(external), kubectl, None)
        request.config.stash[_KUBE] = under_test
        yield under_test
        return
    if reason := _why_no_local_cluster():
        pytest.skip(reason)
    if (running := _running_cluster()) is not None:
        # `conveyor cluster up` (or another test session) has one running: use it, leave it.
        request.config.stash[_KUBE] = running
        yield running
        return
    if reason := why_no_real_nodes():
        cannot_run(reason)
    if "/usr/local/go/bin" not in os.environ.get("PATH", ""):
        os.environ["PATH"] = os.environ.get("PATH", "") + ":/usr/local/go/bin"
    # CONVEYOR_TOOLS_DIR: binaries built elsewhere; unset, the pinned build (or its cache).
    tools_dir = os.environ.get("CONVEYOR_TOOLS_DIR")
    # The nodes hold the project's image, and vLLM for CPU's where built (test_engines).
    cluster = Cluster(
        ClusterSettings(
            name="e2e",
            tools_dir=Path(tools_dir) if tools_dir else None,
            node_images=tuple(map(str, default_node_images())),
        )
    )
    baseline = rulesets()
    started = time.monotonic()
    try:
        cluster.start()
    except ClusterAlreadyRunning:
        # Another session started one while this one was getting ready.
        if (running := _running_cluster()) is None:
            raise
        request.config.stash[_KUBE] = running
        yield running
        return
    print(
        f"\n[e2e] cluster up in {time.monotonic() - started:.1f} s (tools included): {cluster.server}",
        file=sys.stderr,
    )
    assert cluster.tools is not None
    under_test = KubeUnderTest(
        cluster.kubeconfig_path, str(cluster.tools.path("kubectl")), cluster, baseline
    )
    request.config.stash[_KUBE] = under_test
    try:
        yield under_test
    finally:
        (under_test.cluster or cluster).stop()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo
) -> Iterator[pytest.TestReport]:
    report = yield
    under_test = item.config.stash.get(_KUBE, None)
    if report.failed and under_test is not None and under_test.cluster is not None:
        report.sections.append(("cluster component logs", under_test.cluster.log_tails(30)))
    return report


@pytest.fixture
def namespace(kube: KubeUnderTest, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace for one test (deleted afterwards, without waiting)."""
    base = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")
    name = f"{base}-{uuid.uuid4().hex[:6]}"
    api = kube.api
    api.create(
        "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
    )
    api.wait_for(
        f"the default ServiceAccount of {name}",
        lambda: api.get(f"/api/v1/namespaces/{name}/serviceaccounts/default"),
        timeout_s=60,
    )
    yield name
    api.delete(f"/api/v1/namespaces/{name}")
    if kube.cluster is not None:
        # Force the pods' deletion rather than wait for each one's graceful termination,
        # so that their GPUs are free for the next test at once. The namespace is
        # Terminating first, so no controller makes new pods.
        pods = f"/api/v1/namespaces/{name}/pods"

        def gone() -> bool:
            api.request("DELETE", pods, query={"gracePeriodSeconds": "0"})
            return not api.get(pods)["items"]

        api.wait_for(f"the pods of {name} deleted", gone, timeout_s=60)


@pytest.fixture
def own_cluster(kube: KubeUnderTest) -> Cluster:
    """The one-machine cluster; skips when the tests run against the cluster KUBECONFIG names."""
    if kube.cluster is None:
        pytest.skip(
            "needs the one-machine cluster (its nodes, processes and host network); KUBECONFIG names another cluster"
        )
    return kube.cluster


@pytest.fixture
def owned_cluster(kube: KubeUnderTest, own_cluster: Cluster) -> Cluster:
    """The one-machine cluster this session started (tests that stop it need that)."""
    if not kube.owned:
        pytest.skip("stops the cluster; the session uses one that was already running")
    return own_cluster


# ---- the operator's fixtures (test_operator*.py, test_autoscaling.py) ------------------------


@pytest.fixture(scope="session")
def crd(kube: KubeUnderTest) -> None:
    install_crd(kube)


@pytest.fixture
def identity(
    kube: KubeUnderTest, namespace: str, crd: None, tmp_path: Path
) -> Iterator[OperatorIdentity]:
    ident = OperatorIdentity(kube, namespace, tmp_path)
    yield ident
    ident.close()


@pytest.fixture
def start_operator(
    identity: OperatorIdentity, tmp_path: Path
) -> Iterator[Callable[..., OperatorProcess]]:
    with operators(identity, tmp_path) as start:
        yield start


@pytest.fixture
def operator(start_operator: Callable[..., OperatorProcess]) -> OperatorProcess:
    op = start_operator("op-a")
    wait_for("the operator to take the Lease", op.is_leader, timeout_s=60)
    return op


_PODS_RUN = pytest.StashKey[str]()


@pytest.fixture
def running_pods(kube: KubeUnderTest, namespace: str, request: pytest.FixtureRequest) -> None:
    """Skips unless pods really run here (probed once per session)."""
    stash = request.config.stash
    if _PODS_RUN not in stash:
        stash[_PODS_RUN] = pods_run(kube, namespace) or ""
    if stash[_PODS_RUN]:
        pytest.skip(stash[_PODS_RUN])


def pytest_configure(config: pytest.Config) -> None:
    end_on_sigterm()  # a stopped run takes its clusters down (conveyor.cluster.testing)
