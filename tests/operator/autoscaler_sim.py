"""Simulated LLMServices that the autoscaler decides for, as its timer would: a fluid model
(``Service``) and a closed loop of discrete clients (``Clients``), each scraped and decided
every period; and the policy the simulations are sized for (``SIZED``)."""

from __future__ import annotations

import itertools
import math
import random
from collections import deque
from typing import Any

from conveyor.operator.autoscaler import decide
from conveyor.operator.autoscaler_model import (
    AutoscalingPolicy,
    Decision,
    Demand,
    History,
    Observation,
    ReplicaSignals,
)
from conveyor.operator.signals import Backlog, Counters, estimate_demand


def replicas(n: int, waiting: int = 0, running: int = 0, kv: float = 0.1, max_running: int = 8):
    return tuple(ReplicaSignals(waiting, running, max_running, kv) for _ in range(n))


def poisson(rng: random.Random, mean: float) -> int:
    """A Poisson draw (Knuth's: fine for the few arrivals of a 0.1 s step). A normal draw
    clipped at zero, as this was, overstates arrivals where the mean is near its spread: 6.8
    requests/s came out as 7.7."""
    limit, k, p = math.exp(-mean), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


CARRIED = 0.85
"""The share of its saturated throughput that one replica carries under the TTFT target, as
``conveyor bench autoscale`` measures it (70-90% in the README's runs): a load of N replicas'
worth is ``N * CARRIED * capacity``. N x capacity puts N replicas at 100%, where Poisson
arrivals queue without bound, and the autoscaler keeps N + 1 (above 90%:
``DOWN_UTILIZATION``)."""

SIZED = AutoscalingPolicy(
    enabled=True,
    min_replicas=1,
    max_replicas=8,
    target_queue_depth=2,
    scale_down_stabilization=60,
)


def direction_changes(decisions: list[Decision]) -> int:
    """How often the scale moved the other way from its last move."""
    moves = [d.direction for d in decisions if d.direction != "none"]
    return sum(1 for a, b in itertools.pairwise(moves) if a != b)


class Simulated:
    """What the timer keeps of a simulated service and does at each tick: each replica's
    counters over a demand window, a minute of backlog, the demand estimated from them, and
    the decision applied (a replica asked for is ready ``start_s`` later)."""

    policy: AutoscalingPolicy
    history: History
    time: float
    start_s: float
    ready: dict[int, Any]
    starting: list[float]  # times at which starting replicas become ready
    series: dict[int, deque[Counters]]
    backlog: deque[Backlog]
    decisions: list[Decision]
    replicas: list[int]  # spec.replicas after each decision

    @property
    def current(self) -> int:
        return len(self.ready) + len(self.starting)

    @property
    def direction_changes(self) -> int:
        return direction_changes(self.decisions)

    def _scrape(self, rid: int, counters: Counters) -> None:
        seen = self.series.setdefault(rid, deque())
        seen.append(counters)
        while len(seen) > 2 and seen[1].time <= self.time - self.policy.demand_window:
            seen.popleft()

    def _demand(self, backlog: float) -> Demand | None:
        for rid in set(self.series) - set(self.ready):
            if self.series[rid][-1].time < self.time - self.policy.demand_window:
                del self.series[rid]
        self.backlog.append(Backlog(self.time, backlog))
        while len(self.backlog) > 2 and self.backlog[1].time <= self.time - 60:
            self.backlog.popleft()
        return estimate_demand(
            self.series,
            self.backlog,
            now=self.time,
            window=self.policy.demand_window,
            panic_window=self.policy.panic_window,
        )

    def _apply(self, obs: Observation) -> None:
        d = decide(obs, self.policy, self.history)
        self.decisions.append(d)
        while self.current < d.desired:
            self.starting.append(self.time + self.start_s)
        while self.current > d.desired:
            if self.starting:
                self.starting.pop()
            else:
                self._remove_ready()
        self.replicas.append(self.current)

    def _remove_ready(self) -> None:
        self.ready.popitem()


class Service(Simulated):
    """A fluid model of one LLMService under a given arrival rate.

    Each ready replica finishes up to ``capacity`` requests/s (``tokens`` each) and runs at
    most ``slots`` at once; the gateway spreads the backlog evenly; a replica the autoscaler
    adds is ready ``start_s`` later. While open-loop arrivals exceed what the ready replicas
    finish, each finishes ``overload_capacity`` instead, if given (a CPU replica also accepts
    the requests it cannot serve yet). Every ``period`` the counters and backlog are scraped as
    the timer scrapes them, turned into ``Demand`` by the timer's own ``estimate_demand``, and
    ``decide`` is called.
    """

    def __init__(
        self,
        policy,
        *,
        capacity=8.0,
        overload_capacity=None,
        slots=2,
        start_s=15.0,
        period=2.0,
        seed=None,
        fresh=False,
    ):
        self.policy, self.history = policy, History()
        self.capacity, self.slots, self.start_s, self.period = capacity, slots, start_s, period
        self.overload_capacity = overload_capacity
        self.tokens = 100
        self.time, self.in_system, self.next_id, self.rate = 0.0, 0.0, 1, 0.0
        self.ready: dict[int, float] = {0: 0.0}  # replica id -> requests finished
        self.starting: list[float] = []  # times at which starting replicas become ready
        if fresh:  # just created: its first replica starts
            self.ready, self.starting = {}, [start_s]
        self.series: dict[int, deque[Counters]] = {}
        self.backlog: deque[Backlog] = deque()
        self.rng = random.Random(seed) if seed is not None else None
        self.decisions: list[Decision] = []
        self.replicas: list[int] = []  # spec.replicas after each decision

    def run(self, rate: float, seconds: float, clients: int | None = None) -> None:
        """Open-loop arrivals at ``rate``/s, or a closed loop of ``clients`` that each send
        again as soon as they are answered."""
        self.rate = rate
        for _ in range(round(seconds / self.period)):
            self._advance(rate, clients)
            self._decide()

    def _advance(self, rate: float, clients: int | None, dt: float = 0.1) -> None:
        for _ in range(round(self.period / dt)):
            self.time += dt
            for at in [t for t in self.starting if t <= self.time]:
                self.starting.remove(at)
                self.ready[self.next_id] = 0.0
                self.next_id += 1
            arrived = rate * dt
            if self.rng is not None:  # Poisson arrivals
                arrived = float(poisson(self.rng, arrived))
            if clients is not None:
                arrived = max(0.0, clients - self.in_system)
            self.in_system += arrived
            each = self.capacity
            if self.overload_capacity is not None and rate > len(self.ready) * self.capacity:
                each = self.overload_capacity
            served = min(self.in_system, len(self.ready) * each * dt)
            self.in_system -= served
            for rid in self.ready:
                self.ready[rid] += served / len(self.ready)

    def _decide(self) -> None:
        n = len(self.ready)
        # what waits, plus what is being served (Little: arrivals x a request's service time)
        share = (self.in_system + self.rate * self.slots / self.capacity) / max(1, n)
        running = min(share, self.slots)
        waiting = round(share - running)
        for rid, done in self.ready.items():
            self._scrape(rid, Counters(self.time, done, done * self.tokens, waiting > 0))
        demand = self._demand(round(self.in_system))
        kv = 0.1 + 0.4 * running / self.slots
        signals = tuple(ReplicaSignals(waiting, round(running), self.slots, kv) for _ in range(n))
        self._apply(Observation(self.time, self.current, signals, demand=demand, counting=True))


class Clients(Simulated):
    """A closed loop of discrete requests, as e2e/test_autoscaling drives a service: each of
    ``clients`` sends again a random gap after its answer (its own HTTP round trip), the
    gateway sends each request to the ready replica with the fewest running and waiting, a
    replica runs ``slots`` at once, and each request takes an exponential service time (so
    a busy replica finishes ``capacity``/s). Scraped and decided as ``Service`` does, every
    ``period`` (the e2e operator decides every second). The queue dips to its target now and
    then, and the backlog shrinks over a panic window about as often as it grows.
    """

    def __init__(
        self, policy, *, clients=10, slots=2, capacity=8.0, start_s=15.0, period=1.0, seed=0
    ):
        self.policy, self.history, self.rng = policy, History(), random.Random(seed)
        self.slots, self.capacity, self.start_s, self.period = slots, capacity, start_s, period
        self.time, self.next_id = 0.0, 1
        self.ready: dict[int, dict] = {0: self._replica()}
        self.starting: list[float] = []
        self.sends = [self.rng.uniform(0.0, 0.5) for _ in range(clients)]  # next send times
        self.series: dict[int, deque[Counters]] = {}
        self.backlog: deque[Backlog] = deque()
        self.decisions: list[Decision] = []
        self.replicas: list[int] = []
        self.queues: list[float] = []  # waiting per ready replica at each tick

    @staticmethod
    def _replica() -> dict:
        return {"running": [], "waiting": 0, "done": 0}

    def run(self, seconds: float) -> None:
        for _ in range(round(seconds / self.period)):
            self._advance()
            self._decide()

    def _route(self, n: int = 1) -> None:
        for _ in range(n):
            least = min(len(r["running"]) + r["waiting"] for r in self.ready.values())
            pick = [r for r in self.ready.values() if len(r["running"]) + r["waiting"] == least]
            self.rng.choice(pick)["waiting"] += 1

    def _advance(self, dt: float = 0.02) -> None:
        for _ in range(round(self.period / dt)):
            self.time += dt
            for at in [t for t in self.starting if t <= self.time]:
                self.starting.remove(at)
                self.ready[self.next_id] = self._replica()
                self.next_id += 1
            due = [t for t in self.sends if t <= self.time]
            self.sends = [t for t in self.sends if t > self.time]
            self._route(len(due))
            for r in self.ready.values():
                while r["waiting"] and len(r["running"]) < self.slots:
                    r["waiting"] -= 1
                    r["running"].append(self.rng.expovariate(self.capacity / self.slots))
                left = [s - dt for s in r["running"]]
                r["running"] = [s for s in left if s > 0]
                for _ in range(len(left) - len(r["running"])):
                    r["done"] += 1
                    self.sends.append(self.time + self.rng.expovariate(1 / 0.1))

    def _decide(self) -> None:
        signals = []
        for rid, r in self.ready.items():
            self._scrape(rid, Counters(self.time, r["done"], r["done"] * 100, r["waiting"] > 0))
            kv = 0.1 + 0.4 * len(r["running"]) / self.slots
            signals.append(ReplicaSignals(r["waiting"], len(r["running"]), self.slots, kv))
        backlog = sum(len(r["running"]) + r["waiting"] for r in self.ready.values())
        self.queues.append(sum(s.waiting for s in signals) / len(signals))
        demand = self._demand(backlog)
        self._apply(
            Observation(self.time, self.current, tuple(signals), demand=demand, counting=True)
        )

    def _remove_ready(self) -> None:  # the gateway sends what the removed replica held elsewhere
        _, gone = self.ready.popitem()
        self._route(len(gone["running"]) + gone["waiting"])
