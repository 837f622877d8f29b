"""An LLMService served end to end on real nodes, from the project's image.

The module starts its own cluster (``realnode-e2e``: one GPU node with fake GPUs and one CPU
node, each a real kubelet with its own containerd and runc, both cloned from the seed that
holds the project's image), runs the operator as the other e2e tests do (a local process
under its ServiceAccount's token) with its images set to the seeded tag, and applies an
LLMService: the kubelets run its runtime pod and the namespace's gateway from the image, with
the operator's probes, resources, GPU request, toleration and graceful termination. An OpenAI
client is answered through the gateway's ClusterIP; deleting the LLMService stops both pods
with exit 0 within their grace period. The example (``examples/llmservice.yaml``, SmolLM2
from the image) answers right. The cluster then goes down leaving nothing.

Skipped unless root, the project's image is there (``conveyor image build``; no test
builds it), containerd and the node tools are installed (``cluster/build-tools.sh --set node``)
and no other cluster runs here. scripts/test.sh builds both as root and sets
``CONVEYOR_REAL_NODES_REQUIRED=1``: then each of those reasons is a failure, not a skip.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from operator_helpers import (
    REPO,
    OperatorIdentity,
    apply_yaml,
    install_crd,
    llmservice,
    llmservice_status,
    operators,
    wait_for,
)
from real_nodes_helpers import (
    IMAGE,
    IMAGE_PATH,
    REQUIRED,
    PodWatch,
    cannot_run,
    exit_codes,
    why_no_real_nodes,
)

from conveyor.cluster.cluster import Cluster
from conveyor.cluster.settings import ClusterSettings
from conveyor.cluster.testing import KubeUnderTest, leftovers_of

NAME = "realnode-e2e"
MODEL = "tiny"
POD_SELECTOR = "app.kubernetes.io/name=conveyor"
EXAMPLE = REPO / "examples" / "llmservice.yaml"
CONTAINER_FACTS = (
    "id -u; touch /probe-write 2>/dev/null && echo writable || echo read-only; "
    "cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max"
)
"""Prints the container's user, whether its root is writable, and its memory limit."""

_WHY_NOT = why_no_real_nodes()
pytestmark = pytest.mark.skipif(_WHY_NOT is not None and not REQUIRED, reason=_WHY_NOT or "")


@pytest.fixture(scope="module")
def real_kube() -> Iterator[KubeUnderTest]:
    """The module's own cluster on real nodes; down at the end, and nothing of it left."""
    settings = ClusterSettings(name=NAME, gpu_nodes=1, cpu_nodes=1, node_images=(str(IMAGE_PATH),))
    if _WHY_NOT is not None:
        cannot_run(_WHY_NOT)
    if (other := Cluster.attach()) is not None:  # e.g. started by other e2e modules' session
        cannot_run(f"cluster {other.settings.name!r} runs on this machine (one per machine)")
    cluster = Cluster(settings)
    started = time.monotonic()
    try:
        cluster.start()
        print(f"\n[figures] cluster up (1 GPU + 1 CPU real node): {time.monotonic() - started:.1f} s"
              f" (seed import {cluster.timings.get('seed_import_s', 0.0):.1f} s, 0: cached)",
              file=sys.stderr)  # fmt: skip
        assert cluster.tools is not None
        yield KubeUnderTest(cluster.kubeconfig_path, str(cluster.tools.path("kubectl")), cluster)
    except BaseException:
        print(cluster.log_tails(30), file=sys.stderr)
        raise
    finally:
        down = time.monotonic()
        cluster.stop()
        print(f"[figures] cluster down: {time.monotonic() - down:.1f} s", file=sys.stderr)
    assert leftovers_of(cluster) == {}


def _pods(kube: KubeUnderTest, namespace: str, component: str) -> list[dict[str, Any]]:
    selector = f"{POD_SELECTOR},app.kubernetes.io/component={component}"
    items: list[dict[str, Any]] = kube.api.get(
        f"/api/v1/namespaces/{namespace}/pods", labelSelector=selector
    )["items"]
    return items


def _check_real_node(kube: KubeUnderTest, pod: dict[str, Any]) -> dict[str, Any]:
    """The pod runs the project's image on a node that is a real kubelet with containerd."""
    container = pod["spec"]["containers"][0]
    assert container["image"] == IMAGE
    assert pod["status"]["containerStatuses"][0]["image"] == IMAGE
    node = kube.api.get(f"/api/v1/nodes/{pod['spec']['nodeName']}")
    info = node["status"]["nodeInfo"]
    assert info["kubeletVersion"].startswith("v"), info
    assert info["containerRuntimeVersion"].startswith("containerd://"), info
    return node


def _startup_split(pod: dict[str, Any]) -> str:
    """Where a pod's time to Ready went, from the apiserver's whole-second timestamps."""

    def at(stamp: str) -> float:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()

    created = at(pod["metadata"]["creationTimestamp"])
    conditions = {c["type"]: at(c["lastTransitionTime"]) for c in pod["status"]["conditions"]}
    started = at(pod["status"]["containerStatuses"][0]["state"]["running"]["startedAt"])
    return (f"created -> scheduled {conditions['PodScheduled'] - created:.0f} s, -> container "
            f"started {started - conditions['PodScheduled']:.0f} s, -> Ready "
            f"{conditions['Ready'] - started:.0f} s")  # fmt: skip


@pytest.fixture
def operated(real_kube: KubeUnderTest, tmp_path: Path) -> Iterator[str]:
    """A namespace of the module's cluster with an operator watching it (a local process under
    its ServiceAccount's token, as in the other e2e tests) whose images are the seeded tag."""
    kube = real_kube
    name = f"realnode-{uuid.uuid4().hex[:6]}"
    kube.api.create(
        "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
    )
    kube.api.wait_for(
        f"the default ServiceAccount of {name}",
        lambda: kube.api.get(f"/api/v1/namespaces/{name}/serviceaccounts/default"),
        timeout_s=60,
    )
    install_crd(kube)
    identity = OperatorIdentity(kube, name, tmp_path)
    images = ("--runtime-image", IMAGE, "--gateway-image", IMAGE, "--image-pull-policy", "Never")
    try:
        with operators(identity, tmp_path) as start:
            operator = start("op-a", extra=images)
            wait_for("the operator to take the Lease", operator.is_leader, timeout_s=60)
            yield name
    finally:
        identity.close()
        kube.api.delete(f"/api/v1/namespaces/{name}")


def test_llmservice_served_from_the_image_on_real_nodes(
    real_kube: KubeUnderTest, operated: str
) -> None:
    import openai

    kube, namespace = real_kube, operated
    service = llmservice(
        MODEL, engine="conveyor", resources={"gpus": 1, "cpu": "500m", "memory": "1536Mi"}
    )
    applied = time.monotonic()
    apply_yaml(kube, namespace, service)
    status = wait_for(
        "the LLMService Ready",
        lambda: (s := llmservice_status(kube.api, namespace, MODEL)).get("phase") == "Ready" and s,
        timeout_s=300,
        interval_s=0.2,
    )
    ready_s = time.monotonic() - applied
    endpoint = status["endpoint"]
    client = openai.OpenAI(
        base_url=f"http://{endpoint['clusterIP']}:8080/v1", api_key="none",
        max_retries=0, timeout=60,
    )  # fmt: skip
    question = [{"role": "user", "content": "Say hello."}]
    asked = time.monotonic()
    chat = wait_for(
        "an answer through the gateway",
        lambda: client.chat.completions.create(
            model=MODEL, messages=question, max_tokens=8, temperature=0
        ),
        timeout_s=120,
    )
    answered = time.monotonic()
    assert chat.choices[0].message.content, chat
    assert chat.usage is not None and chat.usage.completion_tokens > 0
    warm = time.monotonic()
    client.chat.completions.create(model=MODEL, messages=question, max_tokens=8, temperature=0)
    warm_s = time.monotonic() - warm
    print(f"[figures] LLMService apply -> Ready {ready_s:.1f} s; Ready -> first answer "
          f"{answered - asked:.2f} s (apply -> first answer {answered - applied:.1f} s); "
          f"a second answer {warm_s:.2f} s; answer {chat.choices[0].message.content!r}",
          file=sys.stderr)  # fmt: skip

    (runtime,) = _pods(kube, namespace, "runtime")
    log = kube.kubectl("-n", namespace, "logs", runtime["metadata"]["name"], "-c", "runtime").stdout
    says = [line for line in log.splitlines() if "ready in" in line]
    print(f"[figures] runtime pod: {_startup_split(runtime)} (the server: {says[-1:]})",
          file=sys.stderr)  # fmt: skip
    gpu_node = _check_real_node(kube, runtime)
    limits = runtime["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "1"
    assert int(gpu_node["status"]["capacity"]["nvidia.com/gpu"]) >= 1
    assert any(t["key"] == "nvidia.com/gpu" for t in gpu_node["spec"].get("taints", []))
    # the fake device plugin's allocation reached the container (as NVIDIA's would)
    visible = kube.kubectl("-n", namespace, "exec", runtime["metadata"]["name"], "-c",
                           "runtime", "--", "printenv", "NVIDIA_VISIBLE_DEVICES")  # fmt: skip
    assert visible.stdout.strip(), visible
    (gateway,) = _pods(kube, namespace, "gateway")
    _check_real_node(kube, gateway)
    for pod in (runtime, gateway):  # no probe of the kubelet's has restarted either
        assert pod["status"]["containerStatuses"][0]["restartCount"] == 0, pod["status"]
    # The container as runc made it from the operator's spec: user 1000, read-only root,
    # the memory limit in its cgroup (v1 here, v2 elsewhere).
    inside = kube.kubectl("-n", namespace, "exec", runtime["metadata"]["name"], "-c", "runtime",
                          "--", "sh", "-c", CONTAINER_FACTS).stdout.split()  # fmt: skip
    assert inside == ["1000", "read-only", str(1536 * 2**20)], inside

    # The runtime's process ends (SIGTERM from inside): the kubelet restarts the container and
    # the LLMService is served again.
    pod_path = f"/api/v1/namespaces/{namespace}/pods/{runtime['metadata']['name']}"
    stopped = time.monotonic()
    kube.kubectl("-n", namespace, "exec", runtime["metadata"]["name"], "-c", "runtime",
                 "--", "sh", "-c", "kill 1")  # fmt: skip

    def restarted_and_ready() -> bool:
        status = kube.api.get(pod_path)["status"]
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status["conditions"])
        return status["containerStatuses"][0]["restartCount"] == 1 and ready

    wait_for("the runtime restarted and Ready", restarted_and_ready, timeout_s=120)
    wait_for(
        "an answer after the restart",
        lambda: client.chat.completions.create(model=MODEL, messages=question, max_tokens=8),
        timeout_s=60,
    )
    last = kube.api.get(pod_path)["status"]["containerStatuses"][0]["lastState"]["terminated"]
    print(f"[figures] runtime's process ended -> restarted by the kubelet, Ready and answering "
          f"{time.monotonic() - stopped:.1f} s (it exited {last['exitCode']})", file=sys.stderr)  # fmt: skip
    grace = {
        p["metadata"]["name"]: p["spec"]["terminationGracePeriodSeconds"]
        for p in (runtime, gateway)
    }

    # Deleting the LLMService: its pods and the gateway's stop gracefully.
    watch = PodWatch(kube, namespace, POD_SELECTOR)
    try:
        wait_for("the watch's first events", lambda: len(watch.seen()) >= 2, timeout_s=30)
        deleted = time.monotonic()
        kube.kubectl("-n", namespace, "delete", "llmservice", MODEL, "--wait=false")
        deployments_gone: list[float] = []

        def pods_gone() -> bool:
            path = f"/apis/apps/v1/namespaces/{namespace}/deployments"
            if not deployments_gone and not kube.api.get(path)["items"]:
                deployments_gone.append(time.monotonic())
            pods = f"/api/v1/namespaces/{namespace}/pods"
            return not kube.api.get(pods, labelSelector=POD_SELECTOR)["items"]

        # the garbage collector may take up to a minute to act on a fresh CRD's owner
        wait_for("every pod gone", pods_gone, timeout_s=max(grace.values()) + 120,
                 interval_s=0.5)  # fmt: skip
        print(f"[figures] LLMService deleted -> Deployments gone "
              f"{deployments_gone[0] - deleted:.1f} s", file=sys.stderr)  # fmt: skip
        time.sleep(0.5)  # the watch's last event after the list shows none
    finally:
        watch.stop()
    events = watch.seen()
    for name, grace_s in grace.items():
        mine = [(t, kind, pod) for t, kind, pod in events if pod["metadata"]["name"] == name]
        gone = [t for t, kind, _ in mine if kind == "DELETED"]
        assert gone, f"no DELETED event for {name}: {[k for _, k, _ in mine]}"
        # the garbage collector's deletion of the pod (deletionTimestamp set)
        stopping = [t for t, _, pod in mine if pod["metadata"].get("deletionTimestamp")]
        codes = exit_codes([pod for _, _, pod in mine])
        took = gone[0] - stopping[0]
        print(f"[figures] {name}: LLMService deleted -> pod deleted "
              f"{stopping[0] - deleted:.1f} s, pod deleted -> gone {took:.1f} s "
              f"(grace {grace_s} s), exit codes {codes}", file=sys.stderr)  # fmt: skip
        assert codes and all(code == 0 for code in codes.values()), (name, codes)
        assert took < grace_s, (name, took, grace_s)


def test_the_example_answers_through_the_gateway(real_kube: KubeUnderTest, operated: str) -> None:
    """``kubectl apply -f examples/llmservice.yaml`` as written (SmolLM2 from the image, one
    GPU, its own cpu and memory): a right answer through the gateway, streamed and not."""
    import openai

    kube, namespace = real_kube, operated
    applied = time.monotonic()
    kube.kubectl("-n", namespace, "apply", "-f", str(EXAMPLE))
    status = wait_for(
        "the example Ready",
        lambda: (
            (s := llmservice_status(kube.api, namespace, "smollm2")).get("phase") == "Ready" and s
        ),
        timeout_s=300,
    )
    ready_s = time.monotonic() - applied
    client = openai.OpenAI(
        base_url=f"http://{status['endpoint']['clusterIP']}:8080/v1", api_key="none",
        max_retries=0, timeout=120,
    )  # fmt: skip
    question = [{"role": "user", "content": "What is the capital of France?"}]
    chat = wait_for(
        "an answer through the gateway",
        lambda: client.chat.completions.create(
            model="smollm2", messages=question, max_tokens=32, temperature=0
        ),
        timeout_s=120,
    )
    answered_s = time.monotonic() - applied
    assert "Paris" in (chat.choices[0].message.content or ""), chat
    stream = client.chat.completions.create(
        model="smollm2", messages=question, max_tokens=32, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == chat.choices[0].message.content
    (runtime,) = _pods(kube, namespace, "runtime")
    _check_real_node(kube, runtime)
    print(f"[figures] example (smollm2) apply -> Ready {ready_s:.1f} s, apply -> first answer "
          f"{answered_s:.1f} s; answer {streamed!r}", file=sys.stderr)  # fmt: skip
