"""Projected volumes: the ServiceAccount token, CA and namespace written, the token renewed."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from conveyor.cluster.volumes import PodVolumes


class FakeApi:
    """The agent's API boundary: answers TokenRequests with numbered tokens, nothing else."""

    def __init__(self) -> None:
        self.issued = 0

    async def request(self, method: str, path: str, body: Any = None, **_: Any) -> Any:
        assert method == "POST" and path == "/api/v1/namespaces/shop/serviceaccounts/reader/token"
        assert body["spec"]["boundObjectRef"]["uid"] == "u-1"
        self.issued += 1
        return {"spec": {"expirationSeconds": 3607}, "status": {"token": f"token-{self.issued}"}}

    async def get(self, path: str, **_: Any) -> Any:
        raise AssertionError(f"unexpected GET {path}")


POD = {
    "metadata": {"name": "web", "namespace": "shop", "uid": "u-1"},
    "spec": {
        "serviceAccountName": "reader",
        "containers": [{"name": "c"}],
        "volumes": [
            {
                "name": "kube-api-access",
                "projected": {
                    "defaultMode": 420,
                    "sources": [
                        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                        {
                            "configMap": {
                                "name": "kube-root-ca.crt",
                                "items": [{"key": "ca.crt", "path": "ca.crt"}],
                            }
                        },
                        {
                            "downwardAPI": {
                                "items": [
                                    {
                                        "path": "namespace",
                                        "fieldRef": {"fieldPath": "metadata.namespace"},
                                    }
                                ]
                            }
                        },
                    ],
                },
            },
            {"name": "scratch", "emptyDir": {}},
        ],
    },
}


class NoConfigMapApi(FakeApi):
    async def get(self, path: str, **_: Any) -> Any:
        from conveyor.cluster.api import ApiError

        raise ApiError("GET", path, 404, {"message": "not found"})


def test_projected_token_ca_and_namespace_then_renewal(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("CA")
    api = NoConfigMapApi()
    volumes = PodVolumes(
        api,
        POD,
        tmp_path / "pod",
        ca_file=ca,
        pod_ip="198.18.0.2",
        host_ip="198.18.0.1",
        refresh_fraction=0.8,
    )
    paths = asyncio.run(volumes.prepare())
    sa = Path(paths["kube-api-access"])
    assert (sa / "token").read_text() == "token-1"
    assert (sa / "ca.crt").read_text() == "CA"
    assert (sa / "namespace").read_text() == "shop"
    assert Path(paths["scratch"]).is_dir()
    due = volumes.next_refresh()
    assert due is not None
    asyncio.run(volumes.refresh())  # not due yet: nothing renewed
    assert (sa / "token").read_text() == "token-1"
    volumes.token_expiry["kube-api-access"] = 0.0  # its time has come
    asyncio.run(volumes.refresh())
    assert (sa / "token").read_text() == "token-2"
    assert api.issued == 2
