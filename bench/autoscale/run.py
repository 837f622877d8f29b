"""The phases of ``conveyor bench autoscale``: capacity, the step, constant load, wake from
zero; and the chart of the run."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import Any

from conveyor.bench.autoscale.cluster_env import Env
from conveyor.bench.autoscale.load import (
    Progress,
    Recorder,
    closed_loop,
    open_loop,
    watch,
    window_p95,
)
from conveyor.bench.autoscale.settings import BenchSettings
from conveyor.bench.autoscale.wake import spans, wake_timeline


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


TRACE_S = 30.0
"""Seconds after the step that ``step_trace`` covers."""


def step_trace(rec: Recorder, step_at: float) -> list[list[Any]]:
    """[seconds since the step, desired, ready, queue per replica, replicas the demand window
    calls for, replicas the panic window calls for] at each change within ``TRACE_S`` of the
    step: where the time to the decision went."""
    rows: list[list[Any]] = []
    for x in rec.samples:
        if not step_at - 1 <= x.t <= step_at + TRACE_S:
            continue
        row = [x.replicas, x.ready, x.queue, x.need, x.burst_need]
        if not rows or rows[-1][1:] != row:
            rows.append([round(x.t - step_at, 1), *row])
    return rows


def recovered_by_finish(rec: Recorder, after: float, target: float) -> float | None:
    """When the client-side TTFT p95 over the last 10 s of finished requests came back under
    ``target``, after it had been above it, past ``after`` (the scale-up decision): what a
    dashboard of recent requests shows (it lags by up to its 10 s window)."""
    return _recovered([(at, ttft) for at, ttft, _ in rec.done], after, target)


def recovered_by_first_token(rec: Recorder, after: float, target: float) -> float | None:
    """As ``recovered_by_finish``, over the first tokens of the last 10 s: what a dashboard of
    a TTFT histogram shows (each request's TTFT is observed at its first token, which comes
    its decode earlier than its end)."""
    return _recovered(sorted((sent + ttft, ttft) for sent, ttft in rec.sent), after, target)


def _recovered(events: list[tuple[float, float]], after: float, target: float) -> float | None:
    """The first time past ``after`` at which the TTFT p95 of the (time, TTFT) ``events`` of
    the 10 s before it is back under ``target``, after it had been above it."""
    times, ttfts = [at for at, _ in events], [ttft for _, ttft in events]
    breached = False
    for at in times:
        p = window_p95(times, ttfts, at - 10, at)
        if p is not None and p > target:
            breached = True
        elif breached and p is not None and p <= target and at > after:
            return at
    return None


def recovered_by_arrival(rec: Recorder, step_at: float, target: float) -> float | None:
    """The first second after the step, after a breach, from which the requests sent in the
    next 10 s have a TTFT p95 under ``target``: when a newly arriving user is served within
    target again (no window's lag)."""
    last = max((at for at, _ in rec.sent), default=step_at)
    breached = False
    t = step_at
    while t + 10 <= last:
        p = rec.p95_sent(t, t + 10)
        if p is not None and p > target:
            breached = True
        elif breached and p is not None and p <= target:
            return t
        t += 1.0
    return None


SLO_FRACTIONS = (0.9, 0.8, 0.7, 0.6, 0.5)
"""Shares of one replica's saturated throughput tried, highest first, for the rate it carries."""


async def one_replica_capacity(
    client: Any, s: BenchSettings, progress: Progress, out: dict[str, Any]
) -> float:
    """One replica's requests/s that the step is a multiple of (``--capacity``).

    Saturated: its throughput under a closed loop of 4 clients (2 running, 2 queued). A 2x step
    of that puts two replicas at 100%, where a queue grows without bound and no TTFT target
    holds. Slo (the default): the highest open-loop rate, as a share of that throughput, at
    which its client-side TTFT p95 stays under the target and it keeps up with arrivals (20 s
    at each share): the load one replica carries, so that N x it is what N replicas carry.
    """
    progress.say("ready; measuring one replica's throughput (5 s warm-up, 20 s of 4 clients)")
    await closed_loop(client, Recorder(), clients=2, seconds=5, s=s)  # warm up
    cap = Recorder()
    await closed_loop(client, cap, clients=4, seconds=20, s=s)
    backends = {b for _, _, b in cap.done}
    saturated = len(cap.done) / 20 / max(1, len(backends))
    out["one_replica_saturated_rps"] = round(saturated, 2)
    progress.say(f"one replica saturated: {saturated:.2f} requests/s")
    if s.capacity == "saturated":
        out["one_replica_rps"] = round(saturated, 2)
        return saturated
    carried = SLO_FRACTIONS[-1] * saturated
    for share in SLO_FRACTIONS:
        rate, rec, stop = share * saturated, Recorder(), asyncio.Event()
        load = asyncio.create_task(open_loop(client, rec, rate, stop, s))
        await asyncio.sleep(20)
        stop.set()
        await load
        p95 = rec.p95_sent(0, float("inf"))
        kept_up = len(rec.done) >= 0.9 * rate * 20
        progress.say(
            f"  {share:.0%} of it ({rate:.2f} requests/s, 20 s): TTFT p95 "
            f"{'-' if p95 is None else f'{p95:.2f} s'}, {len(rec.done)} done"
        )
        if p95 is not None and p95 <= s.target_ttft_s and kept_up and not rec.failures:
            carried = rate
            break
    else:
        progress.say(
            f"  no share kept TTFT p95 under {s.target_ttft_s:g} s: stepping from the lowest "
            f"({SLO_FRACTIONS[-1]:.0%}); raise --target-ttft or --replica-cpu"
        )
    out["one_replica_rps"] = round(carried, 2)
    out["one_replica_share_of_saturated"] = round(carried / saturated, 2)
    return carried


async def bench(env: Env, s: BenchSettings, progress: Progress) -> dict[str, Any]:
    import openai

    # While one replica's capacity is measured, the autoscaler runs held at that replica (it
    # sees it busy, as a running service's autoscaler has), or is off (--autoscaler-from-step).
    env.apply(s, min_replicas=1, autoscale=not s.autoscaler_from_step, max_replicas=1)
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
    if not s.wake_only:
        await step_phases(env, s, progress, client, out)

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
    timeline = await wake_timeline(env, client)
    out["wake_from_zero_first_token_s"] = timeline.pop("first_token_s")
    out["wake_from_zero_seconds_from_send"] = timeline
    progress.say("wake from zero, where the time went:\n" + "\n".join(spans({
        **timeline, "first_token_s": out["wake_from_zero_first_token_s"]})))  # fmt: skip
    await client.close()
    return out


async def step_phases(
    env: Env, s: BenchSettings, progress: Progress, client: Any, out: dict[str, Any]
) -> None:
    """Phases 1-3 into ``out``: one replica's capacity, the step, constant load."""
    # 1. one replica's capacity
    capacity = await one_replica_capacity(client, s, progress, out)
    # The load it carries goes on until the step, as a running service's would: a lull while
    # maxReplicas is raised emptied the panic window, which then read the step seconds late
    # (the step's trace: what the panic window called for fell from 0.9 to 0.55 replicas).
    before_step = asyncio.Event()
    bridge = asyncio.create_task(open_loop(client, Recorder(), capacity, before_step, s))
    status = await asyncio.to_thread(env.llmservice)
    known = ((status.get("status") or {}).get("autoscaler") or {}).get("capacity")
    before = known.get("requestsPerSecond") if known else None
    out["autoscaler_capacity_before_step_rps"] = before
    progress.say(
        f"one replica carries {capacity:.2f} requests/s; the autoscaler's estimate of it: "
        f"{'none' if before is None else f'{before} requests/s'}; maxReplicas "
        f"{s.max_replicas} from the step"
    )
    await asyncio.to_thread(env.apply, s, min_replicas=1)
    await asyncio.to_thread(
        env.wait,
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
    if s.minutes * 60 < s.scale_down_window_s + 60:
        progress.say(
            f"note: --minutes {s.minutes:g} is within the scale-down window "
            f"({s.scale_down_window_s} s) and a minute for the backlog to drain: a replica the "
            "step added beyond what the load needs may not go before the end, so "
            "replicas_at_end may show no settling down"
        )
    step_at = time.monotonic()
    load = asyncio.create_task(open_loop(client, rec, s.step_factor * capacity, stop, s))
    before_step.set()  # the step's arrivals take over from here
    await asyncio.sleep(s.minutes * 60)
    stop.set()
    await asyncio.gather(load, watcher, bridge)
    first_backends = {b for _, _, b in rec.done[:1]}
    decision = next((x.t for x in rec.samples if x.replicas > 1), None)
    serving = next((at for at, _, b in rec.done if b and b not in first_backends), None)
    recovered = None if decision is None else recovered_by_finish(rec, decision, s.target_ttft_s)
    by_arrival = recovered_by_arrival(rec, step_at, s.target_ttft_s)
    by_first = (
        None if decision is None else recovered_by_first_token(rec, decision, s.target_ttft_s)
    )
    settle = step_at + min(s.minutes * 60 / 4, 120)
    steady = [x.replicas for x in rec.samples if x.t >= settle]
    out.update({
        "gateway_queue": s.gateway_queue,
        "backlog_drain_s": s.backlog_drain_s,
        "step_rps": round(s.step_factor * capacity, 2),
        "step_to_decision_s": None if decision is None else round(decision - step_at, 1),
        "step_to_new_replica_serving_s": None if serving is None else round(serving - step_at, 1),
        "step_to_ttft_p95_under_target_s": (
            None if recovered is None else round(recovered - step_at, 1)
        ),
        "step_to_ttft_p95_under_target_by_first_token_s": (
            None if by_first is None else round(by_first - step_at, 1)
        ),
        "step_to_ttft_p95_under_target_by_arrival_s": (
            None if by_arrival is None else round(by_arrival - step_at, 1)
        ),
        "max_replicas": max((x.replicas for x in rec.samples), default=0),
        "replicas_at_end": rec.samples[-1].replicas if rec.samples else 0,
        "direction_changes_under_constant_load": direction_changes(steady),
        "constant_load_minutes_counted": round((s.minutes * 60 - (settle - step_at)) / 60, 1),
        "requests": len(rec.done),
        "failed_requests": rec.failures,
        "step_trace": step_trace(rec, step_at),
    })  # fmt: skip
    final = ((env.llmservice().get("status") or {}).get("autoscaler") or {}).get("capacity")
    out["autoscaler_capacity_rps"] = None if not final else final.get("requestsPerSecond")
    plot(rec, step_at, s.png, s)
    out["png"] = str(s.png.resolve())
    progress.say(f"load done: {len(rec.done)} requests, {rec.failures} failed; chart {s.png}")
