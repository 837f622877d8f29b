"""Probes and lifecycle handlers (``httpGet``, ``tcpSocket``, ``exec``) against a pod's own address.

``httpGet`` and ``tcpSocket`` connect from the host to the pod's IP over the bridge;
``exec`` runs the command inside the container (its namespaces, root and user) with
``nsenter``. Each call returns (success, message) and never raises.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ExecTarget:
    """Where an ``exec`` handler runs: the container's process, user and environment."""

    pid: int
    uid: int | None
    gid: int | None
    env: Mapping[str, str]


def resolve_port(port: int | str, container: Mapping[str, Any]) -> int:
    """A probe's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"container {container['name']!r} has no port named {port!r}")


async def http_get(
    spec: Mapping[str, Any], host: str, port: int, timeout_s: float
) -> tuple[bool, str]:
    """GET the path; 200-399 is success."""
    path = spec.get("path") or "/"
    headers = {h["name"]: h["value"] for h in spec.get("httpHeaders") or []}
    headers.setdefault("Host", f"{host}:{port}")
    headers.setdefault("User-Agent", "kube-probe/conveyor")
    headers.setdefault("Accept", "*/*")
    headers["Connection"] = "close"
    request = (
        f"GET {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    )
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(request.encode())
            await writer.drain()
            status_line = await reader.readline()
        parts = status_line.decode(errors="replace").split()
        if len(parts) < 2 or not parts[1].isdigit():
            return False, f"HTTP probe failed: bad status line {status_line!r}"
        code = int(parts[1])
        if 200 <= code < 400:
            return True, ""
        return False, f"HTTP probe failed with statuscode: {code}"
    except TimeoutError:
        return False, f'Get "http://{host}:{port}{path}": context deadline exceeded'
    except OSError as exc:
        return False, f'Get "http://{host}:{port}{path}": {exc.strerror or exc}'
    finally:
        if writer is not None:
            writer.close()


async def tcp_socket(host: str, port: int, timeout_s: float) -> tuple[bool, str]:
    """Connect; an accepted connection is success."""
    try:
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(host, port)
        writer.close()
        return True, ""
    except TimeoutError:
        return False, f"dial tcp {host}:{port}: i/o timeout"
    except OSError as exc:
        return False, f"dial tcp {host}:{port}: {exc.strerror or exc}"


def exec_argv(target: ExecTarget, command: list[str]) -> list[str]:
    """``command`` run inside the container: its mount and network namespaces, root, directory, user."""
    argv = ["nsenter", f"--target={target.pid}", "--mount", "--net", "--root", "--wd"]
    if target.gid is not None:
        argv.append(f"--setgid={target.gid}")
    if target.uid is not None:
        argv.append(f"--setuid={target.uid}")
    env = [f"{k}={v}" for k, v in target.env.items()]
    return [*argv, "--", "/usr/bin/env", "-i", *env, *command]


async def exec_command(
    command: list[str], target: ExecTarget, timeout_s: float
) -> tuple[bool, str]:
    """Run the command in the container; exit status 0 is success."""
    proc = await asyncio.create_subprocess_exec(
        *exec_argv(target, command),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        async with asyncio.timeout(timeout_s):
            out, _ = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return False, f"command {command!r} timed out after {timeout_s:g}s"
    if proc.returncode == 0:
        return True, ""
    text = out.decode(errors="replace").strip()[-300:]
    return False, f"command {command!r} exited with {proc.returncode}: {text}"


async def run_handler(
    handler: Mapping[str, Any],
    *,
    pod_ip: str,
    container: Mapping[str, Any],
    target: ExecTarget | None,
    timeout_s: float,
) -> tuple[bool, str]:
    """One probe or lifecycle handler."""
    if "httpGet" in handler or "tcpSocket" in handler:
        spec = handler["httpGet"] if "httpGet" in handler else handler["tcpSocket"]
        try:
            port = resolve_port(spec["port"], container)
        except ValueError as exc:
            return False, str(exc)
        host = spec.get("host") or pod_ip
        if "httpGet" in handler:
            return await http_get(spec, host, port, timeout_s)
        return await tcp_socket(host, port, timeout_s)
    if "exec" in handler:
        if target is None:
            return False, "the container is not running"
        return await exec_command(list(handler["exec"]["command"]), target, timeout_s)
    if "sleep" in handler:
        await asyncio.sleep(min(float(handler["sleep"]["seconds"]), timeout_s))
        return True, ""
    return False, f"unsupported handler {sorted(handler)}"


@dataclass
class ProbeSpec:
    """A probe with the API's defaults filled in."""

    handler: dict[str, Any]
    initial_delay_s: float
    period_s: float
    timeout_s: float
    success_threshold: int
    failure_threshold: int

    @classmethod
    def of(cls, probe: Mapping[str, Any] | None) -> ProbeSpec | None:
        if not probe:
            return None
        return cls(
            handler={
                k: v for k, v in probe.items() if k in ("httpGet", "tcpSocket", "exec", "grpc")
            },
            initial_delay_s=float(probe.get("initialDelaySeconds", 0)),
            period_s=float(probe.get("periodSeconds", 10)),
            timeout_s=float(probe.get("timeoutSeconds", 1)),
            success_threshold=int(probe.get("successThreshold", 1)),
            failure_threshold=int(probe.get("failureThreshold", 3)),
        )
