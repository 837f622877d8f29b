"""Pure functions over a pod's spec: images, quantities, environment, files, phase and conditions.

Nothing here touches the host or the API; the node agent calls these with what it fetched.
"""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from conveyor.cluster.dns import DOMAIN

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""The PATH of an image that sets none (Docker's default)."""


class ConfigError(RuntimeError):
    """The pod's spec cannot be run yet or at all (a missing Secret, an unknown image, ...)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def now_rfc3339(ts: float | None = None) -> str:
    """A timestamp as the API writes them (seconds)."""
    moment = datetime.fromtimestamp(ts, UTC) if ts is not None else datetime.now(UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def image_name(image: str) -> str:
    """``registry/ns/name:tag@digest`` -> ``name``."""
    image = image.split("@", 1)[0]
    last = image.rsplit("/", 1)[-1]
    return last.split(":", 1)[0]


def image_path(image: str, images: Mapping[str, tuple[str, ...]]) -> str:
    """The PATH a container of ``image`` runs with, or ``ConfigError`` (ErrImagePull) when unknown."""
    dirs = images.get(image_name(image))
    if dirs is None:
        raise ConfigError(
            "ErrImagePull",
            f'image "{image}" is not one this node agent can run: it maps images '
            f"{sorted(images)} to local environments (AgentSettings.images)",
        )
    return ":".join([*dirs, DEFAULT_PATH])


_SUFFIXES = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
    "n": 1e-9,
    "u": 1e-6,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "E": 1e18,
}


def quantity(value: str | int | float) -> float:
    """A Kubernetes quantity (``500m``, ``64Mi``, ``1e3``, ``2``) as a number."""
    if isinstance(value, int | float):
        return float(value)
    text = str(value).strip()
    match = re.fullmatch(r"([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)", text)
    if not match or (match.group(2) and match.group(2) not in _SUFFIXES):
        raise ValueError(f"not a quantity: {value!r}")
    number, suffix = match.groups()
    return float(number) * (_SUFFIXES[suffix] if suffix else 1)


@dataclass(frozen=True)
class Limits:
    """A container's enforced limits."""

    cpu_cores: float | None
    memory_bytes: int | None


def container_limits(container: Mapping[str, Any]) -> Limits:
    """``resources.limits`` of a container (cpu in cores, memory in bytes)."""
    limits = (container.get("resources") or {}).get("limits") or {}
    cpu = quantity(limits["cpu"]) if "cpu" in limits else None
    memory = int(quantity(limits["memory"])) if "memory" in limits else None
    return Limits(cpu, memory)


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: known names replaced, ``$$`` -> ``$``, others left as written."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR.sub(sub, text)


def field_value(pod: Mapping[str, Any], path: str, *, pod_ip: str, host_ip: str) -> str:
    """The value of a ``fieldRef.fieldPath`` of the downward API."""
    meta = pod["metadata"]
    spec = pod["spec"]
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
    }
    if path in simple:
        return simple[path]
    match = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if match:
        return (meta.get(match.group(1)) or {}).get(match.group(2), "")
    if path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(path.split(".")[1]) or {}
        return "\n".join(f'{k}="{v}"' for k, v in sorted(items.items()))
    raise ConfigError("CreateContainerConfigError", f"unsupported fieldRef {path!r}")


def resource_value(container: Mapping[str, Any], ref: Mapping[str, Any]) -> str:
    """The value of a ``resourceFieldRef`` (limits/requests of cpu or memory, with its divisor)."""
    kind, _, name = ref["resource"].partition(".")
    resources = (container.get("resources") or {}).get(kind) or {}
    divisor = quantity(ref.get("divisor", "1"))
    if name not in resources:
        return "0"
    return str(math.ceil(quantity(resources[name]) / divisor))


def decode_data(obj: Mapping[str, Any], *, secret: bool) -> dict[str, bytes]:
    """The data of a Secret (base64) or ConfigMap (text plus base64 ``binaryData``) as bytes."""
    out: dict[str, bytes] = {}
    for k, v in (obj.get("data") or {}).items():
        out[k] = base64.b64decode(v) if secret else v.encode()
    for k, v in (obj.get("binaryData") or {}).items():
        out[k] = base64.b64decode(v)
    return out


def kubernetes_env(host: str, port: int) -> dict[str, str]:
    """The variables a kubelet sets so that pods find the apiserver (the ``kubernetes`` Service)."""
    return {
        "KUBERNETES_SERVICE_HOST": host,
        "KUBERNETES_SERVICE_PORT": str(port),
        "KUBERNETES_SERVICE_PORT_HTTPS": str(port),
        "KUBERNETES_PORT": f"tcp://{host}:{port}",
        "KUBERNETES_PORT_443_TCP": f"tcp://{host}:{port}",
        "KUBERNETES_PORT_443_TCP_PROTO": "tcp",
        "KUBERNETES_PORT_443_TCP_PORT": str(port),
        "KUBERNETES_PORT_443_TCP_ADDR": host,
    }


def service_env(services: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Docker-link style variables for the namespace's Services (``enableServiceLinks``)."""
    env: dict[str, str] = {}
    for svc in services:
        ip = svc["spec"].get("clusterIP")
        if not ip or ip == "None":
            continue
        name = svc["metadata"]["name"].upper().replace("-", "_")
        ports = svc["spec"].get("ports") or []
        env[f"{name}_SERVICE_HOST"] = ip
        if ports:
            env[f"{name}_SERVICE_PORT"] = str(ports[0]["port"])
            env[f"{name}_PORT"] = (
                f"{ports[0].get('protocol', 'TCP').lower()}://{ip}:{ports[0]['port']}"
            )
        for p in ports:
            proto = p.get("protocol", "TCP")
            base = f"{name}_PORT_{p['port']}_{proto}"
            env[base] = f"{proto.lower()}://{ip}:{p['port']}"
            env[f"{base}_PROTO"] = proto.lower()
            env[f"{base}_PORT"] = str(p["port"])
            env[f"{base}_ADDR"] = ip
            if p.get("name"):
                env[f"{name}_SERVICE_PORT_{p['name'].upper().replace('-', '_')}"] = str(p["port"])
    return env


def hosts_file(pod: Mapping[str, Any], pod_ip: str) -> str:
    """The pod's ``/etc/hosts``, as a kubelet writes it (other names come from the cluster's DNS)."""
    spec = pod["spec"]
    hostname = spec.get("hostname") or pod["metadata"]["name"]
    names = hostname
    if sub := spec.get("subdomain"):
        ns = pod["metadata"]["namespace"]
        names = f"{hostname}.{sub}.{ns}.svc.{DOMAIN}\t{hostname}"
    lines = [
        "# Kubernetes-managed hosts file (written by the conveyor node agent).",
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
        "fe00::0\tip6-localnet",
        "fe00::0\tip6-mcastprefix",
        "fe00::1\tip6-allnodes",
        "fe00::2\tip6-allrouters",
        f"{pod_ip}\t{names}",
    ]
    for alias in spec.get("hostAliases") or []:
        lines.append(
            f"# Entries added by HostAliases.\n{alias['ip']}\t{' '.join(alias['hostnames'])}"
        )
    return "\n".join(lines) + "\n"


def resolv_conf(pod: Mapping[str, Any], cluster_dns: str) -> str:
    """The pod's ``/etc/resolv.conf``, as a kubelet whose ``clusterDNS`` is ``cluster_dns`` writes it.

    ``dnsPolicy`` ``ClusterFirst`` (the default): the cluster's DNS and search path, then
    ``dnsConfig``'s; ``None``: ``dnsConfig`` alone; ``Default``: the node's resolver, which here
    is none (as the real nodes' kubelets, whose ``resolvConf`` is empty), so the name server
    is the pod's own loopback, where nothing listens, and a lookup fails at once.
    """
    spec = pod["spec"]
    policy = spec.get("dnsPolicy") or "ClusterFirst"
    dns = spec.get("dnsConfig") or {}
    servers: list[str] = []
    searches: list[str] = []
    options: list[str] = []
    if policy in ("ClusterFirst", "ClusterFirstWithHostNet"):
        ns = pod["metadata"]["namespace"]
        servers = [cluster_dns]
        searches = [f"{ns}.svc.{DOMAIN}", f"svc.{DOMAIN}", DOMAIN]
        options = ["ndots:5"]
    elif policy == "Default":
        servers = ["127.0.0.1"]
    servers += dns.get("nameservers") or []
    searches += dns.get("searches") or []
    merged = {name: value for name, _, value in (o.partition(":") for o in options)}
    merged |= {o["name"]: o.get("value") or "" for o in dns.get("options") or []}  # later wins
    options = [f"{name}:{value}" if value else name for name, value in merged.items()]
    lines = ["# Written by the conveyor node agent, as a kubelet would."]
    if searches:
        lines.append(f"search {' '.join(searches)}")
    lines += [f"nameserver {server}" for server in servers]
    if options:
        lines.append(f"options {' '.join(options)}")
    return "\n".join(lines) + "\n"


def effective_user(
    pod: Mapping[str, Any], container: Mapping[str, Any]
) -> tuple[int | None, int | None, list[int]]:
    """(uid, gid, supplemental groups) from the pod's and container's securityContext.

    ``ConfigError`` when ``runAsNonRoot`` is asked for and the user would be root (as a kubelet
    refuses it: the image's user is root here, the host's environment).
    """
    pod_sc = pod["spec"].get("securityContext") or {}
    sc = container.get("securityContext") or {}
    uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
    gid = sc.get("runAsGroup", pod_sc.get("runAsGroup"))
    non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
    if non_root and (uid is None or uid == 0):
        raise ConfigError(
            "CreateContainerConfigError",
            "container has runAsNonRoot and image will run as root "
            f"(pod: {pod['metadata']['name']!r}, container: {container['name']}): set runAsUser",
        )
    groups = list(pod_sc.get("supplementalGroups") or [])
    if (fs := pod_sc.get("fsGroup")) is not None:
        groups.append(fs)
    if uid is not None and gid is None:
        gid = uid if uid != 0 else 0
    return uid, gid, groups


def pod_phase(restart_policy: str, states: list[dict[str, Any]], ever_started: bool) -> str:
    """The pod's phase from its containers' states (the kubelet's rules, init containers aside)."""
    if not ever_started:
        return "Pending"
    running = any("running" in s for s in states)
    if running:
        return "Running"
    terminated = [s["terminated"] for s in states if "terminated" in s]
    if len(terminated) < len(states):
        return "Running"  # waiting to be restarted
    failed = any(t.get("exitCode", 0) != 0 for t in terminated)
    if restart_policy == "Never":
        return "Failed" if failed else "Succeeded"
    if restart_policy == "OnFailure":
        return "Running" if failed else "Succeeded"
    return "Running"


def conditions(
    previous: list[dict[str, Any]], values: dict[str, tuple[bool, str | None]]
) -> list[dict[str, Any]]:
    """Pod conditions with ``lastTransitionTime`` kept when a condition's status does not change."""
    before = {c["type"]: c for c in previous}
    out = []
    for kind, (ok, reason) in values.items():
        status = "True" if ok else "False"
        old = before.get(kind)
        entry: dict[str, Any] = {
            "type": kind,
            "status": status,
            "lastProbeTime": None,
            "lastTransitionTime": old["lastTransitionTime"]
            if old and old.get("status") == status and old.get("lastTransitionTime")
            else now_rfc3339(),
        }
        if reason and not ok:
            entry["reason"] = reason
        out.append(entry)
    return out
