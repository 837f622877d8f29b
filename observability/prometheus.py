"""A real Prometheus for tests and ``conveyor up``: its configuration, its process, its API.

Prometheus finds what to scrape the way it does on a real cluster: ``kubernetes_sd_configs``
(role ``pod``) against the cluster's apiserver, through a kubeconfig, keeping the pods that
carry ``prometheus.io/scrape: "true"`` and ``app.kubernetes.io/name: conveyor`` and
relabelling them to ``namespace``, ``llmservice``, ``pod`` and ``component``
(ARCHITECTURE.md). Static targets exist only for the loopback integration tests, where
processes run without a cluster.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from conveyor.observability.chart import CHART

RULES_FILE = CHART / "files" / "prometheus-rules.yaml"
"""The recording and alerting rules (generated; the chart's PrometheusRule holds the same)."""


@dataclass(frozen=True)
class StaticTarget:
    """A process scraped at a fixed address, with the labels discovery would have given it."""

    address: str
    """host:port of its /metrics."""
    namespace: str
    pod: str
    component: str
    """``runtime``, ``gateway`` or ``operator``."""
    llmservice: str = ""


@dataclass(frozen=True)
class PrometheusSettings:
    """How the Prometheus the tests and ``conveyor up`` start is run and what it scrapes."""

    binary: Path
    """The ``prometheus`` binary (built by cluster/build-tools.sh: Prometheus 3 with Kubernetes SD)."""
    host: str = "127.0.0.1"
    """Address of its web UI and API; loopback, since nothing outside this machine reads it."""
    port: int = 0
    """Port of its web UI and API; 0 picks a free one."""
    data_dir: Path | None = None
    """TSDB directory; unset: a temporary one removed by ``stop()``."""
    scrape_interval_s: float = 15.0
    """Seconds between scrapes; 15 s is Prometheus' own default (tests use 1 s)."""
    evaluation_interval_s: float = 15.0
    """Seconds between rule evaluations."""
    kubeconfig: Path | None = None
    """Discover pods through this kubeconfig's apiserver (kubernetes_sd_configs, role pod)."""
    namespaces: tuple[str, ...] = ()
    """Namespaces to discover pods in; empty: all."""
    static_targets: tuple[StaticTarget, ...] = ()
    """Fixed targets (loopback integration tests only)."""
    rule_files: tuple[Path, ...] = (RULES_FILE,)
    """Rule files to load; the project's recording and alerting rules by default."""
    retention: str = "2d"
    """How long samples are kept; a local stack needs hours, not weeks."""
    work_dir: Path | None = None
    """Config, log and data live here and outlive ``stop()`` (``conveyor up``); unset: a
    temporary directory that ``stop()`` removes (tests)."""


SCRAPE_ANNOTATION = "__meta_kubernetes_pod_annotation_prometheus_io_scrape"
PORT_ANNOTATION = "__meta_kubernetes_pod_annotation_prometheus_io_port"
PATH_ANNOTATION = "__meta_kubernetes_pod_annotation_prometheus_io_path"
COMPONENT_LABEL = "__meta_kubernetes_pod_label_app_kubernetes_io_component"


def _duration(seconds: float) -> str:
    return f"{round(seconds * 1000)}ms"


def pod_relabelling(*, operator: bool) -> list[dict[str, Any]]:
    """Keep the annotated Conveyor pods (the operator's or the others), address them, label them."""
    return [
        {"source_labels": [SCRAPE_ANNOTATION], "regex": "true", "action": "keep"},
        {
            "source_labels": ["__meta_kubernetes_pod_label_app_kubernetes_io_name"],
            "regex": "conveyor",
            "action": "keep",
        },
        {
            "source_labels": [COMPONENT_LABEL],
            "regex": "operator",
            "action": "keep" if operator else "drop",
        },
        {"source_labels": ["__meta_kubernetes_pod_phase"], "regex": "Running", "action": "keep"},
        {
            "source_labels": [PATH_ANNOTATION],
            "regex": "(.+)",
            "target_label": "__metrics_path__",
        },
        {
            "source_labels": ["__meta_kubernetes_pod_ip", PORT_ANNOTATION],
            "regex": "(.+);([0-9]+)",
            "replacement": "$1:$2",
            "target_label": "__address__",
        },
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {
            "source_labels": ["__meta_kubernetes_pod_label_conveyor_dev_llmservice"],
            "target_label": "llmservice",
        },
        {"source_labels": [COMPONENT_LABEL], "target_label": "component"},
    ]


def prometheus_config(settings: PrometheusSettings) -> dict[str, Any]:
    """The configuration file's content (a pure function of the settings)."""
    scrape_configs: list[dict[str, Any]] = []
    if settings.kubeconfig is not None:
        sd: dict[str, Any] = {"role": "pod", "kubeconfig_file": str(settings.kubeconfig)}
        if settings.namespaces:
            sd["namespaces"] = {"names": list(settings.namespaces)}
        scrape_configs += [
            {
                "job_name": "conveyor",
                "kubernetes_sd_configs": [sd],
                "relabel_configs": pod_relabelling(operator=False),
            },
            {
                # the autoscaler's series name the LLMService's namespace themselves
                "job_name": "conveyor-operator",
                "honor_labels": True,
                "kubernetes_sd_configs": [sd],
                "relabel_configs": pod_relabelling(operator=True),
            },
        ]
    for operator in (False, True):
        targets = [t for t in settings.static_targets if (t.component == "operator") == operator]
        if not targets:
            continue
        scrape_configs.append(
            {
                "job_name": "conveyor-static-operator" if operator else "conveyor-static",
                "honor_labels": operator,
                "static_configs": [
                    {
                        "targets": [t.address],
                        "labels": {
                            k: v
                            for k, v in {
                                "namespace": t.namespace,
                                "pod": t.pod,
                                "component": t.component,
                                "llmservice": t.llmservice,
                            }.items()
                            if v
                        },
                    }
                    for t in targets
                ],
            }
        )
    return {
        "global": {
            "scrape_interval": _duration(settings.scrape_interval_s),
            "scrape_timeout": _duration(min(10.0, settings.scrape_interval_s)),
            "evaluation_interval": _duration(settings.evaluation_interval_s),
        },
        "rule_files": [str(p) for p in settings.rule_files],
        "scrape_configs": scrape_configs,
    }


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class PrometheusError(RuntimeError):
    pass


@dataclass
class Prometheus:
    """One Prometheus process: ``start()``/``stop()`` (or ``with``), its log kept for failures."""

    settings: PrometheusSettings
    port: int = 0
    _workdir: Path | None = field(default=None, repr=False)
    _process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        assert self._workdir is not None
        return self._workdir / "prometheus.log"

    def start(self, timeout_s: float = 60.0) -> Prometheus:
        if not self.settings.binary.is_file():
            raise PrometheusError(
                f"no prometheus binary at {self.settings.binary}: build it with cluster/build-tools.sh"
            )
        if self.settings.work_dir is not None:
            self.settings.work_dir.mkdir(parents=True, exist_ok=True)
            self._workdir = self.settings.work_dir
        else:
            self._workdir = Path(tempfile.mkdtemp(prefix="conveyor-prometheus-"))
        self.port = self.settings.port or _free_port(self.settings.host)
        config = self._workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(prometheus_config(self.settings), sort_keys=False))
        data = self.settings.data_dir or self._workdir / "data"
        argv = [
            str(self.settings.binary),
            f"--config.file={config}",
            f"--storage.tsdb.path={data}",
            f"--storage.tsdb.retention.time={self.settings.retention}",
            f"--web.listen-address={self.settings.host}:{self.port}",
            "--web.enable-lifecycle",
        ]
        with open(self.log_path, "wb") as log:
            self._process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self._process is not None
            if self._process.poll() is not None:
                raise PrometheusError(f"prometheus exited at start:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise PrometheusError(
                    f"prometheus not ready after {timeout_s}s:\n{self.log_tail()}"
                )
            time.sleep(0.1)

    def log_tail(self, lines: int = 40) -> str:
        if self._workdir is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None
        if self._workdir is not None and self.settings.work_dir is None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def __enter__(self) -> Prometheus:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def api(self) -> PrometheusAPI:
        return PrometheusAPI(self.url)


@dataclass(frozen=True)
class PrometheusAPI:
    """The few HTTP API calls the dashboards and tests need (any Prometheus, ours or a user's)."""

    url: str
    timeout_s: float = 30.0

    def _get(self, path: str, params: dict[str, Any] | list[tuple[str, Any]]) -> Any:
        query = urllib.parse.urlencode(params)
        request = urllib.request.Request(f"{self.url.rstrip('/')}{path}?{query}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                body = json.load(reply)
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
            raise PrometheusError(
                f"{path} {params}: {exc.code} {body.get('errorType')}: {body.get('error')}"
            ) from exc
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = at
        return self._get("/api/v1/query", params)["result"]

    def query_range(
        self, expr: str, start: float, end: float, step_s: float
    ) -> list[dict[str, Any]]:
        params = {"query": expr, "start": start, "end": end, "step": step_s}
        return self._get("/api/v1/query_range", params)["result"]

    def label_values(self, label: str, match: str, start: float, end: float) -> list[str]:
        """What Grafana's ``label_values(match, label)`` lists over ``start``..``end``."""
        params = [("match[]", match), ("start", start), ("end", end)]
        return sorted(self._get(f"/api/v1/label/{label}/values", params))

    def metadata(self, metric: str) -> list[dict[str, Any]]:
        """HELP and TYPE scraped for ``metric`` (present even while it has no series)."""
        return self._get("/api/v1/metadata", {"metric": metric}).get(metric, [])

    def targets(self) -> list[dict[str, Any]]:
        return self._get("/api/v1/targets", {"state": "active"})["activeTargets"]
