"""The autoscaler's decision function on the replicas' gauges (queue depth, TTFT p95, idle
time) over synthetic signal traces; the TTFT window it reads; its policy as the LLMService
spec and the CRD give it."""

from __future__ import annotations

import random

import pytest
from autoscaler_sim import direction_changes, replicas

from conveyor.operator.autoscaler import decide
from conveyor.operator.autoscaler_model import AutoscalingPolicy, Decision, History, Observation
from conveyor.operator.signals import delta, merge, parse_histogram, quantile

POLICY = AutoscalingPolicy(
    enabled=True,
    min_replicas=1,
    max_replicas=8,
    target_queue_depth=4,
    target_ttft_p95=2.0,
    scale_down_stabilization=60,
    scale_to_zero_idle=120,
)


class Loop:
    """Runs decisions every ``period`` seconds; replicas become ready at the next tick."""

    def __init__(self, policy=POLICY, replicas_now: int = 1, period: float = 5.0):
        self.policy, self.history, self.period = policy, History(), period
        self.current, self.time = replicas_now, 0.0
        self.decisions: list[Decision] = []

    def tick(self, ready=None, ttft=None, pending=0, **load) -> Decision:
        ready_now = self.current if ready is None else ready
        obs = Observation(self.time, self.current, replicas(ready_now, **load), ttft, pending)
        d = decide(obs, self.policy, self.history)
        self.decisions.append(d)
        self.current = d.desired
        self.time += self.period
        return d

    @property
    def direction_changes(self) -> int:
        return direction_changes(self.decisions)


def test_step_up_goes_straight_to_what_the_queue_calls_for():
    loop = Loop()
    d = loop.tick(waiting=14, running=8)  # 14 waiting / 4 per replica -> 4 replicas
    assert (d.desired, d.direction, d.reason) == (4, "up", "queue-depth")


def test_requests_held_at_a_queueing_gateway_are_queue_depth():
    """A gateway that queues (``--queue-at-gateway``) keeps one request waiting per replica and
    holds the rest: the queue it holds calls for replicas as the replicas' own would."""
    loop = Loop()
    d = loop.tick(waiting=1, running=8, pending=13)  # 14 queued / 4 per replica -> 4 replicas
    assert (d.desired, d.direction, d.reason) == (4, "up", "queue-depth")


def test_ttft_above_target_scales_up_proportionally():
    loop = Loop(replicas_now=2)
    d = loop.tick(ttft=5.0, running=2)
    assert (d.desired, d.reason) == (5, "ttft-p95")


def test_ramp_adds_replicas_as_load_grows_and_respects_max():
    loop = Loop()
    seen = []
    for waiting in (2, 6, 12, 20, 40, 80):
        seen.append(loop.tick(waiting=waiting // max(1, loop.current), running=8).desired)
    assert seen == sorted(seen) and seen[-1] == POLICY.max_replicas
    assert loop.direction_changes == 0


def test_spike_shorter_than_the_window_does_not_scale_down_early():
    loop = Loop(replicas_now=1)
    loop.tick(waiting=20, running=8)
    assert loop.current == 5
    downs = [loop.tick(waiting=0, running=1).desired for _ in range(int(60 / 5))]
    assert all(n == 5 for n in downs[:-1]), "scaled down inside the stabilization window"
    for _ in range(10):
        loop.tick(waiting=0, running=1)
    assert loop.current == 1, "after the window, back to the minimum (in bounded steps)"
    assert all(
        d.desired >= d2.desired
        for d, d2 in zip(loop.decisions[1:], loop.decisions[2:], strict=False)
    )


def test_noisy_constant_load_does_not_flap():
    rng = random.Random(0)
    loop = Loop(replicas_now=3)
    for _ in range(240):  # 20 minutes at 5 s
        waiting = max(0, round(rng.gauss(6, 3)))  # ~2 per replica, target 4
        loop.tick(waiting=waiting // 3, running=6, kv=0.5 + rng.uniform(-0.1, 0.1))
    assert loop.direction_changes == 0
    assert {d.desired for d in loop.decisions} <= {3, 4}


def test_a_replica_stuck_loading_is_neither_capacity_nor_idle():
    loop = Loop(replicas_now=3)
    d = loop.tick(ready=2, waiting=10, running=8)  # 20 waiting over 2 ready -> 5
    assert (d.desired, d.direction) == (5, "up")
    # Loading replicas do not make the autoscaler add more for the same load...
    d = loop.tick(ready=2, waiting=10, running=8)
    assert d.desired == 5
    # ...nor freeze a scale-down once the load is gone.
    for _ in range(20):
        d = loop.tick(ready=2, waiting=0, running=0)
    assert loop.current == 1


def test_missing_signals_hold_steady():
    loop = Loop(replicas_now=2)
    d = loop.tick(ready=0)
    assert (d.desired, d.direction, d.reason) == (2, "none", "no-ready-replica")
    d = loop.tick(ttft=None, waiting=0, running=3)
    assert d.direction == "none"


def test_idle_service_scales_to_zero_and_wakes_on_pending_requests():
    policy = AutoscalingPolicy(
        enabled=True,
        min_replicas=0,
        max_replicas=4,
        scale_to_zero_idle=60,
        scale_down_stabilization=30,
    )
    loop = Loop(policy=policy, replicas_now=1)
    for _ in range(20):
        loop.tick(waiting=0, running=0)
        if loop.current == 0:
            break
    assert loop.current == 0 and loop.decisions[-1].reason == "idle"
    d = loop.tick(ready=0)
    assert (d.desired, d.reason) == (0, "scaled-to-zero")
    d = loop.tick(ready=0, pending=3)
    assert (d.desired, d.direction, d.reason) == (1, "up", "pending-requests")


def test_idle_time_counts_only_once_a_replica_is_ready():
    policy = AutoscalingPolicy(enabled=True, min_replicas=0, max_replicas=2, scale_to_zero_idle=10)
    loop = Loop(policy=policy, replicas_now=1, period=5.0)
    for _ in range(6):  # 30 s loading: longer than the idle time, but not idle
        d = loop.tick(ready=0)
        assert (d.desired, d.reason) == (1, "no-ready-replica")
    # Ready from here on: idle from the last moment it was loading, for the idle time.
    d = loop.tick(waiting=0, running=0)
    assert d.desired == 1
    d = loop.tick(waiting=0, running=0)
    assert (d.desired, d.reason) == (0, "idle")


def test_manual_scale_is_clamped_to_the_bounds():
    loop = Loop(replicas_now=20)
    assert loop.tick().desired == POLICY.max_replicas
    loop = Loop(
        policy=AutoscalingPolicy(enabled=True, min_replicas=2, max_replicas=4), replicas_now=1
    )
    d = loop.tick(ready=1)
    assert (d.desired, d.reason) == (2, "below-min-replicas")


def test_policy_from_the_llmservice_spec():
    p = AutoscalingPolicy.from_spec(
        {
            "enabled": True,
            "minReplicas": 0,
            "maxReplicas": 6,
            "targetQueueDepthPerReplica": 2,
            "targetTTFTP95Seconds": 1.5,
            "scaleDownStabilizationSeconds": 30,
        }
    )
    assert (p.min_replicas, p.max_replicas, p.target_queue_depth, p.target_ttft_p95) == (
        0,
        6,
        2.0,
        1.5,
    )
    assert p.scale_down_stabilization == 30.0


TEXT = """# HELP conveyor_time_to_first_token_seconds TTFT
# TYPE conveyor_time_to_first_token_seconds histogram
conveyor_time_to_first_token_seconds_bucket{le="0.1",model="m"} {a}
conveyor_time_to_first_token_seconds_bucket{le="1.0",model="m"} {b}
conveyor_time_to_first_token_seconds_bucket{le="10.0",model="m"} {c}
conveyor_time_to_first_token_seconds_bucket{le="+Inf",model="m"} {c}
conveyor_time_to_first_token_seconds_count{model="m"} {c}
conveyor_time_to_first_token_seconds_sum{model="m"} 1.0
"""


def scrape(a, b, c):
    return parse_histogram(
        TEXT.replace("{a}", str(a)).replace("{b}", str(b)).replace("{c}", str(c))
    )


def test_ttft_p95_comes_from_the_window_not_lifetime_totals():
    before = scrape(1000, 1000, 1000)  # an hour of fast requests
    now = scrape(1000, 1000, 1020)  # then 20 slow ones
    window = delta(now, before)
    assert quantile(0.95, window) == pytest.approx(1.0 + 9.0 * 0.95)
    assert quantile(0.95, now) < 1.0  # lifetime totals would hide them


def test_histogram_edge_cases():
    assert quantile(0.95, {}) is None
    assert quantile(0.95, scrape(0, 0, 0)) is None
    restarted = delta(scrape(1, 1, 2), scrape(5, 5, 9))
    assert restarted == scrape(1, 1, 2)
    total = merge([scrape(10, 10, 10), scrape(0, 0, 10)])
    assert quantile(0.5, total) == pytest.approx(0.1)


def test_every_policy_field_read_from_the_spec_is_in_the_crd():
    """The apiserver prunes fields its schema lacks: a knob only the code knows is lost."""
    import inspect
    import re

    import yaml

    from conveyor.operator.crd import CRD_FILE

    crd = yaml.safe_load(CRD_FILE.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    declared = set(spec["properties"]["autoscaling"]["properties"])
    read = set(re.findall(r's\.get\("(\w+)"', inspect.getsource(AutoscalingPolicy.from_spec)))
    assert read and read <= declared, read - declared


def test_the_crd_defaults_are_the_policy_defaults():
    """A spec that sets nothing reads as ``AutoscalingPolicy()``: the two sets of defaults agree."""
    from conveyor.operator.crd import apply_defaults

    body = apply_defaults({
        "apiVersion": "conveyor.dev/v1alpha1", "kind": "LLMService",
        "metadata": {"name": "m", "namespace": "n"},
        "spec": {"model": {"builtin": "conveyor-tiny"}},
    })  # fmt: skip
    assert AutoscalingPolicy.from_spec(body["spec"]["autoscaling"]) == AutoscalingPolicy()
