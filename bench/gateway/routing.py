"""Part ``routing`` of ``conveyor bench gateway``: routing policies side by side on a
multi-turn shared-prefix chat workload over runtime replicas (see ``command``); the phase
where a replica joins mid-run is ``grow``."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from conveyor.bench.gateway import grow, processes, rounds, routers
from conveyor.bench.gateway.routers import RustRouter
from conveyor.bench.gateway.settings import MODEL, BenchSettings, replica_cpu_limit
from conveyor.bench.gateway.workload import working_set
from conveyor.bench.procs import ChildProcess, start_all
from conveyor.bench.wait import wait_until

CONVEYOR_POLICIES = ("prefix-aware", "least-load", "round-robin")


@dataclass(frozen=True)
class RoutingRun:
    """One proxy with one policy in front of the replicas."""

    proxy: str
    """``conveyor`` or a Rust router's name."""
    policy: str
    start: Callable[[list[str]], ChildProcess]
    """Starts the proxy in front of the replica URLs (ready when it returns)."""
    add: Callable[[ChildProcess, str], None]
    """Adds a replica to the running proxy the way its users would; returns once the proxy
    has it (the gateway admitted it, the router lists it healthy)."""

    @property
    def label(self) -> str:
        return f"{self.proxy} {self.policy}"


def routing_runs(
    peers: list[tuple[RustRouter, Path]], workdir: Path, policies: list[str]
) -> list[RoutingRun]:
    """The gateway's ``policies``, then each router's cache-aware policy (and vllm-router's
    consistent hashing).

    The gateway learns its replicas from a backends file (``--backends-file``, re-read when
    it changes: how a user adds one without a restart); the routers from ``--worker-urls``
    and, at run time, their own HTTP API (``routers.add_worker``).
    """

    def conveyor(policy: str) -> RoutingRun:
        backends = workdir / f"backends-{policy}.txt"

        def start(urls: list[str]) -> ChildProcess:
            write_backends(backends, urls)
            gateway = processes.gateway([], "--routing", policy, "--backends-file", str(backends))
            gateway.start()
            processes.wait_admitted(gateway, len(urls))
            return gateway

        def add(gateway: ChildProcess, url: str) -> None:
            urls = [*backends.read_text().split(), url]
            write_backends(backends, urls)
            processes.wait_admitted(gateway, len(urls))

        return RoutingRun("conveyor", policy, start, add)

    def router(r: RustRouter, venv: Path, policy: str) -> RoutingRun:
        def add(proxy: ChildProcess, url: str) -> None:
            routers.add_worker(r, proxy.url, url)
            wait_until(lambda: routers.has_healthy_worker(proxy.url, url), 60,
                       f"{r.name} to list {url} healthy")  # fmt: skip

        return RoutingRun(
            r.name, policy, lambda urls: processes.rust_router(r, venv, urls, policy).start(), add
        )

    runs = [conveyor(p) for p in policies]
    for r, venv in peers:
        for policy in ("cache_aware", "consistent_hash"):
            if policy in r.policies:
                runs.append(router(r, venv, policy))
    return runs


def write_backends(path: Path, urls: list[str]) -> None:
    """The gateway's backends file, replaced at once (it never reads half a file)."""
    partial = path.with_suffix(".partial")
    partial.write_text("".join(f"{url}\n" for url in urls))
    os.replace(partial, path)


def parse_policies(spec: str) -> list[str]:
    """``--policies``: the gateway's policies, comma-separated; ValueError naming the known."""
    names = list(dict.fromkeys(p.strip() for p in spec.split(",") if p.strip()))
    if not names or not set(names) <= set(CONVEYOR_POLICIES):
        raise ValueError(f"--policies takes a comma-separated list of "
                         f"{', '.join(CONVEYOR_POLICIES)} (got {spec!r})")  # fmt: skip
    return names


def bench_routing(
    s: BenchSettings, peers: list[tuple[RustRouter, Path]], phases: set[str], workdir: Path
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """The phases asked for (``routing``, ``grow``) on one set of replicas: each run's
    figures by label, per phase."""
    print(f"\n== routing (runtime replicas, {MODEL}): {s.replicas} replicas x "
          f"{s.max_total_tokens} KV tokens, {s.users} users x {s.turns} turns; working set "
          f"~{working_set(s)} tokens, seed {s.seed} ==", flush=True)  # fmt: skip
    cpus = replica_cpu_limit(s)
    print("  each replica limited to " + ("no CPU limit" if cpus is None else f"{cpus:g} CPUs")
          + f" of the machine's {os.cpu_count()}", flush=True)  # fmt: skip
    replicas = [processes.replica(s) for _ in range(s.replicas)]
    print("  (each proxy with its defaults but the policy; the routers' cache_aware sends a request"
          "\n   to the worker whose tree matches over --cache-threshold 0.3 of its text, and balances"
          "\n   only once loads differ by over 64 requests)", flush=True)  # fmt: skip
    runs = routing_runs(peers, workdir, parse_policies(s.policies))
    try:
        start_all(replicas)
        urls = [r.url for r in replicas]
        figures = steady(s, runs, urls) if "routing" in phases else {}
        grown = grow.bench_grow(s, runs, urls) if "grow" in phases else {}
    finally:
        for replica in replicas:
            replica.stop()
    return figures, grown


def steady(
    s: BenchSettings, runs: list[RoutingRun], urls: list[str]
) -> dict[str, dict[str, float]]:
    """Every run over all the replicas, in rounds (``rounds.py``): TTFT p50/p95 (s), req/s,
    prefix hit rate, max/min and where TTFT went, each the median over rounds."""
    print(f"  {s.rounds} rounds, each running every proxy once on fresh text, the order "
          "rotated each round", flush=True)  # fmt: skip
    figures, per_round = rounds.interleaved(s, runs, urls)
    rounds.print_tables(figures, s.rounds)
    mine = "conveyor prefix-aware"
    peers = [run.label for run in runs if run.proxy != "conveyor"]
    if mine in figures and peers:
        for key, what, lower in (("ttft_p50", "TTFT p50", True), ("req_s", "req/s", False)):
            ratios = rounds.ratio_per_round(per_round, mine, peers, key, lower)
            print(f"  {mine} / best peer in the same round, {what}: "
                  + ", ".join(f"{x:.2f}x" for x in ratios)
                  + f" (median {statistics.median(ratios):.2f}x)")  # fmt: skip
    return figures
