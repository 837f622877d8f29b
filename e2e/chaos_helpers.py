"""Helpers of the fault tests (``test_chaos.py``): steady traffic through the gateway that counts
what a client sees, a watch on the LLMService's phase, and the faults themselves.

The client behaves as the OpenAI SDK does by default: a request that failed before its first
byte on a connection error or a 408/409/429/5xx answer is sent again, at most twice, after
0.5 s then 1 s; such a resend is counted as a client retry. A request whose stream had begun
is never resent (its tokens were already shown). Every loop is bounded by a stop flag and every
wait by a deadline.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from real_nodes_helpers import containerd_task_pid

from conveyor.cluster import Cluster
from conveyor.cluster.api import ApiClient, ApiError, wait_for
from conveyor.operator.names import GATEWAY_NAME

RETRYABLE_STATUS = {408, 409, 429, 500, 502, 503, 504}
"""Statuses the OpenAI SDK resends (with connection errors)."""
CLIENT_RETRIES = 2
"""The OpenAI SDK's default ``max_retries``."""


@dataclass(frozen=True)
class Outcome:
    """One request as the client saw it."""

    finished_at: float
    ok: bool
    streamed: bool
    """Whether its first byte of answer arrived (a failure after it is a broken stream)."""
    retries: int
    error: str = ""


@dataclass
class Figures:
    """What the client saw over a span of time."""

    answered: int = 0
    failed_before_first_byte: int = 0
    failed_after_first_byte: int = 0
    client_retries: int = 0
    errors: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (
            f"answered {self.answered}, failed {self.failed_before_first_byte} before the first "
            f"byte / {self.failed_after_first_byte} after it, client retries {self.client_retries}"
        )


class Traffic:
    """``clients`` threads sending streamed completions through the gateway back to back."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        clients: int = 2,
        max_tokens: int = 8,
        timeout_s: float = 30.0,
    ) -> None:
        self.base_url = base_url
        self.model = model
        self.clients = clients
        self.max_tokens = max_tokens
        self.timeout = httpx.Timeout(timeout_s, connect=5.0)
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sent = 0

    def __enter__(self) -> Traffic:
        for i in range(self.clients):
            thread = threading.Thread(target=self._loop, name=f"client-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.timeout.read or 30)
        alive = [t.name for t in self._threads if t.is_alive()]
        assert not alive, f"client threads did not stop: {alive}"

    def _loop(self) -> None:
        with httpx.Client(trust_env=False, timeout=self.timeout) as client:
            while not self._stop.is_set():
                outcome = self._request(client)
                if outcome is not None:
                    with self._lock:
                        self.outcomes.append(outcome)

    def _request(self, client: httpx.Client) -> Outcome | None:
        """One request with the client's resends; None when the test stopped it before a resend."""
        with self._lock:
            self._sent += 1
            n = self._sent
        body = {
            "model": self.model,
            # A prompt of its own per request, so that prefix-aware routing spreads them.
            "prompt": f"{n} Tell me a story",
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        retries = 0
        while True:
            streamed, error, retryable = self._attempt(client, body)
            if not error:
                return Outcome(time.monotonic(), True, True, retries)
            if streamed or not retryable or retries >= CLIENT_RETRIES:
                return Outcome(time.monotonic(), False, streamed, retries, error)
            if self._stop.is_set():
                return None
            self._stop.wait(0.5 * 2**retries)  # the SDK's back-off between resends
            retries += 1

    def _attempt(self, client: httpx.Client, body: dict[str, Any]) -> tuple[bool, str, bool]:
        """(first byte seen, error or "", whether the error may be resent)."""
        streamed = False
        try:
            with client.stream("POST", f"{self.base_url}/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    text = resp.read().decode(errors="replace")[:200]
                    return (
                        False,
                        f"HTTP {resp.status_code}: {text}",
                        resp.status_code in RETRYABLE_STATUS,
                    )
                done = False
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    streamed = True
                    data = line.removeprefix("data: ")
                    if data == "[DONE]":
                        done = True
                        break
                    if "error" in json.loads(data):
                        return True, f"error event: {data[:200]}", False
                return (
                    (True, "", False)
                    if done
                    else (streamed, "stream ended without [DONE]", not streamed)
                )
        except httpx.TransportError as exc:
            return streamed, f"{type(exc).__name__}: {exc}", not streamed

    def since(self, t0: float, t1: float | None = None) -> Figures:
        """Figures of the requests that finished in [t0, t1)."""
        with self._lock:
            outcomes = [
                o
                for o in self.outcomes
                if o.finished_at >= t0 and (t1 is None or o.finished_at < t1)
            ]
        figures = Figures()
        for o in outcomes:
            figures.client_retries += o.retries
            if o.ok:
                figures.answered += 1
            elif o.streamed:
                figures.failed_after_first_byte += 1
            else:
                figures.failed_before_first_byte += 1
            if o.error and len(figures.errors) < 5:
                figures.errors.append(f"{o.error} (ended +{o.finished_at - t0:.1f}s)")
        return figures

    def wait_answers(self, count: int, since: float, timeout_s: float = 120) -> None:
        """Wait until ``count`` requests finishing after ``since`` were answered."""
        wait_for(
            f"{count} answers through the gateway",
            lambda: self.since(since).answered >= count,
            timeout_s=timeout_s,
            interval_s=0.1,
        )


GATEWAY_PODS = "app.kubernetes.io/component=gateway"
UNANSWERED = (ApiError, OSError, http.client.HTTPException, KeyError, TypeError)
"""What a poll of an apiserver that is down or recovering can raise (an error status, a refused
or reset connection, a reply cut short, a body that is not the object): the poll reads
"unreachable" and goes on, where an escaped error would end the watch's thread, and its
timeline with it."""


@dataclass(frozen=True)
class Sample:
    t: float
    phase: str
    """The LLMService's phase, or "unreachable"."""
    unready: int
    """Runtime pods not Ready (-1: unreachable)."""
    gateway_endpoints: int
    """Ready endpoints of the gateway's Service, as its EndpointSlices say (-1: unreachable):
    what kube-proxy routes the Service's address to."""
    gateway_slices: str = ""
    """The names of those EndpointSlices (a slice deleted and made anew shows here)."""
    gateway_pods_ready: int = -1
    """Gateway pods whose Ready condition is True in the API (what the slices are made from)."""


class PhaseWatch:
    """Polls the LLMService's phase, its pods' Ready conditions and the gateway Service's ready
    endpoints on its own thread, with a short timeout per call, so that it keeps a timeline
    through a frozen apiserver."""

    def __init__(self, api: ApiClient, namespace: str, name: str) -> None:
        self.api = ApiClient(api.credentials, timeout_s=2.0)
        self.path = f"/apis/conveyor.dev/v1alpha1/namespaces/{namespace}/llmservices/{name}"
        self.pods = f"/api/v1/namespaces/{namespace}/pods"
        self.slices = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
        self.selector = f"conveyor.dev/llmservice={name}"
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="phase-watch", daemon=True)

    def __enter__(self) -> PhaseWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                phase = (self.api.get(self.path).get("status") or {}).get("phase") or "None"
                pods = self.api.get(self.pods, labelSelector=self.selector)["items"]
                unready = sum(1 for p in pods if not pod_ready(p))
            except UNANSWERED:
                phase, unready = "unreachable", -1
            try:
                slices = self.api.get(
                    self.slices, labelSelector=f"kubernetes.io/service-name={GATEWAY_NAME}"
                )["items"]
                endpoints = sum(
                    1
                    for s in slices
                    for e in s.get("endpoints") or []
                    if (e.get("conditions") or {}).get("ready")
                )
                names = ",".join(sorted(sl["metadata"]["name"] for sl in slices))
                gateways = self.api.get(self.pods, labelSelector=GATEWAY_PODS)["items"]
                gateways_ready = sum(1 for p in gateways if pod_ready(p))
            except UNANSWERED:
                endpoints, names, gateways_ready = -1, "", -1
            self.samples.append(Sample(t, phase, unready, endpoints, names, gateways_ready))
            self._stop.wait(0.25)

    def wait_sample(self, since: float, timeout_s: float = 30) -> None:
        """Wait until a poll that began at ``since`` or later has been recorded."""
        wait_for(
            "the phase watch's next sample",
            lambda: any(s.t >= since for s in self.samples[-4:]),
            timeout_s=timeout_s,
            interval_s=0.05,
        )

    def phases(self, since: float) -> list[str]:
        """The phases seen since ``since``, each run of equal ones once."""
        seen: list[str] = []
        for s in self.samples:
            if s.t >= since and (not seen or seen[-1] != s.phase):
                seen.append(s.phase)
        return seen

    def gateway_timeline(self, since: float) -> str:
        """The gateway Service's ready endpoints since ``since``, each change once, as
        ``+SECONDS:ENDPOINTS/PODS[SLICES]``: ready endpoints in the slices, gateway pods Ready
        in the API, the slices' names (-1: the apiserver did not answer)."""
        seen: list[str] = []
        last: tuple[int, int, str] | None = None
        for s in self.samples:
            now = (s.gateway_endpoints, s.gateway_pods_ready, s.gateway_slices)
            if s.t >= since and now != last:
                seen.append(
                    f"+{s.t - since:.1f}s:{s.gateway_endpoints}/{s.gateway_pods_ready}"
                    f"[{s.gateway_slices}]"
                )
                last = now
        return " ".join(seen)

    def recovery(self, fault_start: float, fault_end: float) -> str:
        """When the phase was Ready for good, in words: "stayed Ready" when it never left Ready
        after ``fault_start``, else seconds after the fault began and after it ended."""
        last_bad = None
        for s in self.samples:
            if s.t >= fault_start and s.phase != "Ready":
                last_bad = s.t
        if last_bad is None:
            return "stayed Ready"
        after = [s.t for s in self.samples if s.t > last_bad and s.phase == "Ready"]
        assert after, f"the LLMService is not Ready again (phases {self.phases(fault_start)})"
        return (
            f"Ready again {after[0] - fault_start:.1f} s after the fault began, "
            f"{max(0.0, after[0] - fault_end):.1f} s after it ended"
        )

    def pods_unready_seen(self, since: float) -> int:
        """The most runtime pods seen not Ready at once since ``since``."""
        return max((s.unready for s in self.samples if s.t >= since), default=0)


def pod_ready(pod: dict[str, Any]) -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


# ---- the faults ------------------------------------------------------------------------


@contextlib.contextmanager
def frozen(cluster: Cluster, *names: str) -> Iterator[None]:
    """SIGSTOP the named components (their whole process groups) for the ``with`` block, SIGCONT
    after it whatever happens: what an etcd leader election, an apiserver upgrade or a network
    partition looks like from the node."""
    pids = []
    for name in names:
        record = cluster.processes[name].record
        assert record is not None and record.alive(), f"{name} does not run"
        pids.append(record.pid)
    try:
        for pid in pids:
            os.killpg(pid, signal.SIGSTOP)
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGCONT)


def kill_container(cluster: Cluster, pod: dict[str, Any], container: str | None = None) -> None:
    """SIGKILL a container's processes, as the kernel's OOM killer or a crash would: its init,
    found through its node's containerd (its PID namespace goes with it)."""
    statuses = pod["status"]["containerStatuses"]
    status = next(s for s in statuses if container in (None, s["name"]))
    container_id = status["containerID"].partition("://")[2]
    os.kill(containerd_task_pid(cluster, pod["spec"]["nodeName"], container_id), signal.SIGKILL)


def http(url: str, body: dict[str, Any] | None = None, timeout_s: float = 60) -> Any:
    """GET (or POST ``body``) without any proxy; the decoded JSON or the text."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with opener.open(request, timeout=timeout_s) as resp:
        text = resp.read().decode()
    return json.loads(text) if body is not None else text


def metric_sum(text: str, name: str) -> float:
    """The sum of every series of ``name`` in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def pod_metric(pods: list[dict[str, Any]], port: int, name: str) -> dict[str, float]:
    """``name`` summed per pod (by pod name), scraped from each pod's ``/metrics``."""
    values = {}
    for pod in pods:
        ip = (pod.get("status") or {}).get("podIP")
        if ip and pod_ready(pod):
            with contextlib.suppress(OSError):
                values[pod["metadata"]["name"]] = metric_sum(
                    http(f"http://{ip}:{port}/metrics", timeout_s=5), name
                )
    return values


def elapsed(t0: float) -> float:
    return time.monotonic() - t0


def wait(what: str, check: Callable[[], Any], timeout_s: float, interval_s: float = 0.25) -> Any:
    return wait_for(what, check, timeout_s=timeout_s, interval_s=interval_s)
