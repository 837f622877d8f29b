"""An LLMService on vLLM: the real vLLM (vLLM for CPU's image, built here by ``conveyor image
build --engine vllm``) behind Conveyor's operator and gateway, on the one-machine cluster.

One vLLM LLMService serves the module (vLLM takes a minute or more to start; its spec and
probes are in ``vllm_helpers``): it becomes Ready on the built-in model (written into the cache
volume by the model container before vLLM starts), answers chat and streamed completions
through the namespace gateway, says on ``/v1/models`` that vLLM served it, and the gateway's
view of the replica follows vLLM's own gauges; every dashboard panel draws it. Then the
autoscaler takes it to two replicas on vLLM's queue and back, to zero when idle and back to
one for a held request; last, a change of model to the built-in SmolLM2 rolls out under
traffic without a failed request. The tests run in this order and each relies on the ones
before. (A spec asking vLLM for a setting it lacks is refused: ``test_operator``.)

The operator runs as a local process (as in ``test_operator``). Skips, with the reason, where
the nodes do not hold vLLM for CPU's image, or pods do not really run here.
"""

from __future__ import annotations

import contextlib
import re
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from operator_helpers import (
    OperatorIdentity,
    apply_yaml,
    decisions,
    install_crd,
    llmservice,
    llmservice_status,
    operators,
    pods_run,
    scale_events,
    wait_for,
)
from traffic import Load, run_load
from vllm_helpers import (
    AUTOSCALING,
    CLIENTS,
    NAME,
    NO_PROXY,
    OPERATOR_FLAGS,
    READY_S,
    REPLICA,
    RUNTIME,
    SMOLLM2,
    autoscaler_signals,
    gateway_url,
    patch_spec,
    ready_status,
    replicas,
    requests_per_replica,
    runtime_logs,
    runtime_pods,
)

from conveyor.cluster.image_plan import VLLM_REPOSITORY
from conveyor.cluster.real_nodes import VLLM_CPU_IMAGE
from conveyor.cluster.stack_images import holds_image
from conveyor.cluster.testing import KubeUnderTest
from conveyor.cluster.tools import build_tools
from conveyor.contracts.engine_load import VLLM, samples
from conveyor.observability import grafana, panel_check
from conveyor.observability import names as n
from conveyor.observability.panel_check import AllowedEmpty
from conveyor.observability.prometheus import Prometheus, PrometheusSettings
from conveyor.operator.engines import VLLM_IMAGE

SCRAPE_S = 1.0
"""Prometheus' scrape and rule interval: short, so the module's few minutes are well seen."""
STREAMS = 6
"""Clients streaming back to back in the queue test: three times vLLM's batch (2), so that
about four requests wait at any moment."""
ALLOWED_EMPTY = (
    AllowedEmpty("Error ratio", "conveyor_gateway_requests_total", "no request fails here"),
    # recorded from vLLM's series, so without metadata of their own: the test checks the
    # series are there instead
    AllowedEmpty(
        "Preemptions per replica", "conveyor_num_preemptions_total",
        "vLLM's KV cache holds every sequence of the tiny model: none is preempted",
        must_exist=False,
    ),
    AllowedEmpty(
        "Prefix-cache hit rate", "conveyor_prefix_cache_hits_total",
        "the prompts are short and distinct: vLLM caches whole 128-token blocks only",
        must_exist=False,
    ),
    AllowedEmpty(
        "Time to first token", "conveyor_autoscaler_target",
        "the LLMService is not autoscaled (and the operator runs outside the cluster)",
        must_exist=False,
    ),
)  # fmt: skip
"""Panel queries of the LLMService dashboard that this run leaves empty, and why."""


@pytest.fixture(scope="module")
def module_namespace(kube: KubeUnderTest) -> Iterator[str]:
    """One namespace for the module's one vLLM LLMService (deleted afterwards)."""
    name = f"engines-{uuid.uuid4().hex[:6]}"
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
        pods = f"/api/v1/namespaces/{name}/pods"

        def gone() -> bool:
            api.request("DELETE", pods, query={"gracePeriodSeconds": "0"})
            return not api.get(pods)["items"]

        api.wait_for(f"the pods of {name} deleted", gone, timeout_s=60)


@pytest.fixture(scope="module")
def vllm_service(
    kube: KubeUnderTest, module_namespace: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """The module's vLLM LLMService, Ready: its status and the seconds from apply to Ready.

    Its pods run vLLM for CPU's image (``conveyor image build --engine vllm``, which the nodes'
    seed holds); on a cluster from ``KUBECONFIG``, the operator's vLLM image, which it pulls."""
    if kube.cluster is not None and not holds_image(kube.cluster.settings, VLLM_REPOSITORY):
        pytest.skip(
            "the nodes have no vLLM for CPU image: conveyor image build --engine vllm "
            "(scripts/test.sh builds it)"
        )
    runtime = {**RUNTIME, "image": VLLM_CPU_IMAGE} if kube.cluster is not None else RUNTIME
    if reason := pods_run(kube, module_namespace):
        pytest.skip(reason)
    install_crd(kube)
    workdir = tmp_path_factory.mktemp("engines")
    identity = OperatorIdentity(kube, module_namespace, workdir)
    prometheus = PrometheusSettings(
        binary=build_tools(("prometheus",), quiet=True).path("prometheus"),
        scrape_interval_s=SCRAPE_S,
        evaluation_interval_s=SCRAPE_S,
        kubeconfig=kube.kubeconfig,
        namespaces=(module_namespace,),
        work_dir=workdir / "prometheus",
    )
    try:
        with Prometheus(prometheus) as prom, operators(identity, workdir) as start:
            run_start = time.time()
            op = start("op-a", OPERATOR_FLAGS)
            wait_for("the operator to take the Lease", op.is_leader, timeout_s=60)
            started = time.monotonic()
            apply_yaml(
                kube,
                module_namespace,
                llmservice(NAME, engine="vllm", resources=REPLICA, runtime=runtime),
            )
            status = wait_for(
                f"LLMService {NAME} on vLLM Ready",
                lambda: ready_status(kube, module_namespace, op),
                timeout_s=READY_S,
            )
            ready_s = time.monotonic() - started
            print(f"\n[e2e] vLLM LLMService apply -> Ready: {ready_s:.0f} s", file=sys.stderr)
            yield {
                "status": status,
                "ready_s": ready_s,
                "namespace": module_namespace,
                "prometheus": prom.api(),
                "start": run_start,
                "operator": op,
                "image": runtime.get("image") or VLLM_IMAGE,
            }
    finally:
        identity.close()


def test_vllm_llmservice_is_ready_and_answers_through_the_gateway(
    vllm_service: dict[str, Any], kube: KubeUnderTest, client: Any
) -> None:
    namespace = vllm_service["namespace"]
    (pod,) = runtime_pods(kube, namespace)
    images = {c["name"]: c["image"] for c in pod["spec"]["containers"]}
    assert images["runtime"] == vllm_service["image"]
    models = NO_PROXY.get(f"http://{pod['status']['podIP']}:8000/v1/models").json()
    assert [(m["id"], m["owned_by"]) for m in models["data"]] == [(NAME, "vllm")]
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hello"}], max_tokens=8
    )
    assert chat.choices[0].message.content and chat.usage and chat.usage.completion_tokens == 8
    stream = client.completions.create(model=NAME, prompt="Once upon", max_tokens=8, stream=True)
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert text
    streamed_chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True
    )
    assert any(c.choices and c.choices[0].delta.content for c in streamed_chat)


def test_the_gateway_sees_what_vllms_own_gauges_say(
    vllm_service: dict[str, Any], kube: KubeUnderTest
) -> None:
    """Streams beyond vLLM's batch (2): vLLM's waiting gauge and the gateway's view of the
    replica both show the queue; when the streams end, both go back to 0."""
    namespace = vllm_service["namespace"]
    (pod,) = runtime_pods(kube, namespace)
    backend = f"http://{pod['status']['podIP']}:8000"
    gateway = gateway_url(kube, namespace)
    base = f"http://{vllm_service['status']['endpoint']['clusterIP']}:8080/v1"

    def gateway_view() -> dict[str, float]:
        text = NO_PROXY.get(f"{gateway}/metrics").text
        view = {}
        for line in text.splitlines():
            if line.startswith("conveyor_gateway_backend_load{") and f'backend="{backend}"' in line:
                signal = re.search(r'signal="([a-z_]+)"', line)
                assert signal is not None
                view[signal.group(1)] = float(line.rsplit(" ", 1)[1])
        return view

    def vllm_view() -> dict[str, float]:
        found = samples(
            NO_PROXY.get(f"{backend}/metrics").text,
            (VLLM.running, VLLM.waiting, VLLM.kv_cache_usage),
        )
        return {
            "running": sum(found[VLLM.running]),
            "waiting": sum(found[VLLM.waiting]),
            "kv_cache_usage": sum(found[VLLM.kv_cache_usage]),
        }

    stop = threading.Event()
    failures: list[str] = []
    sent = [0] * STREAMS
    """Requests each client has sent so far, for the failure message."""

    def stream(i: int) -> None:
        """One client streaming completions back to back until told to stop: vLLM writes the
        tiny model's 4,000 tokens in seconds, so single requests would drain the queue before
        the checks below have seen it for long."""
        body = {
            "model": NAME, "prompt": f"story {i}", "max_tokens": 4000, "stream": True,
            "ignore_eos": True,
        }  # fmt: skip
        try:
            with httpx.Client(trust_env=False, timeout=120) as client:
                while not stop.is_set():
                    sent[i] += 1
                    with client.stream("POST", f"{base}/completions", json=body) as response:
                        if response.status_code != 200:
                            failures.append(f"stream {i}: HTTP {response.status_code}")
                            return
                        for _ in response.iter_lines():
                            if stop.is_set():
                                return  # closing the stream aborts the request in vLLM
        except httpx.HTTPError as exc:
            if not stop.is_set():
                failures.append(f"stream {i}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(STREAMS)]
    for t in threads:
        t.start()
    seen_last: list[tuple[float, dict[str, float], dict[str, float]]] = []
    """What each side last showed, so that a timeout says which of them missed the queue."""
    started = time.monotonic()
    try:

        def both_see_the_queue() -> tuple[dict[str, float], dict[str, float]] | None:
            assert not failures, failures
            engine, seen = vllm_view(), gateway_view()
            seen_last[:] = [(time.monotonic() - started, engine, seen)]
            if engine["waiting"] >= 1 and seen.get("waiting", 0) >= 1:
                return engine, seen
            return None

        try:
            engine, seen = wait_for(
                "vLLM's queue in its gauges and in the gateway's view",
                both_see_the_queue,
                timeout_s=120,
                interval_s=0.2,
            )
        except TimeoutError as exc:
            gateway_log = kube.kubectl(
                "-n", namespace, "logs", "-l", "app.kubernetes.io/component=gateway",
                "--tail=15", "--prefix", check=False,
            )  # fmt: skip
            raise AssertionError(
                (
                    f"{exc}; at +{seen_last[0][0]:.1f} s vLLM's gauges said {seen_last[0][1]}, "
                    f"the gateway's view {seen_last[0][2]}; requests sent per client {sent}"
                    if seen_last
                    else f"{exc}; neither vLLM's /metrics nor the gateway's ever answered"
                )
                + f"\nthe gateways' logs:\n{gateway_log.stdout}{gateway_log.stderr}"
            ) from exc
        assert engine["running"] == 2 and seen["running"] == 2  # vLLM's batch, as set
        assert engine["kv_cache_usage"] > 0 and seen["kv_cache_usage"] > 0
        # the queue held until Prometheus has recorded it for a while (the dashboard test)
        api = vllm_service["prometheus"]
        wait_for(
            "Prometheus to record vLLM's queue for 10 s",
            lambda: api.query(f'min_over_time({n.WAITING}{{llmservice="{NAME}"}}[10s]) > 0'),
            timeout_s=120,
        )
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not failures, failures
    wait_for(
        "vLLM and the gateway's view back to idle",
        lambda: (
            vllm_view()["running"] == 0
            and gateway_view().get("running") == 0
            and gateway_view().get("waiting") == 0
        ),
        timeout_s=60,
        interval_s=0.5,
    )


def test_every_llmservice_dashboard_panel_shows_the_vllm_llmservice(
    vllm_service: dict[str, Any],
) -> None:
    """After the module's traffic, the LLMService dashboard's panels draw the vLLM LLMService
    from vLLM's own series, recorded under Conveyor's names by the chart's rules."""
    api = vllm_service["prometheus"]
    wait_for(
        "vLLM's series recorded under Conveyor's names",
        lambda: api.query(f'conveyor_num_requests_running{{llmservice="{NAME}"}}'),
        timeout_s=60,
    )
    # Requests trickle through the gateway from here until the check is done, so that every
    # scrape of the gateway sees its counter grow. A rate is only drawn at a step whose window
    # ($__rate_interval) holds two scrapes with an increase between them: requests sent only
    # before the check left zeros at every step of the range when a loaded machine spread the
    # scrapes out, although an instant query at another moment saw the rate.
    base = f"http://{vllm_service['status']['endpoint']['clusterIP']}:8080/v1"
    body = {"model": NAME, "prompt": "Hi", "max_tokens": 2}
    stop, failures, refused = threading.Event(), [], []

    def trickle() -> None:
        with httpx.Client(trust_env=False, timeout=60) as client:
            while not stop.wait(0.2):
                try:
                    code = client.post(f"{base}/completions", json=body).status_code
                except httpx.ConnectError as exc:
                    # A Service refuses connections while it has no ready endpoint: twice in
                    # one CI run on a loaded machine, the gateway's process running throughout.
                    # Nothing reached the gateway, so no answer of its was wrong; this test is
                    # about the dashboards (a gateway that never answers still fails the rate
                    # check below), and the rollout and chaos tests hold the gateway to zero
                    # failed requests.
                    refused.append(str(exc))
                    continue
                except httpx.HTTPError as exc:
                    failures.append(f"{type(exc).__name__}: {exc}")
                    continue
                if code != 200:
                    failures.append(f"HTTP {code}")

    sender = threading.Thread(target=trickle, daemon=True)
    sender.start()
    try:
        window_ms = round(
            grafana.rate_interval_s(vllm_service["start"], time.time(), SCRAPE_S) * 1000
        )
        rate = f'rate({n.GW_REQUESTS}{{model="{NAME}", code="200"}}[{window_ms}ms])'
        wait_for(
            "the gateway's request rate in Prometheus",
            lambda: api.query(f"{rate} > 0"),
            timeout_s=60,
        )
        for recorded in (n.PREEMPTIONS, n.PREFIX_HITS):  # allowed to stay 0, but recorded
            assert api.query(f'{recorded}{{llmservice="{NAME}"}}'), recorded
        moment = time.time()
        wait_for(
            "every target scraped after the traffic",
            lambda: panel_check.scraped_after(api, vllm_service["namespace"], moment, at_least=2),
            timeout_s=60,
        )
        # The panels are read over the module's range, ending now, until every one draws (60 s
        # at most): a rate shows only at a step of the range's grid whose window holds two
        # scrapes of the trickle, and under load the scrapes come every 2 s or more (1 s asked),
        # so the first grid after the traffic began can still miss it.
        checks: list[panel_check.DashboardCheck] = []

        def every_panel_draws() -> bool:
            checks.append(
                panel_check.check_dashboard(
                    "llmservice-overview.json",
                    api,
                    vllm_service["start"],
                    time.time(),
                    scrape_interval_s=SCRAPE_S,
                    allowed=ALLOWED_EMPTY,
                )
            )
            return not checks[-1].failures

        with contextlib.suppress(TimeoutError):  # the last check's failures are asserted below
            wait_for(
                "every panel to draw the vLLM service", every_panel_draws, timeout_s=60,
                interval_s=1,
            )  # fmt: skip
        assert checks, "Prometheus never answered the dashboard's queries"
        result = checks[-1]
    finally:
        stop.set()
        sender.join(timeout=60)
    assert not failures, f"requests through the gateway answered {failures}"
    print(
        f"\n[e2e] {result.figures()}, {len(checks)} reading(s), {len(refused)} connection(s) "
        "refused by the Service",
        file=sys.stderr,
    )
    if result.failures:  # how often each target was really scraped: gaps explain empty rates
        gaps = api.query(
            f'max_over_time(scrape_duration_seconds{{namespace="{vllm_service["namespace"]}"}}[5m])'
        )
        result.failures.append(f"slowest scrape per target over 5 min: {gaps}")
    assert not result.failures, "\n".join(result.failures)


# ---- the autoscaler and rollouts on vLLM (after the dashboard check: they change the spec) ----


@pytest.fixture(scope="module")
def client(vllm_service: dict[str, Any]) -> Iterator[Any]:
    """An OpenAI client of the service's gateway (closed after the module)."""
    import openai

    with openai.OpenAI(
        base_url=f"http://{vllm_service['status']['endpoint']['clusterIP']}:8080/v1",
        api_key="none", max_retries=0, timeout=READY_S,
    ) as client:  # fmt: skip
        yield client


def test_vllms_queue_scales_the_service_to_two_replicas_the_gateway_spreads_over_and_back(
    vllm_service: dict[str, Any], kube: KubeUnderTest, client: Any
) -> None:
    """The autoscaler reads vLLM's waiting gauge (through the engine adapter): one replica
    queued past the target gets a second; least-load sends requests to both; when the load
    stops, the service goes back to one replica. No request fails on the way."""
    namespace, op = vllm_service["namespace"], vllm_service["operator"]
    patch_spec(kube, namespace, {"autoscaling": AUTOSCALING})
    gateway = gateway_url(kube, namespace)
    seen: dict[str, Any] = {"max_queue": 0.0}

    def both_replicas_serve() -> dict[str, float] | None:
        signals = autoscaler_signals(kube, namespace)
        seen["max_queue"] = max(seen["max_queue"], signals.get("queueDepthPerReplica", 0.0))
        if signals.get("readyReplicas", 0) < 2:
            return None
        counts = requests_per_replica(gateway)
        if "at_two" not in seen:
            seen["at_two"] = counts
            return None
        grown = {b: v - seen["at_two"].get(b, 0.0) for b, v in counts.items()}
        return grown if sum(1 for v in grown.values() if v >= 3) >= 2 else None

    load = Load(client, NAME)
    grown = run_load(
        load, both_replicas_serve, "two vLLM replicas, each answering through the gateway",
        clients=CLIENTS, deadline_s=READY_S,
    )  # fmt: skip
    assert load.failures == [], load.failures[:5]
    assert seen["max_queue"] > AUTOSCALING["targetQueueDepthPerReplica"], seen
    assert ("ScaledUp" in [r for r, _ in scale_events(kube, namespace, NAME)]) and decisions(
        op, NAME, "up"
    ) >= 1
    print(f"\n[e2e] vLLM scale-up: max queue/replica {seen['max_queue']:.1f}, "
          f"requests per replica after both served {grown}", file=sys.stderr)  # fmt: skip

    wait_for(
        "the vLLM service back to one replica after the load",
        lambda: replicas(kube, namespace) == (1, 1),
        timeout_s=READY_S,
        interval_s=0.5,
    )
    assert "ScaledDown" in [r for r, _ in scale_events(kube, namespace, NAME)]
    assert client.completions.create(model=NAME, prompt="after", max_tokens=4).choices


def test_an_idle_vllm_service_scales_to_zero_and_a_held_request_wakes_it(
    vllm_service: dict[str, Any], kube: KubeUnderTest, client: Any
) -> None:
    namespace = vllm_service["namespace"]
    patch_spec(kube, namespace, {"autoscaling": {
        **AUTOSCALING, "minReplicas": 0, "scaleToZeroIdleSeconds": 5,
        "scaleDownStabilizationSeconds": 5,
    }})  # fmt: skip
    wait_for(
        "the idle vLLM service at zero replicas",
        lambda: (
            replicas(kube, namespace) == (0, 0)
            and llmservice_status(kube.api, namespace, NAME).get("phase") == "ScaledToZero"
        ),
        timeout_s=READY_S,
        interval_s=0.5,
    )
    assert not runtime_pods(kube, namespace) or wait_for(
        "the vLLM pod gone", lambda: not runtime_pods(kube, namespace), timeout_s=120
    )
    started = time.monotonic()
    try:
        # Not a 4-token prompt: vLLM for CPU 0.32.0 started with --enforce-eager (no warm-up)
        # loses its worker process when its very first forward is one ("wake"; reproduced
        # with `vllm serve` outside the cluster); a 9-token first prompt, then "wake", works.
        answer = client.completions.create(
            model=NAME, prompt="wake up, the first request", max_tokens=4
        )
    except Exception as exc:  # say what the woken replica logged
        raise AssertionError(f"{exc}\n{runtime_logs(kube, namespace)}") from exc
    woke_s = time.monotonic() - started
    assert answer.choices and answer.usage and answer.usage.completion_tokens == 4
    assert any(
        reason == "ScaledUp" and "from 0 to 1 replicas: pending-requests" in message
        for reason, message in scale_events(kube, namespace, NAME)
    ), scale_events(kube, namespace, NAME)
    print(f"\n[e2e] vLLM wake from zero to the held request's answer: {woke_s:.0f} s",
          file=sys.stderr)  # fmt: skip


def test_a_model_change_rolls_out_to_smollm2_on_vllm_without_a_failed_request(
    vllm_service: dict[str, Any], kube: KubeUnderTest, client: Any
) -> None:
    """The built-in SmolLM2 (a GGUF, which vLLM cannot read) is written into the cache volume
    as a Hugging Face directory by the model container; the new vLLM pod is Ready before the
    old one goes, so requests sent all along are answered; then SmolLM2 answers a question."""
    namespace = vllm_service["namespace"]
    patch_spec(kube, namespace, {"replicas": 1, "autoscaling": {"enabled": False}})
    wait_for(
        "one vLLM replica Ready",
        lambda: (
            replicas(kube, namespace) == (1, 1)
            and ready_status(kube, namespace, vllm_service["operator"])
        ),
        timeout_s=READY_S,
    )
    (old,) = runtime_pods(kube, namespace)
    load = Load(client, NAME, max_tokens=8)
    # float32: vLLM for CPU's bfloat16 path (its default for this float32 checkpoint) answers
    # the question below with something else ("L'Étoile, la Marseillaise, ..."), while
    # transformers in bfloat16 and vLLM in float32 both answer Paris (checked outside the cluster)
    patch_spec(kube, namespace, {"model": {"builtin": SMOLLM2}, "runtime": {"dtype": "float32"}})
    min_ready = [1]

    def rolled_out() -> bool:
        pods = runtime_pods(kube, namespace)
        _, ready = replicas(kube, namespace)
        min_ready[0] = min(min_ready[0], ready)
        return (
            [p["metadata"]["name"] for p in pods] != [old["metadata"]["name"]]
            and len(pods) == 1
            and pods[0]["metadata"].get("deletionTimestamp") is None
            and bool(ready_status(kube, namespace, vllm_service["operator"]))
            and ready == 1
        )

    run_load(load, rolled_out, "the model change rolled out", clients=2, deadline_s=READY_S)
    assert load.failures == [] and load.answered > 0, load.failures[:5]
    assert min_ready[0] >= 1  # the new replica was Ready before the old one went
    (pod,) = runtime_pods(kube, namespace)
    models = NO_PROXY.get(f"http://{pod['status']['podIP']}:8000/v1/models").json()
    assert [(m["id"], m["owned_by"]) for m in models["data"]] == [(NAME, "vllm")]
    chat = client.chat.completions.create(
        model=NAME, max_tokens=16, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )  # fmt: skip
    assert "Paris" in (chat.choices[0].message.content or ""), chat
