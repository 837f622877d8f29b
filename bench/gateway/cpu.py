"""The proxy's CPU per request on the routing workload's requests, without a model: where the
routing part's "proxy CPU ms/req" comes from, measured in seconds rather than minutes and
with little noise from other work on the machine (CPU time, not latency).

    python -m conveyor.bench.gateway.cpu [--requests 1600] [--peers sglang-router] [--profile out.txt]

Four stub replicas answer as Conveyor replicas do (``stub.py --replica-like``: the load in
each response's ``x-conveyor-load``, a chat stream's role-only opening chunk, a usage chunk
when asked); the gateway (prefix-aware) and each peer front them. ``--users`` clients send
the routing workload's chats (a shared system prompt, a private document, a growing
conversation: ``workload.py``), each one request at a time, streamed (with the usage
event, as the routing part asks) and then non-streamed. Per proxy and kind, the proxy's
user and system CPU seconds over the requests, from ``/proc/PID/stat``, per request; the
proxies take turns in ``--rounds`` (order rotated), and the table shows the median over
rounds. ``--profile FILE`` has py-spy sample the gateway through its first round (py-spy's
collapsed stacks, as ``profile.py`` writes them). Figures and profiles:
docs/profiles/gateway-cpu.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import aiohttp

from conveyor.bench.gateway import processes, routers
from conveyor.bench.gateway.overhead import HEADERS
from conveyor.bench.gateway.rounds import cpu_seconds, load_average, rotated
from conveyor.bench.gateway.settings import BenchSettings
from conveyor.bench.gateway.table import table
from conveyor.bench.gateway.workload import words
from conveyor.bench.procs import ChildProcess, start_all

KINDS = ("streamed", "non-streamed")


def chat_bodies(s: BenchSettings, stream: bool) -> list[bytes]:
    """Every request of the routing workload (``s.users`` conversations of ``s.turns`` turns),
    user after user, as bodies for the stub's model."""
    rng = random.Random(f"{s.seed}-cpu")
    system = "You are a helpful assistant. " + words(rng, s.system_chars)
    bodies = []
    for user in range(s.users):
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"[user {user}] " + words(rng, s.document_chars)},
        ]
        for turn in range(s.turns):
            doc: dict[str, object] = {"model": "stub", "messages": messages,
                                      "max_tokens": s.max_tokens, "temperature": 0.0}  # fmt: skip
            if stream:
                doc |= {"stream": True, "stream_options": {"include_usage": True}}
            bodies.append(json.dumps(doc).encode())
            messages = [
                *messages,
                {"role": "assistant", "content": f"answer {turn}: " + words(rng, s.turn_chars)},
                {"role": "user", "content": f"question {turn + 1}: " + words(rng, s.turn_chars)},
            ]
    return bodies


async def send_all(url: str, bodies: list[bytes], users: int) -> int:
    """``bodies`` through ``url`` by ``users`` clients, each one request at a time; every
    response read to its end. Returns the requests that did not answer 200."""
    failed = 0
    queue = iter(bodies)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=120)
    ) as session:

        async def client() -> None:
            nonlocal failed
            for body in queue:
                async with session.post(
                    url + "/v1/chat/completions", data=body, headers=HEADERS
                ) as response:
                    async for _ in response.content.iter_any():
                        pass
                    failed += response.status != 200

        await asyncio.gather(*(client() for _ in range(users)))
    return failed


def cpu_per_request(proxy: ChildProcess, bodies: list[bytes], users: int) -> float:
    """The proxy's CPU milliseconds per request over ``bodies``."""
    before = cpu_seconds(proxy.pid)
    failed = asyncio.run(send_all(proxy.url, bodies, users))
    if failed:
        raise RuntimeError(f"{failed} of {len(bodies)} requests through {proxy.name} failed; "
                           f"its log: {proxy.log_path}")  # fmt: skip
    return 1000 * (cpu_seconds(proxy.pid) - before) / len(bodies)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conveyor.bench.gateway.cpu",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("--requests", type=int, default=1600,
                        help="requests per proxy, kind and round (default 1600)")  # fmt: skip
    parser.add_argument("--users", type=int, default=32, help="concurrent clients (default 32)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--token-interval-ms", type=float, default=25.0,
                        help="the stubs' pause between a stream's chunks, as a replica's decode "
                        "step sends each token apart (default 25)")  # fmt: skip
    parser.add_argument("--peers", default="", help="Rust routers beside the gateway, "
                        "comma-separated: vllm-router, sglang-router")  # fmt: skip
    parser.add_argument("--profile", default="",
                        help="py-spy collapsed stacks of the gateway's first round to this file")  # fmt: skip
    parser.add_argument("--gateway-arg", action="append", default=[],
                        help="extra argument for the gateway (repeatable)")  # fmt: skip
    parser.add_argument("--baseline", default="",
                        help="a folder holding another version's conveyor package (as "
                        "installed: gateway/ inside conveyor/), whose gateway runs beside this "
                        "one as conveyor-baseline: a change measured side by side")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        peers = routers.parse_peers(args.peers)
        installed = [(r, routers.ensure(r, lambda m: print(f"[peers] {m}", flush=True)))
                     for r in peers]  # fmt: skip
    except (ValueError, routers.RouterInstallError) as exc:
        print(f"conveyor bench gateway cpu: {exc}", file=sys.stderr)
        return 2
    s = BenchSettings()
    workload = {k: chat_bodies(s, k == "streamed") for k in KINDS}
    bodies = {k: (b * (args.requests // len(b) + 1))[: args.requests] for k, b in workload.items()}
    stubs = [processes.stub("--replica-like", "true", "--tokens", str(s.max_tokens),
                            "--token-interval-ms", str(args.token_interval_ms))
             for _ in range(s.replicas)]  # fmt: skip
    try:
        start_all(stubs)
        urls = [stub.url for stub in stubs]
        gateway = processes.gateway(urls, "--routing", "prefix-aware", *args.gateway_arg)
        proxies = [("conveyor", gateway)]
        if args.baseline:
            env: dict[str, str | None] = {"PYTHONPATH": str(Path(args.baseline).resolve())}
            proxies.append(("conveyor-baseline", processes.gateway(
                urls, "--routing", "prefix-aware", *args.gateway_arg, env=env)))  # fmt: skip
        proxies += [
            (r.name, processes.rust_router(r, venv, urls, "cache_aware")) for r, venv in installed
        ]
        start_all([child for _, child in proxies])
        try:
            for name, child in proxies:
                if name.startswith("conveyor"):
                    processes.wait_admitted(child, len(urls))
            figures = _rounds(proxies, bodies, args, gateway.pid)
        finally:
            for _, child in proxies:
                child.stop()
    finally:
        for stub in stubs:
            stub.stop()
    rows = [
        [name, *(f"{statistics.median(figures[name][k]):.2f}" for k in KINDS),
         *(" ".join(f"{v:.2f}" for v in figures[name][k]) for k in KINDS)]
        for name, _ in proxies
    ]  # fmt: skip
    print(f"\nproxy CPU ms/req (user + system), median over {args.rounds} rounds of "
          f"{args.requests} requests per kind, {args.users} clients, {s.replicas} stub replicas, "
          f"{s.max_tokens} tokens each, {args.token_interval_ms:g} ms apart when streamed:")  # fmt: skip
    print(table(["proxy", *KINDS, *(f"{k} per round" for k in KINDS)], rows))
    peer_names = [n for n, _ in proxies if not n.startswith("conveyor")]
    if peer_names:
        for k in KINDS:
            best = min(statistics.median(figures[n][k]) for n in peer_names)
            mine = statistics.median(figures["conveyor"][k])
            print(f"  conveyor / best peer, {k}: {mine / best:.2f}x")
    if args.baseline:
        for k in KINDS:
            mine, base = (
                statistics.median(figures[n][k]) for n in ("conveyor", "conveyor-baseline")
            )
            print(f"  conveyor / conveyor-baseline, {k}: {mine / base:.2f}x")
    return 0


def _rounds(
    proxies: list[tuple[str, ChildProcess]],
    bodies: dict[str, list[bytes]],
    args: argparse.Namespace,
    gateway_pid: int,
) -> dict[str, dict[str, list[float]]]:
    figures: dict[str, dict[str, list[float]]] = {
        name: {k: [] for k in KINDS} for name, _ in proxies
    }
    for _, child in proxies:  # warm up: connections, caches
        cpu_per_request(child, bodies["streamed"][:200], args.users)
    for r in range(args.rounds):
        stop_profile: Callable[[], None] = lambda: None  # noqa: E731
        if args.profile and r == 0:
            stop_profile = _start_profile(gateway_pid, args.profile)
        for name, child in rotated(proxies, r):
            for k in KINDS:
                figures[name][k].append(cpu_per_request(child, bodies[k], args.users))
        stop_profile()
        print(f"round {r + 1}: load average {load_average():.1f}, "
              + ", ".join(f"{n} {figures[n]['streamed'][-1]:.2f}/{figures[n]['non-streamed'][-1]:.2f}"
                          for n, _ in proxies), flush=True)  # fmt: skip
    return figures


def _start_profile(pid: int, out: str) -> Callable[[], None]:
    from conveyor.bench.gateway.profile import py_spy, summarize

    record = subprocess.Popen(
        [py_spy(), "record", "--pid", str(pid), "--rate", "250", "--format", "raw",
         "--output", out, "--nonblocking"],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip

    def stop() -> None:
        record.send_signal(2)  # py-spy writes what it sampled on SIGINT
        record.wait(60)
        print(f"gateway profile: {out}")
        print(summarize(Path(out).read_text()))

    return stop


if __name__ == "__main__":
    sys.exit(main())
