"""Where the gateway's CPU goes on the proxy path: py-spy samples the gateway process while
N streams (a chunk every 250 ms each) flow through it from the stub replica, and one client
sends probes (non-streamed and streamed, 16 tokens) one after another, as the bench does.

    python -m conveyor.bench.gateway.profile --streams 200 --seconds 15 --out prof-200.txt

With ``--routing``, the gateway (prefix-aware) fronts runtime replicas instead and py-spy
samples it through the routing part's shared-prefix chat workload (``workload.py``, the
bench's defaults): where the gateway's CPU goes when it routes and streams real chats.

    python -m conveyor.bench.gateway.profile --routing --out prof-routing.txt

Writes py-spy's collapsed stacks (``--format raw``) to ``--out`` and prints the functions
with the most samples: on their own (self) and with what they call (total). py-spy comes
with the project's dev extras; it needs to be allowed to ptrace the gateway (root, or
``kernel.yama.ptrace_scope`` 0).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from conveyor.bench.gateway import processes
from conveyor.bench.gateway.overhead import HEADERS, _body
from conveyor.bench.gateway.settings import BenchSettings
from conveyor.bench.gateway.workload import run_workload
from conveyor.bench.procs import start_all


def summarize(collapsed: str, top: int = 15) -> str:
    """The ``top`` frames by self and by total samples in py-spy's collapsed stacks."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    samples = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        samples += n
        frames = stack.split(";")
        own[frames[-1]] += n
        for frame in set(frames):
            total[frame] += n
    if not samples:
        return "no samples"
    out = [f"{samples} samples", "", "self %   frame"]
    out += [f"{100 * n / samples:5.1f}   {frame}" for frame, n in own.most_common(top)]
    out += ["", "total %  frame"]
    out += [f"{100 * n / samples:5.1f}   {frame}" for frame, n in total.most_common(top)]
    return "\n".join(out)


def py_spy() -> str:
    """py-spy's executable: on PATH, or beside this interpreter (the dev extras install it)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        raise FileNotFoundError("py-spy not found: pip install -e '.[dev]'")
    return spy


async def _load(url: str, streams: int, seconds: float, ramped: Callable[[], None]) -> None:
    """``streams`` paced streams opened over 2 s, then ``ramped()``, then probes one at a time
    for ``seconds`` more."""
    import aiohttp

    body = _body("pace 250", 100000, True)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(i: int) -> None:
            await asyncio.sleep(2.0 * i / streams)  # ramp: pacing the load generator
            async with session.post(url + "/v1/completions", data=body, headers=HEADERS) as r:
                async for _ in r.content.iter_any():
                    pass

        tasks = [asyncio.create_task(one(i)) for i in range(streams)]
        await asyncio.sleep(3.0)  # the ramp, and a second to settle
        ramped()
        whole, stream = _body("x", 16, False), _body("x", 16, True)
        deadline = asyncio.get_running_loop().time() + seconds + 1
        probes = 0
        while asyncio.get_running_loop().time() < deadline:  # one probe at a time, as the bench
            for data in (whole, stream):
                async with session.post(url + "/v1/completions", data=data, headers=HEADERS) as r:
                    await r.read()
            probes += 2
        print(f"{probes} probes ({probes / (seconds + 1):.0f}/s) beside the streams")
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conveyor.bench.gateway.profile",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("--streams", type=int, default=200, help="streams held open (default 200)")
    parser.add_argument("--seconds", type=float, default=15.0,
                        help="seconds of sampling, after the streams opened (default 15)")  # fmt: skip
    parser.add_argument("--out", default="gateway-profile.txt",
                        help="py-spy collapsed stacks (default gateway-profile.txt)")  # fmt: skip
    parser.add_argument("--gateway-arg", action="append", default=[],
                        help="extra argument for the gateway (repeatable)")  # fmt: skip
    parser.add_argument("--routing", action="store_true",
                        help="front runtime replicas with the routing workload instead of the "
                        "stub with held streams (--streams and --seconds do not apply)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        spy = py_spy()
    except FileNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 1
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if args.routing:
        return profile_routing(spy, args.out, args.gateway_arg)
    with (
        processes.stub() as stub,
        processes.gateway([stub.url], "--connect-timeout", "10", *args.gateway_arg) as gateway,
    ):
        processes.wait_admitted(gateway, 1)
        record: list[subprocess.Popen[bytes]] = []
        command = (
            [spy, "record", "--pid", str(gateway.pid), "--subprocesses", "--rate", "250",
             "--duration", str(int(args.seconds)), "--format", "raw", "--output", args.out,
             "--nonblocking"]
        )  # fmt: skip

        def start_recording() -> None:
            record.append(subprocess.Popen(command, stdout=subprocess.DEVNULL))

        asyncio.run(_load(gateway.url, args.streams, args.seconds, start_recording))
        record[0].wait(60)
    print(f"gateway, {args.streams} streams, {args.seconds:g} s: {args.out}")
    print(summarize(Path(args.out).read_text()))
    return 0


def profile_routing(spy: str, out: str, gateway_args: list[str]) -> int:
    """py-spy on the gateway through one pass of the routing workload over runtime replicas."""
    s = BenchSettings()
    replicas = [processes.replica(s) for _ in range(s.replicas)]
    try:
        start_all(replicas)
        urls = [r.url for r in replicas]
        with processes.gateway(urls, "--routing", "prefix-aware", *gateway_args) as gateway:
            processes.wait_admitted(gateway, len(urls))
            command = [spy, "record", "--pid", str(gateway.pid), "--rate", "250", "--format",
                       "raw", "--output", out, "--nonblocking"]  # fmt: skip
            with subprocess.Popen(command, stdout=subprocess.DEVNULL) as record:
                turns, wall = asyncio.run(run_workload(gateway.url, s, salt="profile"))
                record.send_signal(2)  # py-spy writes what it sampled on SIGINT
                record.wait(60)
    finally:
        for replica in replicas:
            replica.stop()
    print(f"gateway, routing workload ({len(turns)} requests in {wall:.1f} s): {out}")
    print(summarize(Path(out).read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
