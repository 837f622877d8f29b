"""An in-memory stand-in for :class:`conveyor.operator.kube.Kube` (the operator's own boundary).

Stores objects by path, bumps resourceVersion on every write and generation on spec changes,
as the apiserver does; anything else (the raw HTTP client) is never reached.
"""

from __future__ import annotations

import copy
from typing import Any

from conveyor.operator.kube import ApiError, object_path


class FakeKube:
    def __init__(self, *, apis: tuple[str, ...] = ()) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.apis = set(apis)
        self.writes: list[tuple[str, str]] = []
        self._version = 0
        self._ips = 0

    def _bump(self, obj: dict[str, Any]) -> None:
        self._version += 1
        obj["metadata"]["resourceVersion"] = str(self._version)

    def put(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Store an object as someone else (a user, a controller) would."""
        obj = copy.deepcopy(obj)
        obj["metadata"].setdefault("uid", f"uid-{obj['metadata']['name']}")
        obj["metadata"].setdefault("generation", 1)
        self._bump(obj)
        self.objects[object_path(obj)] = obj
        return obj

    async def get(self, path: str) -> dict[str, Any] | None:
        obj = self.objects.get(path)
        return copy.deepcopy(obj) if obj is not None else None

    async def list(self, path: str, *, label_selector: str | None = None) -> list[dict[str, Any]]:
        assert label_selector is None
        return [
            copy.deepcopy(o) for p, o in sorted(self.objects.items()) if p.rsplit("/", 1)[0] == path
        ]

    async def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        path = object_path(manifest)
        self.writes.append(("apply", path))
        current = self.objects.get(path)
        obj = copy.deepcopy(manifest)
        if current is None:
            obj["metadata"]["generation"] = 1
            obj["metadata"]["uid"] = f"uid-{path}"
            if obj["kind"] == "Service":
                self._ips += 1
                obj["spec"]["clusterIP"] = f"198.19.0.{self._ips}"
        else:
            for key in ("uid", "generation", "resourceVersion"):
                obj["metadata"][key] = current["metadata"][key]
            if obj["kind"] == "Service":
                obj["spec"]["clusterIP"] = current["spec"]["clusterIP"]
            if "status" in current:
                obj["status"] = current["status"]
            unchanged = {k: v for k, v in obj.items() if k != "status"} == {
                k: v for k, v in current.items() if k != "status"
            }
            if unchanged:
                return copy.deepcopy(current)
            if obj.get("spec") != current.get("spec"):
                obj["metadata"]["generation"] = current["metadata"]["generation"] + 1
        self._bump(obj)
        self.objects[path] = obj
        return copy.deepcopy(obj)

    async def merge_patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        self.writes.append(("patch", path))
        target = self.objects.get(path.removesuffix("/status"))
        if target is None:
            raise ApiError("PATCH", path, 404, "not found")
        for key, value in patch.items():
            target[key] = copy.deepcopy(value)
        self._bump(target)
        return copy.deepcopy(target)

    async def delete(self, path: str) -> None:
        self.objects.pop(path, None)

    async def has_api(self, group_version: str) -> bool:
        return group_version in self.apis

    async def request(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"the reconcile must not make raw calls: {args}")
