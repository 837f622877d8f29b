"""kopf's login: in a pod, the apiserver's Service at the address the environment gives (as
client-go does), so no cluster DNS is needed for ``kubernetes.default.svc``; elsewhere the
kubeconfig's server and credentials."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conveyor.operator.cli import connection_info
from conveyor.operator.settings import OperatorSettings


async def test_in_a_pod_the_service_address_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "token").write_text("sa-token\n")
    (tmp_path / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    info = await connection_info(OperatorSettings(), service_account=tmp_path)
    assert info.server == "https://10.96.0.1:443"
    assert info.token == "sa-token" and info.scheme == "Bearer"
    assert info.ca_path == str(tmp_path / "ca.crt")


async def test_a_kubeconfig_wins_over_the_pods_service_account(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:6443"}}],
                "users": [{"name": "u", "user": {"token": "user-token"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    info = await connection_info(OperatorSettings(kubeconfig=str(kubeconfig)))
    assert info.server == "https://127.0.0.1:6443" and info.token == "user-token"
