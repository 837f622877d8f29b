"""The Prometheus that ``conveyor up`` runs beside the local cluster, found again and stopped.

Its pid and URL are kept in the stack's state file (``stack.json`` in the cluster's work
directory), so a second ``conveyor up`` reuses it and ``conveyor down`` (another process)
stops it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any


def running_prometheus(state_file: Path) -> str | None:
    """The URL of the stack's Prometheus while it runs, else ``None``."""
    state = _read(state_file)
    pid = state.get("prometheus_pid")
    return state.get("prometheus") if pid and _alive(pid) else None


def start_prometheus(
    state_file: Path, *, binary: Path, kubeconfig: Path | None, work_dir: Path, port: int
) -> str:
    """Start Prometheus on ``port`` (a free one if that is taken), discovering pods through the
    apiserver; record it in ``state_file`` and return its URL."""
    from conveyor.observability.prometheus import Prometheus, PrometheusSettings

    prom = Prometheus(
        PrometheusSettings(
            binary=binary,
            port=port if _port_free(port) else 0,
            kubeconfig=kubeconfig,
            work_dir=work_dir,
            scrape_interval_s=5,
            evaluation_interval_s=5,
        )
    ).start()
    state = _read(state_file)
    state_file.write_text(
        json.dumps({**state, "prometheus_pid": prom.pid, "prometheus": prom.url}, indent=2)
    )
    return prom.url


def stop_prometheus(state_file: Path) -> None:
    """Stop the stack's Prometheus (SIGTERM, SIGKILL after 30 s) and remove the state file."""
    if not state_file.exists():
        return
    pid = _read(state_file).get("prometheus_pid")
    if pid and _alive(pid):
        os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(pid):
            os.killpg(pid, signal.SIGKILL)
    state_file.unlink(missing_ok=True)


def _read(state_file: Path) -> dict[str, Any]:
    state: dict[str, Any] = json.loads(state_file.read_text()) if state_file.exists() else {}
    return state


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie or a reused pid of another program does not count.
    try:
        return "prometheus" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
    except OSError:
        return False


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
