"""``conveyor up`` / ``conveyor down``: the whole stack on one machine.

up:   build (or reuse) the cluster's tools -> start the cluster -> ``helm install``
      the chart (the operator runs as a pod) -> ``kubectl apply`` the example
      LLMService -> start Prometheus -> wait until a request through the gateway
      is answered -> print what a user needs.
down: stop Prometheus, stop the cluster (which removes every process, mount, link,
      route, rule and cgroup it made), remove the stack's files.

Running ``up`` twice is harmless: it reports what is already up and fills in
what is missing. Ctrl-C during ``up`` stops what this run started.
``--kubeconfig`` installs into an existing cluster instead (kind, k3d, a real
one) and starts nothing on this machine. The cluster started here has real nodes (the
upstream kubelet, containerd and runc, which need root), whose pods run the project's images,
built here first (only the layers whose inputs changed): the project's image for the
runtime, the torch-less ``conveyor-control`` for the operator and gateway. ``--engine vllm``
serves the example with the real vLLM (vLLM for CPU's image here, ``conveyor image build
--engine vllm``) behind the same operator, gateway and dashboards.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from conveyor.cluster.cluster import Cluster
from conveyor.cluster.kubelet_node import missing_host_tools
from conveyor.cluster.real_nodes import VLLM_CPU_IMAGE
from conveyor.cluster.settings import ClusterSettings
from conveyor.cluster.stack_images import build_node_images, chart_images, check_engine_image
from conveyor.cluster.stack_prometheus import running_prometheus, start_prometheus, stop_prometheus
from conveyor.cluster.tools import BINARIES, Tools, build_tools, tools_directory
from conveyor.runtime.model.builtin import BUILTIN_MODELS

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "conveyor"
EXAMPLE = ROOT / "examples" / "llmservice.yaml"
EXAMPLE_NAME = "smollm2"
"""metadata.name of the example LLMService (a unit test checks it against the file)."""
STACK_FILE = "stack.json"
FIRST_BUILD_BYTES = 6 << 30  # Go module and build caches of a cold build


@dataclass(frozen=True)
class StackSettings:
    """What ``conveyor up`` brings up."""

    gpu_nodes: int = 2
    """GPU nodes (fake GPUs) of the local cluster."""
    model: str = "smollm2-135m-instruct"
    """The built-in model the example LLMService serves (``conveyor-tiny`` for a fast,
    gibberish-speaking one)."""
    namespace: str = "default"
    """Where the example LLMService (and so its gateway) goes."""
    release_namespace: str = "conveyor-system"
    """Where the chart (the operator) is installed."""
    kubeconfig: Path | None = None
    """Install into this existing cluster instead of starting one here."""
    wait_s: float = 600.0
    """How long to wait for the first answered request (model generation included)."""
    prometheus_port: int = 9090
    """Port of the local Prometheus on 127.0.0.1 (a free one is picked if it is taken)."""
    engine: str = "conveyor"
    """The example LLMService's ``spec.engine``: ``conveyor``, or ``vllm`` (vLLM for CPU, whose
    image is built first)."""


def say(message: str) -> None:
    print(f"[conveyor up {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- preflight ---------------------------------------------------------------------------


def preflight(settings: StackSettings) -> None:
    """Refuse early, with what to do, on the mistakes newcomers make."""
    if settings.kubeconfig is None and os.geteuid() != 0:
        raise SystemExit(
            "conveyor up needs root on this machine: the cluster's nodes are kubelets with their "
            "own containerd (mounts, cgroups, network namespaces). Run it with sudo, or use "
            "--kubeconfig for an existing cluster."
        )
    if settings.kubeconfig is None and (missing := missing_host_tools()) is not None:
        raise SystemExit(f"conveyor up: the cluster's nodes cannot run here: {missing}")
    try:
        directory = tools_directory()
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        raise SystemExit(
            f"cannot locate the cluster's tools ({exc}); is Go 1.26+ installed?"
        ) from exc
    if Tools(directory).missing():
        cache = Path(os.environ.get("GOMODCACHE") or Path.home() / "go")
        cache.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(cache).free
        if free < FIRST_BUILD_BYTES:
            raise SystemExit(
                f"the first build of the cluster's tools needs about 6 GB of Go caches; "
                f"{free / 2**30:.1f} GB is free under {cache}. Free some space and run again."
            )
        say(
            "first run: building Kubernetes, etcd, CoreDNS, helm and Prometheus from pinned Go modules "
            "(about 15 minutes on 2 cores; cached afterwards)"
        )


# -- the steps ---------------------------------------------------------------------------


def _run(
    argv: list[str], *, check: bool = True, input_: str | None = None
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, input=input_)
    if check and proc.returncode != 0:
        raise RuntimeError(
            f"{Path(argv[0]).name} {' '.join(argv[1:3])} failed:\n{proc.stderr.strip()}"
        )
    return proc


class Stack:
    """One ``conveyor up``: what it started, so a Ctrl-C or ``down`` can stop exactly that."""

    def __init__(self, settings: StackSettings):
        self.settings = settings
        self.cluster: Cluster | None = None
        self.started_cluster = False
        self.tools: Tools | None = None
        self.kubeconfig: Path | None = settings.kubeconfig
        self.prometheus_url: str | None = None

    # helpers bound to the kubeconfig in use
    def kubectl(self, *args: str, check: bool = True, input_: str | None = None):
        assert self.tools is not None and self.kubeconfig is not None
        return _run(
            [str(self.tools.path("kubectl")), f"--kubeconfig={self.kubeconfig}", *args],
            check=check,
            input_=input_,
        )

    def helm(self, *args: str, check: bool = True):
        assert self.tools is not None and self.kubeconfig is not None
        return _run(
            [str(self.tools.path("helm")), f"--kubeconfig={self.kubeconfig}", *args], check=check
        )

    @property
    def state_file(self) -> Path | None:
        return None if self.cluster is None else self.cluster.work_dir / STACK_FILE

    def up(self) -> dict:
        s = self.settings
        started = time.monotonic()
        self.tools = build_tools(BINARIES)
        if s.kubeconfig is None:
            self.cluster = Cluster.attach()
            if self.cluster is not None:
                say(f"cluster {self.cluster.settings.name!r} is already up: reusing it")
                check_engine_image(self.cluster.settings, s.engine)
            else:
                images = build_node_images(s.engine, say)
                say(f"starting the cluster ({s.gpu_nodes} GPU nodes, real kubelets)")
                self.cluster = Cluster(
                    ClusterSettings(
                        gpu_nodes=s.gpu_nodes, tools_dir=self.tools.directory, node_images=images
                    )
                )
                self.started_cluster = True
                self.cluster.start()
            self.kubeconfig = self.cluster.kubeconfig_path
        self.install_chart()
        self.apply_example()
        if self.cluster is not None:
            self.start_prometheus()
        endpoint = self.wait_for_answer()
        info = {
            "kubeconfig": str(self.kubeconfig),
            "base_url": endpoint["base_url"],
            "model": endpoint["model"],
            "prometheus": self.prometheus_url,
            "seconds": round(time.monotonic() - started, 1),
        }
        if self.state_file is not None:
            previous = json.loads(self.state_file.read_text()) if self.state_file.exists() else {}
            self.state_file.write_text(json.dumps({**previous, **info}, indent=2))
        return info

    def install_chart(self) -> None:
        s = self.settings
        listed = self.helm("status", "conveyor", "-n", s.release_namespace, check=False)
        verb = "upgrade" if listed.returncode == 0 else "install"
        say(f"helm {verb} conveyor (the operator runs as a pod in {s.release_namespace})")
        self.helm(
            "upgrade",
            "--install",
            "conveyor",
            str(CHART),
            "-n",
            s.release_namespace,
            "--create-namespace",
            "--wait",
            "--timeout",
            "10m",
            *chart_images(self.cluster.settings if self.cluster is not None else None),
        )

    def apply_example(self) -> None:
        s = self.settings
        text = EXAMPLE.read_text()
        text = re.sub(r"builtin: \S+", f"builtin: {s.model}", text, count=1)
        if s.engine != "conveyor":
            example = engine_example(
                yaml.safe_load(text), s.engine, local_cluster=self.cluster is not None
            )
            text = yaml.safe_dump(example)
        say(f"kubectl apply -f {EXAMPLE.relative_to(ROOT)} (namespace {s.namespace})")
        self.kubectl("apply", "-n", s.namespace, "-f", "-", input_=text)

    def start_prometheus(self) -> None:
        assert self.cluster is not None and self.tools is not None and self.state_file is not None
        self.prometheus_url = running_prometheus(self.state_file)
        if self.prometheus_url is not None:
            say(f"Prometheus is already up at {self.prometheus_url}")
            return
        self.prometheus_url = start_prometheus(
            self.state_file,
            binary=self.tools.path("prometheus"),
            kubeconfig=self.kubeconfig,
            work_dir=self.cluster.work_dir / "prometheus",
            port=self.settings.prometheus_port,
        )
        say(f"Prometheus at {self.prometheus_url} (discovers pods through the apiserver)")

    def wait_for_answer(self) -> dict:
        import httpx

        s = self.settings
        say(
            "waiting for the LLMService to be Ready and answer through its gateway "
            "(the first replica loads the built-in model)"
        )
        deadline = time.monotonic() + s.wait_s
        last = "no status yet"
        while time.monotonic() < deadline:
            out = self.kubectl(
                "get", "llmservice", EXAMPLE_NAME, "-n", s.namespace, "-o", "json", check=False
            )
            status = json.loads(out.stdout).get("status", {}) if out.returncode == 0 else {}
            endpoint = status.get("endpoint") or {}
            if endpoint.get("clusterIP") and status.get("readyReplicas"):
                base = f"http://{endpoint['clusterIP']}:8080/v1"
                if self.cluster is None:  # an existing cluster: reach it through a port-forward
                    return {"base_url": base, "model": endpoint.get("model", EXAMPLE_NAME)}
                try:
                    reply = httpx.post(
                        f"{base}/completions",
                        timeout=30,
                        json={
                            "model": endpoint.get("model", EXAMPLE_NAME),
                            "prompt": "Hello",
                            "max_tokens": 4,
                        },
                    )
                    if reply.status_code == 200:
                        return {"base_url": base, "model": endpoint.get("model", EXAMPLE_NAME)}
                    last = f"gateway answered {reply.status_code}: {reply.text[:200]}"
                except httpx.HTTPError as exc:
                    last = f"gateway not answering yet ({type(exc).__name__})"
            else:
                last = f"phase {status.get('phase', '?')}, ready {status.get('readyReplicas', 0)}"
            time.sleep(2)
        raise RuntimeError(
            f"no answer through the gateway after {s.wait_s:.0f}s ({last}); "
            f"see kubectl get pods -A and kubectl describe llmservice {EXAMPLE_NAME}"
        )

    def abort(self) -> None:
        """Undo what this run started (Ctrl-C or a failure): nothing half-started stays."""
        if self.started_cluster and self.cluster is not None:
            stop_prometheus(self.cluster.work_dir / STACK_FILE)
            say("stopping the cluster this run started")
            self.cluster.stop()
            shutil.rmtree(self.cluster.work_dir / "prometheus", ignore_errors=True)


ENGINE_MODEL = "conveyor-tiny"
"""The built-in model the example serves on another engine (the default one is a GGUF file
only Conveyor's engine reads)."""
VLLM_RESOURCES = {"gpus": 1, "memory": "6Gi"}
"""vLLM for CPU's processes (API server, engine core, worker) with a 1 GiB KV cache; no CPU
limit, so that its start-up uses every core."""


def engine_example(
    example: dict[str, Any], engine: str, *, local_cluster: bool = False
) -> dict[str, Any]:
    """The example LLMService on ``engine``: the settings that engine lacks left out (vLLM sizes
    its KV cache itself), eager mode (vLLM skips its minutes of compilation at start); on the
    ``local_cluster``, vLLM for CPU's image, which its nodes hold (the operator's default is
    vLLM's GPU image, for a real cluster)."""
    spec = example["spec"]
    spec["engine"] = engine
    runtime = spec.setdefault("runtime", {})
    runtime.pop("maxTotalTokens", None)
    if engine == "vllm":
        runtime["extraArgs"] = ["--enforce-eager"]
        spec["resources"] = dict(VLLM_RESOURCES)
        if local_cluster:
            runtime["image"] = VLLM_CPU_IMAGE
    if not runtime:
        del spec["runtime"]
    return example


def print_welcome(info: dict, stack: Stack) -> None:
    base, model, kube = info["base_url"], info["model"], info["kubeconfig"]
    lines = [
        "",
        f"Conveyor is up ({info['seconds']}s). OpenAI-compatible base URL: {base}",
        "",
        f"  curl -s {base}/chat/completions -H 'Content-Type: application/json' \\",
        f'    -d \'{{"model": "{model}", "messages": [{{"role": "user", "content": '
        '"What is the capital of France?"}], "max_tokens": 32}\'',
        "",
        f"  {sys.executable} -c \"from openai import OpenAI; c = OpenAI(base_url='"
        + base
        + "', api_key='none'); "
        f"print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', "
        "'content': 'Write a haiku about the sea.'}], max_tokens=48).choices[0].message.content)\"",
        "",
        f"  export KUBECONFIG={kube}",
        f"  {stack.tools.path('kubectl') if stack.tools else 'kubectl'} get llmservices",
    ]
    if stack.cluster is None:
        lines += [
            "",
            "On an existing cluster the gateway's ClusterIP is not reachable from here:",
            f"  kubectl -n {stack.settings.namespace} port-forward svc/conveyor-gateway 8080:8080",
            "  then use http://127.0.0.1:8080/v1",
        ]
    if info.get("prometheus"):
        lines += [
            "",
            f"Prometheus: {info['prometheus']}",
            f"  conveyor dashboard render --prometheus {info['prometheus']} --from now-1h --to now "
            "--out dashboards/",
        ]
    lines += ["", "Tear it all down: conveyor down", ""]
    print("\n".join(lines), flush=True)


# -- entry points ------------------------------------------------------------------------


def main_up(argv: list[str]) -> int:
    d = StackSettings()
    parser = argparse.ArgumentParser(
        prog="conveyor up",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--gpu-nodes", type=int, default=d.gpu_nodes, help="GPU nodes, fake GPUs (default 2)"
    )
    parser.add_argument(
        "--model",
        default=None,
        choices=BUILTIN_MODELS,
        help=f"built-in model the example serves (default {d.model}; {ENGINE_MODEL} on vllm)",
    )
    parser.add_argument(
        "--engine",
        default=d.engine,
        choices=("conveyor", "vllm"),
        help="the example's engine: conveyor (default), or vllm (the real vLLM for CPU, whose "
        "image is built on first use: about 6.6 GB, minutes)",
    )
    parser.add_argument(
        "--namespace", default=d.namespace, help="namespace of the example LLMService"
    )
    parser.add_argument(
        "--kubeconfig",
        type=Path,
        default=None,
        help="install into this existing cluster instead of starting one here",
    )
    parser.add_argument(
        "--wait", type=float, default=d.wait_s, help="seconds to wait for the first answer"
    )
    args = parser.parse_args(argv)
    model = args.model or (d.model if args.engine == "conveyor" else ENGINE_MODEL)
    if args.engine != "conveyor" and model != ENGINE_MODEL:
        parser.error(
            f"--model {model} is a GGUF file only engine conveyor reads: "
            f"use --model {ENGINE_MODEL} with --engine {args.engine}"
        )
    settings = replace(
        d,
        gpu_nodes=args.gpu_nodes,
        model=model,
        engine=args.engine,
        namespace=args.namespace,
        kubeconfig=args.kubeconfig,
        wait_s=args.wait,
    )
    preflight(settings)
    stack = Stack(settings)
    try:
        info = stack.up()
    except KeyboardInterrupt:
        say("interrupted: undoing what this run started")
        stack.abort()
        return 130
    except (RuntimeError, OSError) as exc:
        say(f"failed: {exc}")
        stack.abort()
        return 1
    print_welcome(info, stack)
    return 0


def main_down(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="conveyor down", description="Stop everything `conveyor up` started."
    )
    parser.parse_args(argv)
    cluster = Cluster.attach()
    if cluster is None:
        print("nothing is up (no running cluster on this machine)")
        return 0
    stop_prometheus(cluster.work_dir / STACK_FILE)
    cluster.stop()
    shutil.rmtree(cluster.work_dir / "prometheus", ignore_errors=True)
    print(f"stopped cluster {cluster.settings.name!r}; nothing is left running")
    return 0


def main(argv: list[str]) -> int:
    return main_up(argv)
