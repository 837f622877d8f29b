"""``conveyor bench autoscale``: a step load against the autoscaler on the one-machine cluster.

Prints figures, asserts nothing. Needs the running cluster (``conveyor cluster up``) with the
node agent, so that pods really run with their ``limits.cpu``. In a fresh namespace it runs
the operator as a local process (admin kubeconfig, deciding every ``--interval`` seconds),
applies one LLMService on the built-in model (replicas limited to ``--replica-cpu``), then:

1. capacity: closed-loop clients against the single replica -> one replica's requests/s;
2. step: open-loop arrivals at ``--step-factor`` x that rate; the time from the step to the
   first scale-up decision (spec.replicas > 1), to a new replica serving (a response from a
   second backend), and until the client-side TTFT p95 is back under target;
3. constant load for ``--minutes``: direction changes of spec.replicas (target: none);
4. wake from zero: minReplicas 0, wait until scaled to zero, then one streamed request:
   arrival to first token;
5. replicas, queue depth per replica and TTFT p95 over time as a PNG (``--png``).

Progress goes to stderr as it runs (each phase, and every ``--progress-every`` seconds of load:
replicas, queue, client-side TTFT p95, the autoscaler's demand and capacity estimates); the
figures go to stdout as JSON at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import itertools
import json
import random
import socket
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

MODEL = "bench"
NAME = "bench"


@dataclass(frozen=True)
class BenchSettings:
    kubeconfig: Path | None = None
    """Cluster to use; unset: the one-machine cluster running here."""
    minutes: float = 10.0
    """Constant load after the step, over which direction changes are counted (target: none)."""
    step_factor: float = 2.0
    """Step load as a multiple of one replica's measured capacity."""
    replica_cpu: str = "250m"
    """limits.cpu of each replica: a fraction of a core, so a replica is a unit of capacity."""
    max_replicas: int = 4
    """maxReplicas of the benchmark's LLMService: room above the 2-3 a step needs, to see an
    overshoot."""
    target_queue: float = 2.0
    """targetQueueDepthPerReplica of the benchmark's LLMService."""
    target_ttft_s: float = 2.0
    """targetTTFTP95Seconds of the benchmark's LLMService."""
    interval_s: float = 1.0
    """The operator's --autoscale-interval."""
    scale_down_window_s: int = 300
    """scaleDownStabilizationSeconds of the benchmark's LLMService (the CRD's default)."""
    max_tokens: int = 24
    """max_tokens of each request: short, so one replica's capacity is many requests/s."""
    png: Path = Path("autoscale.png")
    """Where the chart of replicas, queue and TTFT p95 over time is written."""
    keep: bool = False
    """Keep the namespace afterwards (for a look with kubectl)."""
    progress_every_s: float = 10.0
    """Seconds between progress lines while load runs."""


def parser() -> argparse.ArgumentParser:
    """The command line; every option says what it sets and its default."""
    d = BenchSettings()
    p = argparse.ArgumentParser(
        prog="conveyor bench autoscale",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--kubeconfig",
        type=Path,
        default=None,
        help="cluster to use; unset: the one-machine cluster running here (`conveyor cluster up`)",
    )
    p.add_argument(
        "--minutes",
        type=float,
        default=d.minutes,
        help="minutes of load after the step; direction changes are counted over it",
    )
    p.add_argument(
        "--step-factor",
        type=float,
        default=d.step_factor,
        help="step load as a multiple of one replica's measured requests/s",
    )
    p.add_argument(
        "--replica-cpu",
        default=d.replica_cpu,
        help="limits.cpu of each replica, so that a replica is a unit of capacity",
    )
    p.add_argument(
        "--max-replicas",
        type=int,
        default=d.max_replicas,
        help="maxReplicas of the benchmark's LLMService",
    )
    p.add_argument(
        "--target-queue",
        type=float,
        default=d.target_queue,
        help="targetQueueDepthPerReplica of the benchmark's LLMService",
    )
    p.add_argument(
        "--target-ttft",
        type=float,
        default=d.target_ttft_s,
        help="targetTTFTP95Seconds of the benchmark's LLMService (seconds)",
    )
    p.add_argument(
        "--interval",
        type=float,
        default=d.interval_s,
        help="the operator's --autoscale-interval (seconds)",
    )
    p.add_argument(
        "--scale-down-window",
        type=int,
        default=d.scale_down_window_s,
        help="scaleDownStabilizationSeconds of the benchmark's LLMService",
    )
    p.add_argument(
        "--max-tokens", type=int, default=d.max_tokens, help="max_tokens of each request"
    )
    p.add_argument(
        "--png",
        type=Path,
        default=d.png,
        help="where to write the chart of replicas, queue and TTFT p95 over time",
    )
    p.add_argument(
        "--keep", action="store_true", help="keep the namespace afterwards, for a look with kubectl"
    )
    p.add_argument(
        "--progress-every",
        type=float,
        default=d.progress_every_s,
        help="seconds between progress lines on stderr while load runs",
    )
    return p


def parse(argv: list[str]) -> BenchSettings:
    a = parser().parse_args(argv)
    return BenchSettings(
        kubeconfig=a.kubeconfig, minutes=a.minutes, step_factor=a.step_factor,
        replica_cpu=a.replica_cpu, max_replicas=a.max_replicas, target_queue=a.target_queue,
        target_ttft_s=a.target_ttft, interval_s=a.interval, max_tokens=a.max_tokens,
        scale_down_window_s=a.scale_down_window, png=a.png, keep=a.keep,
        progress_every_s=a.progress_every,
    )  # fmt: skip


# ---- the cluster ---------------------------------------------------------------------------


class Env:
    """kubectl and the API of the cluster, one namespace, the operator process."""

    def __init__(self, kubeconfig: Path, kubectl: str) -> None:
        from conveyor.cluster.api import ApiClient

        self.kubeconfig, self.kubectl_path = kubeconfig, kubectl
        self.api = ApiClient.from_kubeconfig(kubeconfig)
        self.namespace = f"bench-autoscale-{uuid.uuid4().hex[:6]}"
        self.operator: subprocess.Popen[bytes] | None = None
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
        """None when a pod really runs here, else why not."""
        pods = f"/api/v1/namespaces/{self.namespace}/pods"
        self.api.create(pods, {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe"},
            "spec": {"containers": [{"name": "c", "image": "conveyor", "command": ["sleep", "60"]}],
                     "terminationGracePeriodSeconds": 1},
        })  # fmt: skip
        try:
            deadline = time.monotonic() + 45
            while time.monotonic() < deadline:
                if self.api.get(f"{pods}/probe").get("status", {}).get("phase") == "Running":
                    return None
                time.sleep(0.5)
            return "pods are scheduled but nothing runs them (no node agent on this cluster)"
        finally:
            self.api.request("DELETE", f"{pods}/probe")

    def start(self, s: BenchSettings) -> None:
        from conveyor.operator.crd import CRD_FILE

        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        argv = [
            sys.executable, "-m", "conveyor", "operator", "--kubeconfig", str(self.kubeconfig),
            "--namespace", self.namespace, "--no-leader-election", "--host", "127.0.0.1",
            "--port", str(port), "--autoscale-interval", str(s.interval_s),
            "--gateway-cpu", "300m", "--resync-interval", "10",
        ]  # fmt: skip
        self.operator = subprocess.Popen(argv, stdout=self.log.open("wb"), stderr=subprocess.STDOUT)

    def stop(self, keep: bool) -> None:
        if self.operator is not None and not keep:
            self.kubectl("-n", self.namespace, "delete", "llmservices", "--all", "--wait=true")
        if self.operator is not None:
            self.operator.terminate()
            self.operator.wait(timeout=30)
        if not keep:
            self.kubectl("delete", "namespace", self.namespace, "--wait=false")

    def apply(
        self, s: BenchSettings, min_replicas: int, idle_s: int = 600, autoscale: bool = True
    ) -> None:
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
                    "maxReplicas": s.max_replicas, "targetQueueDepthPerReplica": s.target_queue,
                    "targetTTFTP95Seconds": s.target_ttft_s,
                    "scaleDownStabilizationSeconds": s.scale_down_window_s,
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
                        f"{last.get('exitCode')}); the node agent's logs say why"
                    )
        return None

    def wait(self, what: str, check: Any, timeout_s: float = 600) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            if why := self.crash_looping():
                raise RuntimeError(f"while waiting for {what}: {why}")
            time.sleep(0.5)
        raise TimeoutError(f"timed out waiting for {what}; operator log: {self.log}")


# ---- progress ----------------------------------------------------------------------------


@dataclass
class Progress:
    """Lines on stderr with the seconds since the benchmark started, as it goes."""

    started: float = field(default_factory=time.monotonic)

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:6.0f}s] {message}", file=sys.stderr, flush=True)


def describe_status(obj: dict[str, Any]) -> str:
    """The LLMService's replicas and the autoscaler's last estimates, in one line."""
    status = obj.get("status") or {}
    auto = status.get("autoscaler") or {}
    sig = auto.get("signals") or {}
    parts = [
        f"replicas {obj['spec'].get('replicas', 0)} desired / {status.get('readyReplicas', 0)} "
        f"ready",
        f"queue/replica {sig.get('queueDepthPerReplica', 0.0):.1f}",
    ]
    if "demandRequestsPerSecond" in sig:
        cap = auto.get("capacity") or {}
        parts.append(
            f"demand {sig['demandRequestsPerSecond']:.2f} req/s, capacity "
            f"{cap.get('requestsPerSecond', 0.0):.2f} req/s/replica ({cap.get('source', '?')}), "
            f"utilization {sig.get('utilization', 0.0):.2f}"
            + (", panic" if sig.get("panic") else "")
        )
    if auto.get("reason"):
        parts.append(f"last decision {auto.get('direction')} ({auto['reason']})")
    return ", ".join(parts)


# ---- load ------------------------------------------------------------------------------


@dataclass
class Sample:
    t: float
    replicas: int
    ready: int
    queue: float
    ttft_p95: float | None


@dataclass
class Recorder:
    """Requests' client-side TTFT and backends, and the LLMService over time."""

    started: float = field(default_factory=time.monotonic)
    done: list[tuple[float, float, str]] = field(default_factory=list)
    """(finish time, TTFT seconds, backend)."""
    failures: int = 0
    samples: list[Sample] = field(default_factory=list)

    def p95(self, since: float, until: float) -> float | None:
        """Client-side TTFT p95 of the requests finished in [since, until)."""
        ends = [at for at, _, _ in self.done]  # appended as they finish: sorted
        lo, hi = bisect.bisect_left(ends, since), bisect.bisect_left(ends, until)
        ttfts = [t for _, t, _ in self.done[lo:hi]]
        return statistics.quantiles(ttfts, n=20)[-1] if len(ttfts) >= 5 else None


async def one_request(client: Any, rec: Recorder, max_tokens: int) -> None:
    sent = time.monotonic()
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": f"hi {random.random()}"}],
            max_tokens=max_tokens, stream=True,
        )  # fmt: skip
        backend = raw.headers.get("x-conveyor-backend", "")
        first = None
        async for chunk in raw.parse():
            if first is None and chunk.choices:
                first = time.monotonic() - sent
        rec.done.append((time.monotonic(), first if first is not None else 0.0, backend))
    except Exception as exc:  # counted and shown: a benchmark reports failures, it does not stop
        rec.failures += 1
        print(f"  request failed: {type(exc).__name__}: {exc}", file=sys.stderr)


async def closed_loop(client: Any, rec: Recorder, clients: int, seconds: float, s: BenchSettings):
    end = time.monotonic() + seconds

    async def worker() -> None:
        while time.monotonic() < end:
            await one_request(client, rec, s.max_tokens)

    await asyncio.gather(*(worker() for _ in range(clients)))


async def open_loop(client: Any, rec: Recorder, rate: float, stop: asyncio.Event, s) -> None:
    """Poisson arrivals at ``rate`` per second until ``stop``; waits for those in flight."""
    tasks: set[asyncio.Task[None]] = set()
    while not stop.is_set():
        task = asyncio.create_task(one_request(client, rec, s.max_tokens))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), random.expovariate(rate))
    await asyncio.gather(*tasks)


async def watch(
    env: Env, rec: Recorder, stop: asyncio.Event, progress: Progress, every_s: float
) -> None:
    """Sample the LLMService twice a second; a progress line every ``every_s`` seconds."""
    next_line = time.monotonic()
    while not stop.is_set():
        obj = await asyncio.to_thread(env.llmservice)
        now = time.monotonic()
        if now >= next_line:
            next_line = now + every_s
            p95 = rec.p95(now - 10, now)
            ttft = "-" if p95 is None else f"{p95:.2f}s"
            progress.say(
                f"{describe_status(obj)}; client TTFT p95 (10 s) {ttft}; "
                f"{len(rec.done)} done, {rec.failures} failed"
            )
        auto = (obj.get("status") or {}).get("autoscaler") or {}
        sig = auto.get("signals") or {}
        rec.samples.append(Sample(
            time.monotonic(), int(obj["spec"].get("replicas", 0)),
            int((obj.get("status") or {}).get("readyReplicas", 0)),
            float(sig.get("queueDepthPerReplica", 0.0)), sig.get("ttftP95Seconds"),
        ))  # fmt: skip
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


def direction_changes(replicas: list[int]) -> int:
    """How often spec.replicas turned from rising to falling or back."""
    changes, last = 0, 0
    for a, b in itertools.pairwise(replicas):
        if b == a:
            continue
        d = 1 if b > a else -1
        if last and d != last:
            changes += 1
        last = d
    return changes


def plot(rec: Recorder, step_at: float, path: Path, s: BenchSettings) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [x.t - step_at for x in rec.samples]
    fig, axes = plt.subplots(3, 1, sharex=True, figsize=(9, 7))
    axes[0].step(t, [x.replicas for x in rec.samples], where="post", label="desired")
    axes[0].step(t, [x.ready for x in rec.samples], where="post", label="ready")
    axes[0].set_ylabel("replicas")
    axes[0].legend()
    axes[1].plot(t, [x.queue for x in rec.samples])
    axes[1].axhline(s.target_queue, color="red", linestyle="--", label="target")
    axes[1].set_ylabel("queue / replica")
    axes[1].legend()
    ends = [at - step_at for at, _, _ in rec.done]
    p95 = [rec.p95(at - 10, at) for at, _, _ in rec.done]
    axes[2].plot(ends, [v if v is not None else float("nan") for v in p95], label="client, 10 s")
    axes[2].plot(t, [x.ttft_p95 if x.ttft_p95 is not None else float("nan") for x in rec.samples],
                 ".", label="autoscaler's")  # fmt: skip
    axes[2].axhline(s.target_ttft_s, color="red", linestyle="--", label="target")
    axes[2].set_ylabel("TTFT p95 (s)")
    axes[2].set_xlabel("seconds since the step")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


async def bench(env: Env, s: BenchSettings, progress: Progress) -> dict[str, Any]:
    import openai

    # Autoscaling off while one replica's capacity is measured; on from the step.
    env.apply(s, min_replicas=1, autoscale=False)
    progress.say("waiting for the LLMService to be Ready (one replica; pod start and model load)")
    status = env.wait(
        "the LLMService Ready",
        lambda: (
            (st := env.llmservice().get("status") or {}).get("phase") == "Ready"
            and st.get("endpoint", {}).get("clusterIP")
            and st
        ),
    )
    base = f"http://{status['endpoint']['clusterIP']}:8080/v1"
    client = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=600)
    out: dict[str, Any] = {}

    # 1. one replica's capacity
    progress.say("ready; measuring one replica's capacity (5 s warm-up, 20 s of 4 clients)")
    cap = Recorder()
    await closed_loop(client, cap, clients=2, seconds=5, s=s)  # warm up
    cap = Recorder()
    await closed_loop(client, cap, clients=4, seconds=20, s=s)
    backends = {b for _, _, b in cap.done}
    capacity = len(cap.done) / 20 / max(1, len(backends))
    out["one_replica_rps"] = round(capacity, 2)
    progress.say(f"one replica: {capacity:.2f} requests/s; turning the autoscaler on")
    env.apply(s, min_replicas=1)
    env.wait(
        "the autoscaler to take over",
        lambda: ((env.llmservice().get("status") or {}).get("autoscaler") or {}).get("reason"),
    )

    # 2. the step, 3. constant load
    rec = Recorder()
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch(env, rec, stop, progress, s.progress_every_s))
    progress.say(
        f"step to {s.step_factor:g}x: {s.step_factor * capacity:.2f} requests/s for "
        f"{s.minutes:g} minutes"
    )
    step_at = time.monotonic()
    load = asyncio.create_task(open_loop(client, rec, s.step_factor * capacity, stop, s))
    await asyncio.sleep(s.minutes * 60)
    stop.set()
    await asyncio.gather(load, watcher)
    first_backends = {b for _, _, b in rec.done[:1]}
    decision = next((x.t for x in rec.samples if x.replicas > 1), None)
    serving = next((at for at, _, b in rec.done if b and b not in first_backends), None)
    recovered = None
    if decision is not None:
        breached = False
        for at, _, _ in rec.done:
            p = rec.p95(at - 10, at)
            if p is not None and p > s.target_ttft_s:
                breached = True
            elif breached and p is not None and p <= s.target_ttft_s and at > decision:
                recovered = at
                break
    settle = step_at + min(s.minutes * 60 / 4, 120)
    steady = [x.replicas for x in rec.samples if x.t >= settle]
    out.update({
        "step_rps": round(s.step_factor * capacity, 2),
        "step_to_decision_s": None if decision is None else round(decision - step_at, 1),
        "step_to_new_replica_serving_s": None if serving is None else round(serving - step_at, 1),
        "step_to_ttft_p95_under_target_s": (
            None if recovered is None else round(recovered - step_at, 1)
        ),
        "max_replicas": max((x.replicas for x in rec.samples), default=0),
        "replicas_at_end": rec.samples[-1].replicas if rec.samples else 0,
        "direction_changes_under_constant_load": direction_changes(steady),
        "constant_load_minutes_counted": round((s.minutes * 60 - (settle - step_at)) / 60, 1),
        "requests": len(rec.done),
        "failed_requests": rec.failures,
    })  # fmt: skip
    final = ((env.llmservice().get("status") or {}).get("autoscaler") or {}).get("capacity")
    out["autoscaler_capacity_rps"] = None if not final else final.get("requestsPerSecond")
    plot(rec, step_at, s.png, s)
    out["png"] = str(s.png.resolve())
    progress.say(f"load done: {len(rec.done)} requests, {rec.failures} failed; chart {s.png}")

    # 4. wake from zero
    progress.say("waiting for scale to zero (minReplicas 0, 10 s idle)")
    env.apply(s, min_replicas=0, idle_s=10)
    env.wait(
        "scale to zero",
        lambda: (
            (o := env.llmservice())["spec"]["replicas"] == 0
            and (o.get("status") or {}).get("readyReplicas", 0) == 0
        ),
    )
    progress.say("scaled to zero; one request to wake it")
    wake = Recorder()
    await one_request(client, wake, max_tokens=4)
    out["wake_from_zero_first_token_s"] = (
        round(wake.done[0][1], 1) if wake.done else f"failed ({wake.failures})"
    )
    await client.close()
    return out


def main(argv: list[str]) -> int:
    s = parse(argv)
    if s.kubeconfig is None:
        from conveyor.cluster import Cluster

        cluster = Cluster.attach()
        if cluster is None or cluster.tools is None:
            print(
                "conveyor bench autoscale: no cluster is running here. Start one with "
                "`conveyor cluster up` (it needs the node agent so that pods really run), "
                "or pass --kubeconfig.",
                file=sys.stderr,
            )
            return 2
        env = Env(cluster.kubeconfig_path, str(cluster.tools.path("kubectl")))
    else:
        import shutil

        kubectl = shutil.which("kubectl")
        if kubectl is None:
            print("conveyor bench autoscale: --kubeconfig needs kubectl on PATH", file=sys.stderr)
            return 2
        env = Env(s.kubeconfig, kubectl)
    progress = Progress()
    env.kubectl("create", "namespace", env.namespace)
    progress.say(f"namespace {env.namespace}: checking that pods really run")
    try:
        if why := env.pods_run():
            print(
                f"conveyor bench autoscale: {why}; it needs pods that really run.", file=sys.stderr
            )
            return 2
        env.start(s)
        progress.say(f"operator started; its log: {env.log}")
        figures = asyncio.run(bench(env, s, progress))
    except (RuntimeError, TimeoutError) as exc:
        print(f"conveyor bench autoscale: {exc}", file=sys.stderr)
        return 1
    finally:
        env.stop(s.keep)
    print(json.dumps(figures, indent=2))
    return 0
