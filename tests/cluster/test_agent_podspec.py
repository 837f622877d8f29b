"""The node agent's pure parts: images, quantities, $(VAR) expansion, files, phase, conditions, logs."""

from __future__ import annotations

from typing import Any

import pytest

from conveyor.cluster.podspec import (
    ConfigError,
    conditions,
    container_limits,
    effective_user,
    expand,
    field_value,
    hosts_file,
    image_name,
    image_path,
    pod_phase,
    quantity,
    resolv_conf,
    service_env,
)
from conveyor.cluster.probes import ExecTarget, ProbeSpec, exec_argv, resolve_port

POD = {
    "metadata": {"name": "web-1", "namespace": "shop", "uid": "u-1", "labels": {"app": "web"}},
    "spec": {"nodeName": "cpu-node-0", "containers": [{"name": "c"}]},
}


@pytest.mark.parametrize(
    ("image", "name"),
    [
        ("conveyor", "conveyor"),
        ("conveyor:0.1", "conveyor"),
        ("ghcr.io/org/conveyor:1.2@sha256:abc", "conveyor"),
        ("localhost:5000/conveyor", "conveyor"),
        ("python:3.11-slim", "python"),
    ],
)
def test_image_name_ignores_registry_and_tag(image: str, name: str) -> None:
    assert image_name(image) == name


def test_unknown_image_is_err_image_pull() -> None:
    images = {"conveyor": ("/venv/bin",)}
    assert image_path("x/conveyor:1", images).startswith("/venv/bin:")
    with pytest.raises(ConfigError) as err:
        image_path("nginx", images)
    assert err.value.reason == "ErrImagePull"
    assert "nginx" in err.value.message


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("500m", 0.5),
        ("2", 2.0),
        ("64Mi", 64 * 2**20),
        ("1Gi", 2**30),
        ("1e3", 1000.0),
        ("100M", 1e8),
    ],
)
def test_quantities(text: str, value: float) -> None:
    assert quantity(text) == value


def test_limits() -> None:
    limits = container_limits({"resources": {"limits": {"cpu": "250m", "memory": "128Mi"}}})
    assert (limits.cpu_cores, limits.memory_bytes) == (0.25, 128 * 2**20)
    assert container_limits({}).cpu_cores is None


def test_expansion_as_kubernetes_does_it() -> None:
    env = {"A": "1", "B": "two"}
    assert expand("$(A)-$(B)", env) == "1-two"
    assert expand("$$(A) $(MISSING)", env) == "$(A) $(MISSING)"
    assert expand("echo $$", env) == "echo $"


def test_field_refs() -> None:
    assert field_value(POD, "metadata.name", pod_ip="p", host_ip="h") == "web-1"
    assert field_value(POD, "metadata.labels['app']", pod_ip="p", host_ip="h") == "web"
    assert field_value(POD, "status.podIP", pod_ip="198.18.0.9", host_ip="h") == "198.18.0.9"
    with pytest.raises(ConfigError):
        field_value(POD, "spec.nothing", pod_ip="p", host_ip="h")


def test_hosts_and_resolv_conf() -> None:
    hosts = hosts_file(POD, "198.18.0.9")
    assert "198.18.0.9\tweb-1\n" in hosts and "127.0.0.1\tlocalhost" in hosts
    assert "kubernetes" not in hosts.replace("Kubernetes-managed", "")  # the cluster's DNS names it
    resolv = resolv_conf(POD, "198.19.0.1")
    assert resolv.splitlines()[1:] == [
        "search shop.svc.cluster.local svc.cluster.local cluster.local",
        "nameserver 198.19.0.1",
        "options ndots:5",
    ]


@pytest.mark.parametrize(
    ("policy", "config", "lines"),
    [
        (
            "ClusterFirst",
            {"nameservers": ["192.0.2.53"], "searches": ["corp"], "options": [{"name": "edns0"}]},
            [
                "search shop.svc.cluster.local svc.cluster.local cluster.local corp",
                "nameserver 198.19.0.1",
                "nameserver 192.0.2.53",
                "options ndots:5 edns0",
            ],
        ),
        (
            "None",
            {"nameservers": ["192.0.2.53"], "options": [{"name": "ndots", "value": "2"}]},
            ["nameserver 192.0.2.53", "options ndots:2"],
        ),
        (
            "ClusterFirst",
            {"options": [{"name": "ndots", "value": "1"}]},
            [
                "search shop.svc.cluster.local svc.cluster.local cluster.local",
                "nameserver 198.19.0.1",
                "options ndots:1",
            ],
        ),
        ("Default", {}, ["nameserver 127.0.0.1"]),
    ],
)
def test_resolv_conf_follows_the_dns_policy(
    policy: str, config: dict[str, Any], lines: list[str]
) -> None:
    pod = {**POD, "spec": {**POD["spec"], "dnsPolicy": policy, "dnsConfig": config}}
    assert resolv_conf(pod, "198.19.0.1").splitlines()[1:] == lines


def test_run_as_non_root_needs_a_user() -> None:
    container = {"name": "c", "securityContext": {"runAsNonRoot": True}}
    with pytest.raises(ConfigError):
        effective_user(POD, container)
    pod = {**POD, "spec": {**POD["spec"], "securityContext": {"runAsUser": 1000, "fsGroup": 2000}}}
    assert effective_user(pod, container) == (1000, 1000, [2000])


@pytest.mark.parametrize(
    ("policy", "states", "ever", "phase"),
    [
        ("Always", [{"waiting": {}}], False, "Pending"),
        ("Always", [{"running": {}}], True, "Running"),
        ("Always", [{"terminated": {"exitCode": 1}}], True, "Running"),
        ("Never", [{"terminated": {"exitCode": 0}}], True, "Succeeded"),
        ("Never", [{"terminated": {"exitCode": 2}}], True, "Failed"),
        ("OnFailure", [{"terminated": {"exitCode": 2}}], True, "Running"),
        ("OnFailure", [{"terminated": {"exitCode": 0}}], True, "Succeeded"),
    ],
)
def test_phase(policy: str, states: list, ever: bool, phase: str) -> None:
    assert pod_phase(policy, states, ever) == phase


def test_condition_transition_time_kept_while_status_holds() -> None:
    first = conditions([], {"Ready": (False, "ContainersNotReady")})
    first[0]["lastTransitionTime"] = "2000-01-01T00:00:00Z"
    same = conditions(first, {"Ready": (False, "ContainersNotReady")})
    assert same[0]["lastTransitionTime"] == "2000-01-01T00:00:00Z"
    flipped = conditions(first, {"Ready": (True, None)})
    assert flipped[0]["lastTransitionTime"] != "2000-01-01T00:00:00Z"
    assert flipped[0]["status"] == "True" and "reason" not in flipped[0]


def test_service_links() -> None:
    env = service_env(
        [
            {
                "metadata": {"name": "my-db"},
                "spec": {"clusterIP": "198.19.0.7", "ports": [{"port": 5432, "name": "pg"}]},
            }
        ]
    )
    assert env["MY_DB_SERVICE_HOST"] == "198.19.0.7"
    assert env["MY_DB_SERVICE_PORT"] == "5432"
    assert env["MY_DB_PORT_5432_TCP_ADDR"] == "198.19.0.7"


def test_probe_defaults_and_ports() -> None:
    probe = ProbeSpec.of({"httpGet": {"port": "http"}})
    assert probe is not None
    assert (probe.period_s, probe.timeout_s, probe.failure_threshold, probe.success_threshold) == (
        10,
        1,
        3,
        1,
    )
    assert (
        resolve_port("http", {"name": "c", "ports": [{"name": "http", "containerPort": 8000}]})
        == 8000
    )
    assert resolve_port(81, {"name": "c"}) == 81


def test_exec_runs_in_the_container() -> None:
    argv = exec_argv(ExecTarget(42, 1000, 1000, {"A": "1"}), ["true"])
    assert argv[:2] == ["nsenter", "--target=42"]
    assert "--setuid=1000" in argv and argv[-3:] == ["-i", "A=1", "true"]
