"""``conveyor bench autoscale``: a step load against the autoscaler on the one-machine cluster.

Prints figures, asserts nothing. Needs a running cluster whose pods really run with their
``limits.cpu`` from the runtime's image (``conveyor cluster up``, whose nodes are kubelets
given the images built here, or ``--kubeconfig``). In a fresh namespace it runs
the operator as a local process (admin kubeconfig, deciding every ``--interval`` seconds),
applies one LLMService on the built-in model (replicas limited to ``--replica-cpu``), then:

1. capacity (the autoscaler runs, held at one replica, unless ``--autoscaler-from-step``):
   closed-loop clients against the single replica -> its saturated requests/s;
   then open-loop arrivals at 90%, 80%, ... of that until its TTFT p95 is under target ->
   the requests/s one replica carries (``--capacity slo``, the default; two replicas carry
   twice it, while twice the saturated rate puts two replicas at 100%);
2. step: open-loop arrivals at ``--step-factor`` x that rate; the time from the step to the
   first scale-up decision (spec.replicas > 1), to a new replica serving (a response from a
   second backend), and until the client-side TTFT p95 is back under target (over the last
   10 s of finished requests, and for the requests sent from then on);
3. constant load for ``--minutes``: direction changes of spec.replicas (target: none);
4. wake from zero: minReplicas 0, wait until scaled to zero, then one streamed request:
   arrival to first token, and when the operator's decision, the pod's scheduling, its
   container's start and its readiness were first seen (bench/autoscale/wake.py), with the
   runtime's own start-up line (imports, model load, KV cache);
5. replicas, queue depth per replica and TTFT p95 over time as a PNG (``--png``).

Progress goes to stderr as it runs (each phase, and every ``--progress-every`` seconds of load:
replicas, queue, client-side TTFT p95, the autoscaler's demand and capacity estimates); the
figures go to stdout as JSON at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path

from conveyor.bench.autoscale.cluster_env import Env
from conveyor.bench.autoscale.load import Progress
from conveyor.bench.autoscale.run import bench
from conveyor.bench.autoscale.settings import BenchSettings

OPTIONS: tuple[tuple[str, str, str], ...] = (
    ("--kubeconfig", "kubeconfig",
     "cluster to use; unset: the one-machine cluster running here (`conveyor cluster up`)"),
    ("--minutes", "minutes", "minutes of load after the step; direction changes are counted over it"),
    ("--step-factor", "step_factor", "step load as a multiple of one replica's measured requests/s"),
    ("--capacity", "capacity",
     "one replica's requests/s the step multiplies: 'slo', the highest open-loop rate it serves "
     "with client TTFT p95 under --target-ttft (what it carries), or 'saturated', its "
     "closed-loop throughput with a queue (a 2x step then puts two replicas at 100%%)"),
    ("--replica-cpu", "replica_cpu",
     "limits.cpu of each replica, so that a replica is a unit of capacity"),
    ("--max-replicas", "max_replicas", "maxReplicas of the benchmark's LLMService"),
    ("--target-queue", "target_queue", "targetQueueDepthPerReplica of the benchmark's LLMService"),
    ("--target-ttft", "target_ttft_s",
     "targetTTFTP95Seconds of the benchmark's LLMService (seconds)"),
    ("--interval", "interval_s", "the operator's --autoscale-interval (seconds)"),
    ("--scale-down-window", "scale_down_window_s",
     "scaleDownStabilizationSeconds of the benchmark's LLMService"),
    ("--backlog-drain", "backlog_drain_s",
     "backlogDrainSeconds of the benchmark's LLMService: seconds in which what piles up while "
     "replicas start should drain (the CRD's default is 30)"),
    ("--autoscaler-from-step", "autoscaler_from_step",
     "turn the autoscaler on only at the step; by default it runs from the start, held at one "
     "replica while that replica's capacity is measured (as a running service's autoscaler has "
     "seen its replicas busy before a step)"),
    ("--gateway-queue", "gateway_queue",
     "run the operator with --gateway-queue: its gateways hold requests in arrival order while "
     "every replica is full, and a replica that a scale-up adds takes the oldest (off by "
     "default, as in the operator)"),
    ("--max-tokens", "max_tokens", "max_tokens of each request"),
    ("--png", "png", "where to write the chart of replicas, queue and TTFT p95 over time"),
    ("--keep", "keep", "keep the namespace afterwards, for a look with kubectl"),
    ("--progress-every", "progress_every_s",
     "seconds between progress lines on stderr while load runs"),
    ("--wake-only", "wake_only",
     "skip the capacity, step and constant-load phases: measure only the wake from zero "
     "(where its seconds go: decision, scheduling, container start, runtime start-up)"),
)  # fmt: skip
"""Each option: its flag, the settings field it sets, its help text."""
CHOICES = {"capacity": ("slo", "saturated")}


def parser() -> argparse.ArgumentParser:
    """The command line; every option says what it sets and its default."""
    d = BenchSettings()
    p = argparse.ArgumentParser(
        prog="conveyor bench autoscale",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for flag, name, help_ in OPTIONS:
        default = getattr(d, name)
        if isinstance(default, bool):
            p.add_argument(flag, dest=name, action="store_true", help=help_)
        else:
            kind = Path if name == "kubeconfig" else type(default)
            metavar = flag.removeprefix("--").replace("-", "_").upper()
            p.add_argument(
                flag, dest=name, metavar=metavar, type=kind, default=default, help=help_,
                choices=CHOICES.get(name),
            )  # fmt: skip
    return p


def parse(argv: list[str]) -> BenchSettings:
    a = parser().parse_args(argv)
    return BenchSettings(**{name: getattr(a, name) for _, name, _ in OPTIONS})


def main(argv: list[str]) -> int:
    s = parse(argv)
    if s.kubeconfig is None:
        from conveyor.cluster import Cluster

        cluster = Cluster.attach()
        if cluster is None or cluster.tools is None:
            print(
                "conveyor bench autoscale: no cluster is running here. Start one with "
                "`conveyor cluster up` (after `conveyor image build`, so that its nodes hold the "
                "runtime's image), "
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
    # A SIGTERM (a timeout, a job runner) unwinds like Ctrl-C: the operator child is stopped
    # and the namespace deleted, rather than left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
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
