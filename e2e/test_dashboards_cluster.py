"""Every dashboard panel checked the way Grafana would use it, after a real run on the cluster.

The operator runs as a pod under its own RBAC and makes the namespace's gateway and the
runtime pods of two LLMServices; a real Prometheus on the host discovers what to scrape the
way it does on a real cluster (``kubernetes_sd_configs`` against the apiserver through a
kubeconfig, pods picked and labelled by their scrape annotations), operator included. The
run goes through the gateway's ClusterIP with the OpenAI client and injects what the quiet
panels show:

- requests for a model whose replica is still starting, held by the gateway (pending);
- streams cut by the client (aborts at the replica, 499 at the gateway);
- long concurrent generations on a replica with a tiny KV cache (preemptions);
- a burst over that replica's queue bound (429);
- load on an autoscaled LLMService until the operator scales it up (decisions, signals);
- one of its replicas killed under load (retries before the first byte, an ejection).

Then every panel query of charts/conveyor/dashboards/*.json, its variables resolved from
``label_values`` and ``$__rate_interval`` substituted as Grafana does, is evaluated over the
run's range by that Prometheus and must return series with the labels its legend uses
(``conveyor.observability.panel_check``, shared with the loopback tier), and each dashboard
is rendered into build/dashboards-cluster/. Every wait has a deadline; nothing asserts a time.
"""

from __future__ import annotations

import asyncio
import collections
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from chaos_helpers import kill_container
from operator_helpers import (
    REPO,
    apply_yaml,
    install_crd,
    llmservice,
    llmservice_status,
    pods_run,
    release_llmservices,
    wait_for,
)

from conveyor.cluster.testing import KubeUnderTest
from conveyor.cluster.tools import build_tools
from conveyor.observability import names, panel_check
from conveyor.observability.chart import CHART
from conveyor.observability.panel_check import AllowedEmpty
from conveyor.observability.prometheus import Prometheus, PrometheusAPI, PrometheusSettings
from conveyor.observability.render import render_dashboard
from conveyor.operator.install import operator_deployment, operator_rbac

SCRAPE_S = 1.0
"""Scrape and rule interval: short, so that a few seconds of an event are seen."""
RENDER_DIR = REPO / "build" / "dashboards-cluster"
"""Where the test leaves its renders (build/ is ignored by git), to be looked at."""
DEADLINE_S = 300
"""Longest wait for one pod to start and be ready on the loaded two-core machine."""

SCALED = "tiny"
"""The autoscaled LLMService: one replica at first, two after the load."""
TINY_KV = "tiny-kv"
"""The LLMService with a KV cache of 256 tokens and a queue bound of 2 (preemptions, 429s)."""
REPLICA = {"gpus": 1, "cpu": "250m", "memory": "1Gi"}
"""A quarter of a core per replica: one replica saturates under the load (as test_autoscaling)."""
CONCURRENCY = 16
"""Clients sending back to back to the autoscaled service: several times what one replica runs."""
OPERATOR_ARGS = (
    "--lease-duration", "6", "--lease-renew-interval", "2", "--lease-retry-interval", "1",
    "--autoscale-interval", "1", "--gateway-cpu", "200m", "--gateway-memory", "512Mi",
)  # fmt: skip
"""Decide every second; a gateway small enough to share the CPU node with the operator."""

ALLOWED_EMPTY: tuple[AllowedEmpty, ...] = ()
"""Panel queries this run may leave empty: none, every panel shows what it is for here."""


def dashboard_names() -> list[str]:
    return sorted(p.name for p in (CHART / "dashboards").glob("*.json"))


def scaled_service() -> dict[str, Any]:
    return llmservice(
        SCALED,
        resources=REPLICA,
        runtime={"maxRunningRequests": 2},
        autoscaling={
            "enabled": True,
            "minReplicas": 1,
            "maxReplicas": 2,
            "targetQueueDepthPerReplica": 2,
            # every signal has a target, so each autoscaler panel draws one
            "targetTTFTP95Seconds": 60,
            "targetKVCacheUsage": 0.9,
            "scaleDownStabilizationSeconds": 900,  # no scale-down within the run
        },
    )


def tiny_kv_service() -> dict[str, Any]:
    return llmservice(
        TINY_KV,
        resources=REPLICA,
        runtime={
            "maxTotalTokens": 256,
            "maxModelLen": 256,
            "maxRunningRequests": 8,
            "maxQueuedRequests": 2,
        },
    )


@dataclass(frozen=True)
class Gateway:
    """The namespace's gateway, reached at its ClusterIP from the host."""

    url: str

    def pools(self) -> dict[str, Any]:
        try:
            return httpx.get(self.url + "/debug/pools", timeout=5).json()
        except httpx.HTTPError:
            return {}

    def admitted(self, model: str) -> list[dict[str, Any]]:
        """The replicas of ``model`` the gateway sends requests to now."""
        return [r for r in self.pools().get(model, {}).get("replicas", []) if r["admitted"]]


@dataclass
class Tally:
    """What the clients got: answers and errors by status (printed, never asserted)."""

    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)

    def __str__(self) -> str:
        return ", ".join(f"{k}: {v}" for k, v in sorted(self.outcomes.items()))


@dataclass
class Run:
    kube: KubeUnderTest
    namespace: str
    api: PrometheusAPI
    gateway: Gateway
    tally: Tally = field(default_factory=Tally)


def seen(api: PrometheusAPI, expr: str) -> bool:
    """Whether an instant query returns anything now."""
    return bool(api.query(expr))


async def wait(what: str, check: Callable[[], Any], timeout_s: float) -> Any:
    """``wait_for`` off the event loop, so the clients keep sending meanwhile."""
    return await asyncio.to_thread(wait_for, what, check, timeout_s=timeout_s, interval_s=0.5)


async def one(
    client: openai.AsyncOpenAI,
    tally: Tally,
    model: str,
    prompt: str,
    *,
    stream: bool,
    max_tokens: int = 24,
    extra_body: dict[str, Any] | None = None,
) -> None:
    """One request; its outcome tallied (errors are what some phases are for)."""
    try:
        if stream:
            chunks = await client.chat.completions.create(
                model=model, stream=True, max_tokens=max_tokens,
                messages=[{"role": "user", "content": prompt}],
            )  # fmt: skip
            async for _ in chunks:
                pass
        else:
            await client.completions.create(
                model=model, prompt=prompt, max_tokens=max_tokens, extra_body=extra_body
            )
    except openai.APIStatusError as exc:
        tally.outcomes[str(exc.status_code)] += 1
    except openai.APIError as exc:
        tally.outcomes[type(exc).__name__] += 1
    else:
        tally.outcomes["answered"] += 1


async def cut(client: openai.AsyncOpenAI, tally: Tally, i: int) -> None:
    """A stream the client leaves after two chunks: an abort at the replica, 499 at the gateway."""
    stream = await client.completions.create(
        model=SCALED, prompt=f"a long story {i}", stream=True, max_tokens=100
    )
    received = 0
    async for _ in stream:
        received += 1
        if received == 2:
            break
    await stream.close()
    tally.outcomes["cut"] += 1


def pod_of(run: Run, url: str) -> dict[str, Any]:
    ip = httpx.URL(url).host
    pods = run.kube.api.get(
        f"/api/v1/namespaces/{run.namespace}/pods",
        labelSelector=f"conveyor.dev/llmservice={SCALED}",
    )["items"]
    return next(p for p in pods if p.get("status", {}).get("podIP") == ip)


async def drive(run: Run) -> None:
    """The run: every event a quiet panel shows, through the gateway."""
    kube, ns, api, gw, tally = run.kube, run.namespace, run.api, run.gateway, run.tally
    shared = "You are a helpful assistant of the conveyor belt factory. " * 3
    async with openai.AsyncOpenAI(
        base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=DEADLINE_S
    ) as client:
        # Requests for a model whose only replica is starting are held by the gateway.
        await asyncio.to_thread(apply_yaml, kube, ns, tiny_kv_service())
        await wait("the gateway to know the tiny-KV model", lambda: TINY_KV in gw.pools(), 60)
        held = asyncio.gather(
            *(
                one(client, tally, TINY_KV, f"held {i}", stream=False, max_tokens=8)
                for i in range(3)
            )
        )
        pending = f'{names.GW_PENDING}{{namespace="{ns}", model="{TINY_KV}"}} > 0'
        await wait("Prometheus to scrape the held requests", lambda: seen(api, pending), 60)

        # Steady traffic with shared prefixes (prefix-cache hits), streamed and not; cut streams.
        for start in range(0, 24, 8):
            await asyncio.gather(
                *(
                    one(client, tally, SCALED, f"{shared} question {i}", stream=i % 2 == 0)
                    for i in range(start, start + 8)
                )
            )
        await asyncio.gather(*(cut(client, tally, i) for i in range(4)))

        await held
        await wait("the tiny-KV replica admitted", lambda: gw.admitted(TINY_KV), DEADLINE_S)
        # Long concurrent generations on 256 tokens of KV cache: preemptions. Each writes all
        # of its 120 tokens (no early end of text), so that however the gateway spaces them
        # they overlap, and any two overflow the cache: 6 x 60 tokens, which could end early,
        # once left a run on real nodes without a preemption.
        await asyncio.gather(
            *(
                one(
                    client,
                    tally,
                    TINY_KV,
                    f"long {i} " * 4,
                    stream=False,
                    max_tokens=120,
                    extra_body={"ignore_eos": True},
                )
                for i in range(8)
            )
        )
        # A burst over the tiny-KV replica's queue bound (2 waiting): 429s.
        await asyncio.gather(
            *(
                one(client, tally, TINY_KV, f"burst {i}", stream=False, max_tokens=16)
                for i in range(32)
            )
        )

        # Load on the autoscaled service until a second replica serves, then one killed.
        stop = asyncio.Event()

        async def worker(i: int) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                before = tally.outcomes["answered"]
                await one(client, tally, SCALED, f"{shared} load {i} {n}", stream=i % 2 == 0)
                if tally.outcomes["answered"] == before:
                    await asyncio.sleep(0.2)  # a client backs off after an error

        workers = [asyncio.create_task(worker(i)) for i in range(CONCURRENCY)]
        try:

            def serving() -> list[dict[str, Any]]:
                """Two replicas admitted (the scale-up done), the busiest one's requests."""
                replicas = gw.admitted(SCALED)
                busy = [r for r in replicas if r["in_flight"] > 0]
                return busy if len(replicas) >= 2 else []

            busy = await wait(
                "the autoscaler to add a replica and the gateway to send it requests",
                serving,
                DEADLINE_S,
            )
            victim = max(busy, key=lambda r: r["in_flight"])
            pod = await asyncio.to_thread(pod_of, run, victim["url"])
            name = pod["metadata"]["name"]
            if kube.cluster is not None:
                # A crash (SIGKILL through containerd): a forced deletion would have the
                # kubelet send SIGTERM first, a drain the gateway need not retry.
                await asyncio.to_thread(kill_container, kube.cluster, pod, "runtime")
            else:
                # Another cluster's containers are out of reach from here: a forced deletion.
                await asyncio.to_thread(
                    kube.kubectl, "-n", ns, "delete", "pod", name, "--grace-period=0", "--force"
                )
            print(f"\n[run] killed {name} ({victim['url']}) under load", file=sys.stderr)
            retried = (
                f'sum({names.GW_RETRIES}{{namespace="{ns}"}}) > 0 '
                f'and on() sum({names.GW_EJECTIONS}{{namespace="{ns}"}}) > 0'
            )
            await wait("retries and an ejection scraped", lambda: seen(api, retried), 60)
        finally:
            stop.set()
            await asyncio.gather(*workers)


def check_events(api: PrometheusAPI, namespace: str, start: float, end: float) -> list[str]:
    """What the run was to inject, as Prometheus saw it."""
    missing = []
    codes = {
        s["metric"].get("code")
        for s in api.query_range(
            f'sum by (code) ({names.GW_REQUESTS}{{namespace="{namespace}"}})', start, end, SCRAPE_S
        )
    }
    if not {"200", "429", "499"} <= codes:
        missing.append(f"gateway status codes {sorted(codes)}: want 200, 429 and 499")
    for metric in (names.PREEMPTIONS, names.GW_RETRIES, names.GW_EJECTIONS):
        if not api.query(f'sum({metric}{{namespace="{namespace}"}}) > 0', end):
            missing.append(f"no {metric}")
    up = f'{names.AS_DECISIONS}{{namespace="{namespace}", llmservice="{SCALED}", direction="up"}}'
    if not api.query(f"sum({up}) > 0", end):
        missing.append("no scale-up decision")
    return missing


def test_every_dashboard_panel_after_a_run_on_the_cluster(
    kube: KubeUnderTest, namespace: str, tmp_path: Path
) -> None:
    if reason := pods_run(kube, namespace):
        pytest.skip(reason)
    install_crd(kube)
    binary = build_tools(("prometheus",), quiet=True).path("prometheus")
    settings = PrometheusSettings(
        binary=binary,
        scrape_interval_s=SCRAPE_S,
        evaluation_interval_s=SCRAPE_S,
        kubeconfig=kube.kubeconfig,
        namespaces=(namespace,),
        work_dir=tmp_path / "prometheus",
    )
    name = f"conveyor-operator-{namespace}"[:63]
    rbac = operator_rbac(namespace, name=name)
    args = ("--namespace", namespace, "--lease-namespace", namespace, *OPERATOR_ARGS)
    try:
        with Prometheus(settings) as prom:
            api = prom.api()
            start = time.time()
            apply_yaml(
                kube,
                namespace,
                *rbac,
                operator_deployment(namespace, replicas=1, args=args, name=name),
            )
            lease = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}"
            wait_for(
                "the operator pod to lead",
                lambda: kube.api.get(lease)["spec"].get("holderIdentity"),
                timeout_s=DEADLINE_S,
            )
            apply_yaml(kube, namespace, scaled_service())
            status = wait_for(
                f"LLMService {SCALED} Ready with an endpoint",
                lambda: (
                    (s := llmservice_status(kube.api, namespace, SCALED)).get("phase") == "Ready"
                    and s.get("endpoint", {}).get("clusterIP")
                    and s
                ),
                timeout_s=DEADLINE_S,
            )
            gateway = Gateway(f"http://{status['endpoint']['clusterIP']}:8080")
            wait_for(
                "the gateway to admit a replica", lambda: gateway.admitted(SCALED), timeout_s=60
            )
            run = Run(kube, namespace, api, gateway)
            asyncio.run(drive(run))
            end_of_load = time.time()
            # the operator, the gateway and a replica of each LLMService scraped after the load
            wait_for(
                "a scrape of every target after the load",
                lambda: panel_check.scraped_after(
                    api, namespace, end_of_load + SCRAPE_S, at_least=4
                ),
                timeout_s=60,
            )
            end = time.time()
            print(
                f"\n[figures] run of {end - start:.0f} s; clients got {run.tally}; "
                f"{len(api.targets())} targets discovered",
                file=sys.stderr,
            )
            failures = check_events(api, namespace, start, end)
            RENDER_DIR.mkdir(parents=True, exist_ok=True)
            for dashboard in dashboard_names():
                check = panel_check.check_dashboard(
                    dashboard, api, start, end, scrape_interval_s=SCRAPE_S, allowed=ALLOWED_EMPTY
                )
                print(f"[figures] {check.figures()}", file=sys.stderr)
                failures += check.failures
                out = RENDER_DIR / dashboard.replace(".json", ".png")
                out.unlink(missing_ok=True)
                rendered = render_dashboard(
                    panel_check.committed(dashboard),
                    api,
                    start,
                    end,
                    out,
                    scrape_interval_s=SCRAPE_S,
                )
                assert out.is_file() and out.stat().st_size > 10_000, f"no render of {dashboard}"
                print(f"[render] {out}", file=sys.stderr)
                if empty := panel_check.unexplained_empty(rendered, ALLOWED_EMPTY):
                    failures.append(f"{dashboard}: the render shows no data in {sorted(empty)}")
            assert not failures, "\n".join(failures)
    finally:
        release_llmservices(kube, namespace)
        for obj in rbac:
            if obj["kind"].startswith("Cluster"):
                kube.kubectl(
                    "delete", obj["kind"].lower(), obj["metadata"]["name"], "--ignore-not-found",
                    check=False,
                )  # fmt: skip
