"""Figures of the node agent, printed (never asserted): ``python e2e/agent_figures.py [PODS]``.

Against the running one-machine cluster (``conveyor cluster up``): trivial HTTP pods created
one after another, each timed from its creation call to Ready as the API reports it; then,
with all of them running, the agent's own CPU use over a quiet minute and its memory, and the
memory of the shims that keep the containers.
"""

from __future__ import annotations

import statistics
import sys
import time
import uuid
from pathlib import Path

from agent_helpers import create, pod, wait_gone, wait_ready

from conveyor.cluster import Cluster
from conveyor.cluster.agent_process import AGENT_NAME
from conveyor.cluster.testing import ECHO_SERVER


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def pss_bytes(pid: int) -> int:
    """Proportional set size: shared pages (the interpreter) counted once across processes."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0  # utime + stime, in clock ticks of 10 ms


def shim_pids(work_dir: Path) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(arg.endswith(b"/shim.py") for arg in cmdline) and any(
                str(work_dir).encode() in a for a in cmdline
            ):
                pids.append(int(proc.name))
    return pids


def main(count: int) -> None:
    cluster = Cluster.attach()
    if cluster is None or AGENT_NAME not in cluster.processes:
        sys.exit("no running cluster with a node agent: conveyor cluster up")
    api = cluster.api
    agent_pid = cluster.processes[AGENT_NAME].record.pid
    namespace = f"agent-figures-{uuid.uuid4().hex[:6]}"
    api.create(
        "/api/v1/namespaces",
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
    )
    api.wait_for(
        "the default ServiceAccount",
        lambda: api.get(f"/api/v1/namespaces/{namespace}/serviceaccounts/default"),
        timeout_s=60,
    )
    names = [f"web-{i}" for i in range(count)]
    try:
        rss_before = rss_bytes(agent_pid)
        times = []
        for name in names:
            t0 = time.monotonic()
            create(
                api,
                namespace,
                pod(
                    name,
                    ["python", "-c", ECHO_SERVER, "0.0.0.0", "8080", name],
                    ports=[{"name": "http", "containerPort": 8080}],
                    readinessProbe={"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
                    resources={"requests": {"cpu": "1m", "memory": "1Mi"}},
                ),
            )
            wait_ready(api, namespace, name)
            times.append(time.monotonic() - t0)
        print(
            f"trivial HTTP pod, creation to Ready: median {statistics.median(times):.2f} s, "
            f"first {times[0]:.2f} s, max {max(times):.2f} s ({count} pods, one after another)"
        )
        cpu_0, wall_0 = cpu_seconds(agent_pid), time.monotonic()
        time.sleep(
            60
        )  # a quiet minute with every pod running and probed (a measurement, not a wait)
        cpu = cpu_seconds(agent_pid) - cpu_0
        wall = time.monotonic() - wall_0
        shims = shim_pids(cluster.work_dir)
        print(
            f"agent CPU with {count} pods (readiness probed every second): {100 * cpu / wall:.1f}% of a core"
        )
        print(
            f"agent memory: {rss_bytes(agent_pid) / 2**20:.0f} MiB RSS ({rss_before / 2**20:.0f} MiB before the pods)"
        )
        print(
            f"shims: {len(shims)}, {sum(pss_bytes(p) for p in shims) / 2**20:.0f} MiB PSS together "
            f"({sum(rss_bytes(p) for p in shims) / 2**20:.0f} MiB RSS, the shared interpreter counted in each)"
        )
    finally:
        t0 = time.monotonic()
        for name in names:
            api.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}")
        for name in names:
            wait_gone(api, namespace, name)
        print(
            f"{count} pods deleted (preStop-less, SIGTERM) and gone in {time.monotonic() - t0:.1f} s"
        )
        api.delete(f"/api/v1/namespaces/{namespace}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
