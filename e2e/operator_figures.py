"""Figures of the operator (printed, never asserted): reconcile latency of a spec change, and
the operator's memory at idle with 10 LLMServices. Run against a cluster with the CRD:

    KUBECONFIG=... PATH=$PATH:$(cluster/build-tools.sh --print-dir) .venv/bin/python e2e/operator_figures.py
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from operator_helpers import (
    OperatorIdentity,
    OperatorProcess,
    apply_yaml,
    install_crd,
    llmservice,
    release_llmservices,
    wait_for,
)

from conveyor.cluster.testing import KubeUnderTest


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def main() -> int:
    import argparse

    argparse.ArgumentParser(
        prog="e2e/operator_figures.py",
        description="Print the operator's figures (reconcile latency of a spec change, memory "
        "at idle with 10 LLMServices) against the cluster in $KUBECONFIG, kubectl on PATH.",
    ).parse_args()
    kubectl = subprocess.run(["which", "kubectl"], capture_output=True, text=True).stdout.strip()
    kube = KubeUnderTest(Path(os.environ["KUBECONFIG"]), kubectl, None)
    install_crd(kube)
    namespace = f"operator-figures-{uuid.uuid4().hex[:6]}"
    kube.kubectl("create", "namespace", namespace)
    workdir = Path(tempfile.mkdtemp(prefix="operator-figures-"))
    identity = OperatorIdentity(kube, namespace, workdir)
    op = OperatorProcess(identity, workdir, name="figures", extra=("--resync-interval", "60"))
    try:
        wait_for("leader", op.is_leader, timeout_s=60)
        names = [f"m{i}" for i in range(10)]
        started = time.monotonic()
        apply_yaml(kube, namespace, *(llmservice(n) for n in names))
        path = f"/apis/conveyor.dev/v1alpha1/namespaces/{namespace}/llmservices/"

        def all_reconciled() -> bool:
            return all(
                (kube.api.get(path + n).get("status") or {}).get("observedGeneration")
                for n in names
            )

        wait_for("10 reconciled", all_reconciled, timeout_s=120, interval_s=0.05)
        print(
            f"10 LLMServices applied -> all reconciled (children + status): {time.monotonic() - started:.2f} s"
        )
        latencies = []
        for i, name in enumerate(names):
            generation = kube.api.get(path + name)["metadata"]["generation"]
            t0 = time.monotonic()
            kube.kubectl("-n", namespace, "patch", "llmservice", name, "--type=merge", "-p",
                         f'{{"spec":{{"runtime":{{"maxRunningRequests":{8 + i}}}}}}}')  # fmt: skip
            wait_for("observed", lambda n=name, g=generation: (kube.api.get(path + n).get("status") or {}).get("observedGeneration", 0) > g,
                     timeout_s=60, interval_s=0.02)  # fmt: skip
            latencies.append(time.monotonic() - t0)
        print(
            "spec change -> Deployment rolled + status.observedGeneration (incl. kubectl start ~0.1 s): "
            f"median {statistics.median(latencies) * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms over {len(latencies)}"
        )
        time.sleep(15)  # a figure, not a test: let the process settle at idle before reading RSS
        print(f"operator RSS at idle with 10 LLMServices: {rss_mib(op.proc.pid):.0f} MiB")
        hist = [
            line
            for line in op._get("/metrics").splitlines()
            if line.startswith("conveyor_reconcile_duration_seconds_")
        ]
        count = next(
            float(x.split()[-1])
            for x in hist
            if x.startswith("conveyor_reconcile_duration_seconds_count")
        )
        total = next(
            float(x.split()[-1])
            for x in hist
            if x.startswith("conveyor_reconcile_duration_seconds_sum")
        )
        print(
            f"reconcile duration in the operator: mean {total / count * 1000:.0f} ms over {count:.0f} reconciles"
        )
    finally:
        release_llmservices(kube, namespace)
        op.stop()
        kube.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        identity.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
