"""Deletion (preStop, SIGTERM, nothing left), in-cluster configuration, and the agent's own restart."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from agent_helpers import (
    container_status,
    create,
    ensure_node_agent,
    get_pod,
    mounts_below,
    pod,
    wait_gone,
    wait_phase,
    wait_pod,
    wait_ready,
)
from real_nodes_helpers import runs_on_real_nodes

from conveyor.cluster import Cluster
from conveyor.cluster.api import wait_for
from conveyor.cluster.podcgroups import ContainerCgroup
from conveyor.cluster.podnet import NETNS_DIR
from conveyor.cluster.process import process_start_time
from conveyor.cluster.testing import KubeUnderTest

# Records SIGTERM in the hostPath file, then exits; the preStop hook records itself there first.
# It is Ready once its handler is in place (an exec probe inside the container; /tmp is the
# pod's own emptyDir).
GRACEFUL = """
import signal, sys, time
def term(*_):
    with open('/data/events', 'a') as f:
        f.write('sigterm\\n')
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
open('/tmp/handling-sigterm', 'w').close()
while True:
    time.sleep(3600)
"""


def test_deletion_runs_prestop_then_sigterm_and_leaves_nothing(
    kube: KubeUnderTest, node_agent: Cluster, namespace: str, tmp_path: Path
) -> None:
    api = kube.api
    events = tmp_path / "events"
    create(
        api,
        namespace,
        pod(
            "graceful",
            ["python", "-c", GRACEFUL],
            lifecycle={
                "preStop": {"exec": {"command": ["sh", "-c", "echo prestop >> /data/events"]}}
            },
            readinessProbe={
                "exec": {"command": ["test", "-e", "/tmp/handling-sigterm"]},
                "periodSeconds": 1,
            },
            # The hostPath directory is the test's own (root's, mode 700); the project's image
            # runs as user 1000 unless told otherwise.
            securityContext={"runAsUser": 0},
            volumeMounts=[
                {"name": "data", "mountPath": "/data"},
                {"name": "shm", "mountPath": "/dev/shm"},
                {"name": "tmp", "mountPath": "/tmp"},
            ],
            pod_spec={
                "terminationGracePeriodSeconds": 20,
                "volumes": [
                    {"name": "data", "hostPath": {"path": str(tmp_path), "type": "Directory"}},
                    {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Mi"}},
                    {"name": "tmp", "emptyDir": {}},
                ],
            },
        ),
    )
    p = wait_ready(api, namespace, "graceful")
    if runs_on_real_nodes(node_agent):  # the kubelet's own volumes, cgroups and network
        api.delete(f"/api/v1/namespaces/{namespace}/pods/graceful")
        wait_gone(api, namespace, "graceful")
        assert events.read_text().split() == ["prestop", "sigterm"]
        return
    uid = p["metadata"]["uid"]
    netns, _ = node_agent.pod_networks.names(namespace, "graceful")
    pod_dir = node_agent.work_dir / "agent" / "pods" / uid
    cgroup = ContainerCgroup(node_agent.settings.name, uid, "main")
    assert (NETNS_DIR / netns).exists() and pod_dir.exists()
    assert mounts_below(pod_dir), "the memory volume is a tmpfs"
    assert all(d.exists() for d in cgroup.dirs.values())

    api.delete(f"/api/v1/namespaces/{namespace}/pods/graceful")
    wait_gone(api, namespace, "graceful")
    assert events.read_text().split() == ["prestop", "sigterm"]
    assert not (NETNS_DIR / netns).exists()
    assert not mounts_below(pod_dir)
    assert not pod_dir.exists()
    assert not any(d.exists() for d in cgroup.dirs.values())
    assert not any(d.parent.exists() for d in cgroup.dirs.values())


# Lists pods (allowed by the Role) and secrets (not allowed) with the in-cluster configuration.
IN_CLUSTER = """
import os, ssl, urllib.request, urllib.error
sa = '/var/run/secrets/kubernetes.io/serviceaccount'
token = open(f'{sa}/token').read()
namespace = open(f'{sa}/namespace').read()
ctx = ssl.create_default_context(cafile=f'{sa}/ca.crt')
base = f"https://{os.environ['KUBERNETES_SERVICE_HOST']}:{os.environ['KUBERNETES_SERVICE_PORT']}"
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ctx))
# kopf and other clients use the name the cluster's DNS gives the apiserver.
for server, kind in ((base, 'pods'), (base, 'secrets'), ('https://kubernetes.default.svc', 'pods')):
    req = urllib.request.Request(f'{server}/api/v1/namespaces/{namespace}/{kind}', headers={'Authorization': f'Bearer {token}'})
    try:
        code = opener.open(req, timeout=10).status
    except urllib.error.HTTPError as exc:
        code = exc.code
    print(kind, code, flush=True)
"""


def test_in_cluster_config_is_allowed_what_its_role_grants(
    kube: KubeUnderTest, node_agent: Cluster, namespace: str
) -> None:
    api = kube.api
    rbac = "rbac.authorization.k8s.io/v1"
    create(
        api,
        namespace,
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "reader"}},
    )
    create(
        api,
        namespace,
        {
            "apiVersion": rbac,
            "kind": "Role",
            "metadata": {"name": "pod-reader"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}],
        },
    )
    create(
        api,
        namespace,
        {
            "apiVersion": rbac,
            "kind": "RoleBinding",
            "metadata": {"name": "reader"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "pod-reader",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
        },
    )
    create(
        api,
        namespace,
        pod(
            "client",
            ["python", "-c", IN_CLUSTER],
            pod_spec={"serviceAccountName": "reader", "restartPolicy": "Never"},
            securityContext={"runAsUser": 1000, "runAsGroup": 1000, "runAsNonRoot": True},
        ),
    )
    p = wait_phase(api, namespace, "client", "Succeeded", "Failed")
    logs = kube.kubectl("logs", "-n", namespace, "client").stdout
    assert p["status"]["phase"] == "Succeeded", logs
    assert logs.split("\n")[:3] == ["pods 200", "secrets 403", "pods 200"], logs


# Writes its pid to its own file in the hostPath directory each time it starts.
MARKED = [
    "python",
    "-c",
    "import os; open('/data/' + os.environ['HOSTNAME'], 'a').write(f'{os.getpid()}\\n'); "
    "os.execvp('sleep', ['sleep', '100000'])",
]


def test_agent_killed_and_restarted_adopts_its_pods(
    kube: KubeUnderTest, node_agent: Cluster, agent_only: None, namespace: str, tmp_path: Path
) -> None:
    api = kube.api
    names = ["keep-a", "keep-b", "deleted-meanwhile"]
    for name in names:
        create(
            api,
            namespace,
            pod(
                name,
                MARKED,
                # Ready once it has written its pid.
                readinessProbe={
                    "exec": {"command": ["sh", "-c", 'test -s "/data/$HOSTNAME"']},
                    "periodSeconds": 1,
                },
                volumeMounts=[{"name": "data", "mountPath": "/data"}],
                pod_spec={
                    "terminationGracePeriodSeconds": 1,
                    "volumes": [{"name": "data", "hostPath": {"path": str(tmp_path)}}],
                },
            ),
        )
    before = {name: wait_ready(api, namespace, name) for name in names}
    pids = {name: int((tmp_path / name).read_text()) for name in names}

    proc = node_agent.processes["node-agent"]
    assert proc.record is not None
    old_pid = proc.record.pid
    # While the agent is down: one pod is deleted, one is created.
    os.kill(old_pid, signal.SIGKILL)
    wait_for(
        "the agent to end",
        lambda: process_start_time(old_pid) is None,
        timeout_s=30,
        interval_s=0.02,
    )
    api.delete(f"/api/v1/namespaces/{namespace}/pods/deleted-meanwhile")
    create(
        api,
        namespace,
        pod(
            "created-meanwhile", ["sleep", "100000"], pod_spec={"terminationGracePeriodSeconds": 1}
        ),
    )
    assert all(process_start_time(pid) is not None for pid in pids.values()), (
        "pods keep running without the agent"
    )

    new = ensure_node_agent(node_agent)
    try:
        wait_ready(api, namespace, "created-meanwhile")
    except TimeoutError as exc:  # seen once in CI, with no line of the new agent in its log
        assert new.record is not None
        ready = node_agent.work_dir / "agent" / "ready"
        raise AssertionError(
            f"{exc}; the old agent {old_pid}, the new one {new.record.pid} "
            f"(alive {new.alive()}, ready file {ready.read_text() if ready.exists() else None!r}); "
            f"its log:\n{new.tail()}"
        ) from exc
    wait_gone(api, namespace, "deleted-meanwhile")
    assert process_start_time(pids["deleted-meanwhile"]) is None
    for name in ("keep-a", "keep-b"):
        p = wait_ready(api, namespace, name)
        cs = container_status(p)
        assert cs["restartCount"] == 0
        assert cs["containerID"] == container_status(before[name])["containerID"]
        # One start only: the same process runs, no second copy was started.
        assert (tmp_path / name).read_text().split() == [str(pids[name])]
        assert process_start_time(pids[name]) is not None

    # The new agent still restarts and deletes.
    os.kill(pids["keep-a"], signal.SIGKILL)
    p = wait_pod(
        api,
        namespace,
        "keep-a",
        "restarted",
        lambda p: container_status(p).get("restartCount", 0) >= 1,
    )
    assert container_status(p)["lastState"]["terminated"]["exitCode"] == 137
    api.delete(f"/api/v1/namespaces/{namespace}/pods/keep-b")
    wait_gone(api, namespace, "keep-b")
    assert get_pod(api, namespace, "keep-a")["status"]["phase"] == "Running"
