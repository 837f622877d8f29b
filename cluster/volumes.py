"""A pod's volumes on the host, under the pod's directory: made before its containers start.

``emptyDir`` is a directory (``medium: Memory`` a tmpfs of ``sizeLimit``), ``configMap``,
``secret``, ``downwardAPI`` and ``projected`` are directories of files written atomically,
the ServiceAccount token among them renewed before it expires; ``hostPath`` is the host's
path itself. The shim binds each at its ``mountPath`` in the container's mount namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from conveyor.cluster.agent_api import AsyncApi
from conveyor.cluster.api import ApiError
from conveyor.cluster.podspec import ConfigError, decode_data, field_value, quantity, resource_value

CONFIG = "CreateContainerConfigError"


def write_atomic(path: Path, data: bytes, mode: int, gid: int | None) -> None:
    """Write a file so that a reader sees the old or the new content, never half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.chmod(tmp, mode)
    if gid is not None:
        os.chown(tmp, 0, gid)
    os.replace(tmp, path)


def memory_volume_size(volume: Mapping[str, Any], pod: Mapping[str, Any]) -> int:
    """Bytes of a ``medium: Memory`` emptyDir: its sizeLimit, else the pod's memory limits, else 64 MiB."""
    if limit := volume["emptyDir"].get("sizeLimit"):
        return int(quantity(limit))
    total = 0
    for c in pod["spec"]["containers"]:
        mem = ((c.get("resources") or {}).get("limits") or {}).get("memory")
        if mem is None:
            return 64 * 2**20
        total += int(quantity(mem))
    return total or 64 * 2**20


class PodVolumes:
    """The volumes of one pod: ``prepare`` makes them, ``refresh`` renews tokens, ``teardown`` unmounts."""

    def __init__(
        self,
        api: AsyncApi,
        pod: dict[str, Any],
        pod_dir: Path,
        *,
        ca_file: Path,
        pod_ip: str,
        host_ip: str,
        refresh_fraction: float,
    ) -> None:
        self.api = api
        self.pod = pod
        self.dir = pod_dir / "volumes"
        self.ca_file = ca_file
        self.pod_ip = pod_ip
        self.host_ip = host_ip
        self.refresh_fraction = refresh_fraction
        self.paths: dict[str, str] = {}
        self.token_expiry: dict[str, float] = {}
        """Volume name -> when its earliest token should be renewed (time.time())."""
        sc = pod["spec"].get("securityContext") or {}
        self.fs_group: int | None = sc.get("fsGroup")

    @property
    def namespace(self) -> str:
        return self.pod["metadata"]["namespace"]

    async def prepare(self) -> dict[str, str]:
        """Make every volume; ``ConfigError`` for one that cannot be made (yet)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for volume in self.pod["spec"].get("volumes") or []:
            self.paths[volume["name"]] = await self._make(volume)
        return self.paths

    async def _make(self, volume: dict[str, Any]) -> str:
        name = volume["name"]
        target = self.dir / name
        if "emptyDir" in volume:
            target.mkdir(exist_ok=True)
            if volume["emptyDir"].get("medium") == "Memory" and not os.path.ismount(target):
                size = memory_volume_size(volume, self.pod)
                await _run(
                    "mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", str(target)
                )
            os.chmod(target, 0o1777 if volume["emptyDir"].get("medium") == "Memory" else 0o777)
            return str(target)
        if "hostPath" in volume:
            return self._host_path(volume["hostPath"])
        if (
            "configMap" in volume
            or "secret" in volume
            or "downwardAPI" in volume
            or "projected" in volume
        ):
            files = await self._files(volume)
            target.mkdir(exist_ok=True)
            os.chmod(target, 0o755)
            if self.fs_group is not None:
                os.chown(target, 0, self.fs_group)
            for rel, (data, mode) in files.items():
                write_atomic(target / rel, data, mode, self.fs_group)
            return str(target)
        kind = next((k for k in volume if k != "name"), "?")
        raise ConfigError(
            CONFIG,
            f"volume {name!r}: {kind} volumes are not provided by the conveyor node agent "
            "(it provides emptyDir, configMap, secret, downwardAPI, projected and hostPath)",
        )

    def _host_path(self, spec: dict[str, Any]) -> str:
        path = Path(spec["path"])
        kind = spec.get("type", "")
        if kind == "DirectoryOrCreate":
            path.mkdir(parents=True, exist_ok=True)
        elif kind == "FileOrCreate":
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch(exist_ok=True)
        elif kind == "Directory" and not path.is_dir():
            raise ConfigError(CONFIG, f"hostPath {path} is not a directory")
        elif kind == "File" and not path.is_file():
            raise ConfigError(CONFIG, f"hostPath {path} is not a file")
        elif kind and kind not in ("Directory", "File") and not path.exists():
            raise ConfigError(CONFIG, f"hostPath {path} does not exist")
        return str(path)

    async def _files(self, volume: dict[str, Any]) -> dict[str, tuple[bytes, int]]:
        """Relative path -> (content, mode) of a configMap/secret/downwardAPI/projected volume."""
        if "projected" in volume:
            spec = volume["projected"]
            default = spec.get("defaultMode", 0o644)
            files: dict[str, tuple[bytes, int]] = {}
            for source in spec.get("sources") or []:
                files |= await self._source(volume["name"], source, default)
            return files
        for kind in ("configMap", "secret", "downwardAPI"):
            if kind in volume:
                spec = volume[kind]
                return await self._source(
                    volume["name"], {kind: spec}, spec.get("defaultMode", 0o644)
                )
        return {}

    async def _source(
        self, volume: str, source: dict[str, Any], default_mode: int
    ) -> dict[str, tuple[bytes, int]]:
        if "serviceAccountToken" in source:
            return await self._token(volume, source["serviceAccountToken"], default_mode)
        if "downwardAPI" in source:
            out = {}
            for item in source["downwardAPI"].get("items") or []:
                if "fieldRef" in item:
                    value = field_value(
                        self.pod,
                        item["fieldRef"]["fieldPath"],
                        pod_ip=self.pod_ip,
                        host_ip=self.host_ip,
                    )
                else:
                    ref = item["resourceFieldRef"]
                    container = next(
                        c
                        for c in self.pod["spec"]["containers"]
                        if c["name"] == ref["containerName"]
                    )
                    value = resource_value(container, ref)
                out[item["path"]] = (value.encode(), item.get("mode", default_mode))
            return out
        kind = "secret" if "secret" in source else "configMap"
        spec = source[kind]
        name = spec.get("name") or spec.get("secretName")
        if kind == "configMap" and name == "kube-root-ca.crt" and not spec.get("optional"):
            # Published by the controller-manager in each namespace; the CA file is the same.
            data = {"ca.crt": self.ca_file.read_bytes()}
            with contextlib.suppress(ApiError):
                data = decode_data(
                    await self.api.get(f"/api/v1/namespaces/{self.namespace}/configmaps/{name}"),
                    secret=False,
                )
        else:
            plural = "secrets" if kind == "secret" else "configmaps"
            try:
                obj = await self.api.get(f"/api/v1/namespaces/{self.namespace}/{plural}/{name}")
            except ApiError as exc:
                if exc.status == 404 and spec.get("optional"):
                    return {}
                if exc.status == 404:
                    raise ConfigError(
                        CONFIG, f'{kind} "{name}" not found (volume {volume!r})'
                    ) from exc
                raise
            data = decode_data(obj, secret=kind == "secret")
        items = spec.get("items")
        out = {}
        if items:
            for item in items:
                if item["key"] not in data:
                    if spec.get("optional"):
                        continue
                    raise ConfigError(
                        CONFIG,
                        f'key {item["key"]!r} not found in {kind} "{name}" (volume {volume!r})',
                    )
                out[item["path"]] = (data[item["key"]], item.get("mode", default_mode))
        else:
            out = {k: (v, default_mode) for k, v in data.items()}
        return out

    async def _token(
        self, volume: str, spec: dict[str, Any], mode: int
    ) -> dict[str, tuple[bytes, int]]:
        meta = self.pod["metadata"]
        sa = self.pod["spec"].get("serviceAccountName") or "default"
        request: dict[str, Any] = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": int(spec.get("expirationSeconds", 3600)),
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": meta["name"],
                    "uid": meta["uid"],
                },
            },
        }
        if spec.get("audience"):
            request["spec"]["audiences"] = [spec["audience"]]
        try:
            resp = await self.api.request(
                "POST", f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{sa}/token", request
            )
        except ApiError as exc:
            raise ConfigError(
                CONFIG, f"token for ServiceAccount {sa!r} (volume {volume!r}): {exc}"
            ) from exc
        lifetime = int(
            resp["spec"].get("expirationSeconds") or request["spec"]["expirationSeconds"]
        )
        renew_at = time.time() + self.refresh_fraction * lifetime
        self.token_expiry[volume] = min(self.token_expiry.get(volume, renew_at), renew_at)
        # Tokens are readable by the pod's user only in a real kubelet (0600 with fsGroup); here
        # the files keep the volume's mode so that a non-root container can read them.
        return {spec["path"]: (resp["status"]["token"].encode(), mode)}

    async def refresh(self) -> None:
        """Renew the projected tokens whose time has come (rewrites those volumes' files)."""
        due = [name for name, at in self.token_expiry.items() if at <= time.time()]
        for volume in self.pod["spec"].get("volumes") or []:
            if volume["name"] in due:
                del self.token_expiry[volume["name"]]
                await self._make(volume)

    def next_refresh(self) -> float | None:
        """When the next token is due (time.time()), or ``None``."""
        return min(self.token_expiry.values()) if self.token_expiry else None

    def teardown(self) -> None:
        """Unmount the pod's memory volumes (the directory itself is removed by the caller)."""
        teardown_volumes(self.dir)


def teardown_volumes(volumes_dir: Path) -> None:
    """Unmount whatever is mounted below ``volumes_dir`` (tmpfs volumes)."""
    if not volumes_dir.exists():
        return
    for sub in volumes_dir.iterdir():
        if os.path.ismount(sub):
            subprocess.run(["umount", str(sub)], check=True, capture_output=True)


async def _run(*argv: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {err.decode().strip()}")
