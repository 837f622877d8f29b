"""``conveyor bench autoscale``'s pure parts: its command line and its progress lines (the
benchmark itself needs a cluster and prints figures; it is not run here)."""

from __future__ import annotations

import argparse

import pytest

from conveyor.bench.autoscale.command import parse, parser
from conveyor.bench.autoscale.load import describe_status


def test_every_option_has_a_help_text_and_reaches_the_settings():
    options = [a for a in parser()._actions if not isinstance(a, argparse._HelpAction)]
    assert options
    for action in options:
        assert action.help and action.help.strip(), f"{action.option_strings} has no help"
    s = parse(["--minutes", "1", "--step-factor", "3", "--progress-every", "5", "--keep"])
    assert (s.minutes, s.step_factor, s.progress_every_s, s.keep) == (1.0, 3.0, 5.0, True)
    assert not s.gateway_queue and parse(["--gateway-queue"]).gateway_queue


def test_a_progress_line_says_replicas_and_the_autoscalers_estimates():
    obj = {
        "spec": {"replicas": 3},
        "status": {
            "readyReplicas": 2,
            "autoscaler": {
                "direction": "up",
                "reason": "panic",
                "signals": {
                    "queueDepthPerReplica": 12.5,
                    "demandRequestsPerSecond": 16.7,
                    "utilization": 1.0,
                    "panic": True,
                    "replicasNeeded": 1.24,
                    "burstReplicasNeeded": 2.61,
                },
                "capacity": {"requestsPerSecond": 8.35, "source": "measured"},
            },
        },
    }
    line = describe_status(obj)
    assert line == (
        "replicas 3 desired / 2 ready, queue/replica 12.5, demand 16.70 req/s, capacity "
        "8.35 req/s/replica (measured), utilization 1.00, panic, replicas needed 1.24 "
        "(panic window 2.61), last decision up (panic)"
    )
    assert (
        describe_status({"spec": {"replicas": 1}})
        == "replicas 1 desired / 0 ready, queue/replica 0.0"
    )


class FakeApi:
    def __init__(self, replicas: int, pods: list[dict]) -> None:
        self.replicas, self.pods = replicas, pods

    def get(self, path: str, **query: str) -> dict:
        if path.endswith("/pods"):
            assert query == {"labelSelector": "app.kubernetes.io/component=runtime"}
            return {"items": self.pods}
        return {"spec": {"replicas": self.replicas}}


class FakeEnv:
    namespace = "bench-x"
    path = "/apis/conveyor.dev/v1alpha1/namespaces/bench-x/llmservices/bench"

    def __init__(self, replicas: int, pods: list[dict]) -> None:
        self.api = FakeApi(replicas, pods)

    def llmservice(self) -> dict:
        return self.api.get(self.path)


def test_the_wake_milestones_are_read_from_the_api_and_spanned_in_order():
    from conveyor.bench.autoscale.wake import seen_now, spans

    starting = {"metadata": {"name": "a"}, "spec": {"nodeName": "gpu-0"}, "status": {
        "containerStatuses": [{"state": {"running": {}}}],
        "conditions": [{"type": "Ready", "status": "False"}]}}  # fmt: skip
    going = {"metadata": {"name": "b", "deletionTimestamp": "x"}, "spec": {}, "status": {
        "conditions": [{"type": "Ready", "status": "True"}]}}  # fmt: skip
    assert seen_now(FakeEnv(0, [])) == set()
    assert seen_now(FakeEnv(1, [going])) == {"decided"}  # a pod being deleted is not the wake
    assert seen_now(FakeEnv(1, [starting, going])) == {
        "decided", "pod_created", "scheduled", "started"}  # fmt: skip
    lines = spans({"decided": 1.3, "pod_created": 1.9, "scheduled": 1.9, "started": 2.1,
                   "ready": 21.1, "first_token_s": 21.6, "runtime_start": "ready in 19.0 s"})  # fmt: skip
    assert [ln.split()[0] for ln in lines[:-1]] == ["1.3", "0.6", "0.0", "0.2", "19.0", "0.5"]
    assert "started -> ready" in lines[4] and lines[-1] == "  runtime: ready in 19.0 s"
    # a milestone not seen (a poll missed it) is left out; the next span starts from the last
    assert spans({"decided": 1.0, "ready": 5.0})[1].split()[:3] == ["4.0", "s", "decided"]


def test_a_readiness_the_reads_missed_is_taken_from_the_pods_own_record():
    """The gateway forwards the held request the moment the pod is Ready, so the first token can
    come before the next read: the Ready condition's lastTransitionTime says when, to the second."""
    from datetime import UTC, datetime

    from conveyor.bench.autoscale.wake import ready_since

    def pod(ready: str, deleting: bool = False) -> dict:
        meta = {"name": "p", **({"deletionTimestamp": "x"} if deleting else {})}
        return {"metadata": meta, "spec": {}, "status": {"conditions": [
            {"type": "Ready", "status": ready, "lastTransitionTime": "2026-12-05T06:00:10Z"}]}}  # fmt: skip

    at = datetime(2026, 12, 5, 6, 0, 10, tzinfo=UTC).timestamp()
    assert ready_since(FakeEnv(1, [pod("True")])) == at
    assert ready_since(FakeEnv(1, [pod("False")])) is None
    assert ready_since(FakeEnv(1, [pod("True", deleting=True)])) is None


def test_capacity_is_what_one_replica_carries_unless_asked_for_its_saturated_throughput():
    assert parse([]).capacity == "slo"
    assert parse(["--capacity", "saturated"]).capacity == "saturated"
    import pytest

    with pytest.raises(SystemExit):
        parse(["--capacity", "peak"])


def recorder(requests: list[tuple[float, float]]):
    """A Recorder of (send time, TTFT) requests that each finish 0.2 s after their first token."""
    from conveyor.bench.autoscale.load import Recorder

    rec = Recorder()
    for sent, ttft in sorted(requests, key=lambda r: r[0] + r[1]):
        rec.done.append((sent + ttft + 0.2, ttft, "a"))
        rec.sent.append((sent, ttft))
    return rec


def test_ttft_recovery_is_measured_by_finish_window_and_by_arrival():
    """Ten requests a second; those sent in [2 s, 14 s) wait for a replica that is ready at
    14 s (TTFT up to 12 s), then all are served at once. A window of finished requests lags:
    the slow ones finish until about 26 s. A window of first tokens lags by as much less as
    each request's decode (0.2 s here). By arrival, a user sent from 14 s on is served
    within target."""
    from conveyor.bench.autoscale.run import (
        recovered_by_arrival,
        recovered_by_finish,
        recovered_by_first_token,
    )

    requests = []
    for i in range(400):
        sent = i / 10
        ttft = 14 - sent if 2 <= sent < 14 else 0.3
        requests.append((sent, ttft))
    rec = recorder(requests)
    by_arrival = recovered_by_arrival(rec, 0.0, target=2.0)
    assert by_arrival is not None and 12 <= by_arrival <= 14
    by_finish = recovered_by_finish(rec, 1.0, target=2.0)
    assert by_finish is not None and by_finish > 20
    by_first = recovered_by_first_token(rec, 1.0, target=2.0)
    assert by_first is not None and by_first == pytest.approx(by_finish - 0.2, abs=0.15)
    # never above target: nothing to recover from
    calm = recorder([(i / 10, 0.3) for i in range(400)])
    assert recovered_by_arrival(calm, 0.0, 2.0) is None
    assert recovered_by_finish(calm, 1.0, 2.0) is None
    assert recovered_by_first_token(calm, 1.0, 2.0) is None


def test_the_step_trace_keeps_each_change_within_its_seconds_of_the_step():
    from conveyor.bench.autoscale.load import Recorder, Sample
    from conveyor.bench.autoscale.run import TRACE_S, step_trace

    rec = Recorder()
    step = 100.0
    for i in range(-10, 90):  # twice a second, from 5 s before the step to 45 s after
        t = step + i / 2
        asked = 1 if t < step + 3 else 3
        burst = None if t < step else round(min(2.5, 1.0 + (t - step) / 2), 2)
        rec.samples.append(Sample(t, asked, 1 if t < step + 15 else 3, 0.0, None, 1.0, burst))
    trace = step_trace(rec, step)
    assert trace[0] == [-1.0, 1, 1, 0.0, 1.0, None]  # a second before the step
    assert [-1.0, 1, 1, 0.0, 1.0, None] not in trace[1:]  # unchanged samples are left out
    assert [3.0, 3, 1, 0.0, 1.0, 2.5] in trace  # the decision, with what the panic window read
    assert [15.0, 3, 3, 0.0, 1.0, 2.5] in trace  # the replicas ready
    assert trace[-1][0] <= TRACE_S
