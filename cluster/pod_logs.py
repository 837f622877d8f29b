"""A pod's container output, read straight from the node agent's files.

The shim writes each container's output in the CRI log format (``<time> <stream> <F|P>
<text>``) to ``agent/pods/<uid>/logs/<container>/current.log`` in the cluster's work
directory; kwok serves those files to ``kubectl logs``. These functions read them without
kwok or the apiserver, for when neither answers.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path


def pod_log_files(work_dir: Path, namespace: str, name: str) -> dict[str, Path]:
    """Container name -> current log file of the pod ``namespace/name`` in the agent's files."""
    out: dict[str, Path] = {}
    pods = work_dir / "agent" / "pods"
    for meta_file in pods.glob("*/pod.json"):
        meta = json.loads(meta_file.read_text())
        if meta["namespace"] == namespace and meta["name"] == name:
            for log in sorted((meta_file.parent / "logs").glob("*/current.log")):
                out[log.parent.name] = log
    return out


def cri_lines_to_text(text: str) -> str:
    """The output in a CRI log file (``<time> <stream> <F|P> <text>``) as the process wrote it."""
    out = []
    for line in text.splitlines():
        parts = line.split(" ", 3)
        if len(parts) < 3:
            continue
        body = parts[3] if len(parts) == 4 else ""
        out.append(body + ("\n" if parts[2] == "F" else ""))
    return "".join(out)


def print_pod_logs(work_dir: Path, namespace: str, name: str) -> int:
    """Print each container's output, as `kubectl logs` would; 1 when the pod is not here."""
    logs = pod_log_files(work_dir, namespace, name)
    if not logs:
        print(f"no pod {namespace}/{name} runs on this cluster's node agent", file=sys.stderr)
        return 1
    for container, path in logs.items():
        if len(logs) > 1:
            print(f"==> {container} <==")
        with contextlib.suppress(FileNotFoundError):
            sys.stdout.write(cri_lines_to_text(path.read_text(errors="replace")))
    return 0
