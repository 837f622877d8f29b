"""``conveyor operator``: parse flags into :class:`OperatorSettings` once, then run.

Order: connect (in-cluster or a kubeconfig), serve ``/healthz`` and ``/metrics``, take the
leader Lease (a standby waits here), then run kopf until a signal or the Lease is lost. A
replica that loses the Lease exits non-zero, so its pod restarts as a standby.

``conveyor operator manifests`` prints what installs the operator without Helm (the CRD, its
ServiceAccount and RBAC from ``rbac.py``, its Deployment), for ``kubectl apply -f -``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

from conveyor.operator.kube import CONNECT_TIMEOUT_S
from conveyor.operator.settings import OperatorSettings

log = logging.getLogger("conveyor.operator")

# flag -> settings field
FLAGS: dict[str, str] = {
    "--kubeconfig": "kubeconfig",
    "--host": "host",
    "--port": "port",
    "--runtime-image": "runtime_image",
    "--gateway-image": "gateway_image",
    "--image-pull-policy": "image_pull_policy",
    "--gateway-replicas": "gateway_replicas",
    "--gateway-routing": "gateway_routing",
    "--gateway-api-key-secret": "gateway_api_key_secret",
    "--gateway-cpu": "gateway_cpu",
    "--gateway-memory": "gateway_memory",
    "--gateway-hold-timeout": "gateway_hold_timeout_s",
    "--resync-interval": "resync_interval_s",
    "--autoscale-interval": "autoscale_interval_s",
    "--autoscale-scrape-timeout": "autoscale_scrape_timeout_s",
    "--autoscale-ttft-window": "autoscale_ttft_window_s",
    "--lease-name": "lease_name",
    "--lease-namespace": "lease_namespace",
    "--lease-duration": "lease_duration_s",
    "--lease-renew-interval": "lease_renew_interval_s",
    "--lease-retry-interval": "lease_retry_interval_s",
    "--identity": "identity",
    "--log-level": "log_level",
}


def _docs() -> dict[str, str]:
    import ast
    import inspect
    import itertools

    body = ast.parse(inspect.getsource(OperatorSettings)).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
        ):
            docs[node.target.id] = str(after.value.value)  # type: ignore[union-attr]
    return docs


def build_parser() -> argparse.ArgumentParser:
    docs, defaults = _docs(), OperatorSettings()
    parser = argparse.ArgumentParser(
        prog="conveyor operator",
        description="Reconcile LLMServices into runtime Deployments behind each namespace's gateway.",
    )
    parser.add_argument(
        "--namespace",
        action="append",
        default=[],
        dest="namespaces",
        help=docs["namespaces"] + " Repeatable.",
    )
    parser.add_argument(
        "--leader-election", action=argparse.BooleanOptionalAction, default=defaults.leader_election,
        help=docs["leader_election"],
    )  # fmt: skip
    parser.add_argument(
        "--gateway-queue", action=argparse.BooleanOptionalAction, default=defaults.gateway_queue,
        help=docs["gateway_queue"],
    )  # fmt: skip
    for flag, name in FLAGS.items():
        default = getattr(defaults, name)
        kind = type(default) if default is not None and not isinstance(default, str) else str
        parser.add_argument(
            flag, type=kind, default=default, help=f"{docs[name]} (default: %(default)s)"
        )
    return parser


def parse_settings(argv: list[str]) -> OperatorSettings:
    args = build_parser().parse_args(argv)
    values = {name: getattr(args, flag[2:].replace("-", "_")) for flag, name in FLAGS.items()}
    if not values["identity"]:
        values["identity"] = os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"
    if values["lease_namespace"] == OperatorSettings.lease_namespace and os.environ.get(
        "POD_NAMESPACE"
    ):
        values["lease_namespace"] = os.environ["POD_NAMESPACE"]
    return OperatorSettings(
        **values,
        namespaces=tuple(args.namespaces),
        leader_election=args.leader_election,
        gateway_queue=args.gateway_queue,
    )


async def run(settings: OperatorSettings) -> int:
    """The operator's life; its exit code."""
    import kopf

    from conveyor.operator.autoscaler_timer import AutoscalerTimer, HttpScraper
    from conveyor.operator.handlers import register
    from conveyor.operator.health import HealthServer
    from conveyor.operator.kube import Kube
    from conveyor.operator.leader import LeaderElector
    from conveyor.operator.metrics import OperatorMetrics
    from conveyor.operator.reconciler import Reconciler

    kube = await Kube.connect(settings.kubeconfig)
    metrics = OperatorMetrics()
    state: dict[str, Any] = {"problem": None}
    health = HealthServer(
        host=settings.host, port=settings.port, metrics=metrics, healthy=lambda: state["problem"]
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in ("SIGINT", "SIGTERM"):
        loop.add_signal_handler(getattr(__import__("signal"), sig), stop.set)
    elector = None
    scraper = None
    try:
        await health.start()
        log.info("health and metrics on %s:%d", settings.host, health.port)
        if settings.leader_election:
            elector = LeaderElector(
                kube=kube,
                namespace=settings.lease_namespace,
                name=settings.lease_name,
                identity=settings.identity,
                duration_s=settings.lease_duration_s,
                renew_interval_s=settings.lease_renew_interval_s,
                retry_interval_s=settings.lease_retry_interval_s,
            )
            log.info(
                "standing by for Lease %s/%s as %s",
                settings.lease_namespace,
                settings.lease_name,
                settings.identity,
            )
            if not await _first(elector.acquire(), stop.wait()):
                return 0  # stopped while standing by
        metrics.leader.set(1)

        def post_event(obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
            # kopf.event walks any mapping; its annotation names only kopf's Body view of one.
            kopf.event(obj, type=type_, reason=reason, message=message)  # type: ignore[arg-type]

        reconciler = Reconciler(
            kube=kube, settings=settings, metrics=metrics, post_event=post_event
        )
        scraper = HttpScraper(settings.autoscale_scrape_timeout_s)
        autoscaler = AutoscalerTimer(
            kube=kube,
            scraper=scraper,
            metrics=metrics,
            post_event=post_event,
            ttft_window=settings.autoscale_ttft_window_s,
        )
        registry = kopf.OperatorRegistry()
        register(registry, reconciler=reconciler, settings=settings, autoscaler=autoscaler)
        _register_login(registry, settings)
        kopf_settings = kopf_operator_settings(settings)
        kopf_stop: asyncio.Future[None] = loop.create_future()
        kopf_task = asyncio.create_task(
            kopf.operator(
                registry=registry,
                settings=kopf_settings,
                standalone=True,  # the Lease elects; kopf's peering would freeze equal peers
                clusterwide=not settings.namespaces,
                namespaces=list(settings.namespaces),
                stop_flag=kopf_stop,
                # Our own identity: kopf would otherwise ask getpass for a user name, which
                # fails for a uid with no /etc/passwd entry (the chart's non-root 10001).
                # (kopf takes it as its Identity, a NewType of str that it does not export.)
                identity=settings.identity,  # type: ignore[arg-type]
            ),
            name="kopf",
        )
        watchers = [asyncio.create_task(stop.wait(), name="signal"), kopf_task]
        if elector is not None:
            watchers.append(asyncio.create_task(elector.hold(), name="lease"))
        done, _ = await asyncio.wait(watchers, return_when=asyncio.FIRST_COMPLETED)
        lost = elector is not None and watchers[-1] in done
        if not kopf_task.done():
            kopf_stop.set_result(None)
        for task in watchers:
            if task is not kopf_task:
                task.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        metrics.leader.set(0)
        if lost:
            log.error("leadership lost: exiting so that this replica restarts as a standby")
            return 1
        if kopf_task.done() and not kopf_task.cancelled() and kopf_task.exception():
            log.error("kopf stopped: %r", kopf_task.exception())
            return 1
        return 0
    finally:
        if elector is not None:
            with contextlib.suppress(Exception):  # best effort; the Lease expires anyway
                await elector.release()
        if scraper is not None:
            await scraper.close()
        await health.stop()
        await kube.close()


async def _first(main: Any, stop: Any) -> bool:
    """Run ``main`` until it returns (True) or ``stop`` does first (False)."""
    tasks = [asyncio.ensure_future(main), asyncio.ensure_future(stop)]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return tasks[0] in done


WATCH_SERVER_TIMEOUT_S = 300
"""Seconds after which the apiserver ends each of kopf's watches (then watched again)."""
WATCH_CLIENT_MARGIN_S = 30
"""Seconds kopf waits past WATCH_SERVER_TIMEOUT_S before dropping a watch whose end never came."""


def kopf_operator_settings(settings: OperatorSettings) -> Any:
    """kopf's own settings: our finalizer and annotation prefix, no status stanza, quiet posting."""
    import kopf

    kopf_settings = kopf.OperatorSettings()
    kopf_settings.persistence.finalizer = "conveyor.dev/operator"
    kopf_settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix="conveyor.dev"
    )
    kopf_settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="conveyor.dev", key="last-handled-configuration"
    )
    kopf_settings.posting.level = (
        logging.WARNING
    )  # only warnings from kopf's own logs become Events
    # Nothing waits on a socket forever (a frozen or partitioned apiserver answers nothing): the
    # apiserver ends each watch after server_timeout, and the client gives up a little later if
    # that end never arrives; a watch with no event (bookmarks come every minute) for
    # inactivity_timeout is presumed dead. Either way kopf watches again from the last
    # resourceVersion seen, and lists again when the apiserver says that version is gone (410).
    kopf_settings.watching.server_timeout = WATCH_SERVER_TIMEOUT_S
    kopf_settings.watching.client_timeout = WATCH_SERVER_TIMEOUT_S + WATCH_CLIENT_MARGIN_S
    kopf_settings.watching.connect_timeout = CONNECT_TIMEOUT_S
    kopf_settings.networking.request_timeout = 60
    kopf_settings.networking.connect_timeout = CONNECT_TIMEOUT_S
    return kopf_settings


SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
"""Where a pod's ServiceAccount token and the cluster's CA are mounted."""


def _register_login(registry: Any, settings: OperatorSettings) -> None:
    """kopf logs in with the same credentials as the operator's own client."""
    import kopf

    @kopf.on.login(registry=registry)
    async def login(**_: Any) -> Any:
        return await connection_info(settings)


async def connection_info(
    settings: OperatorSettings, service_account: Path = SERVICE_ACCOUNT
) -> Any:
    """kopf's ConnectionInfo from the kubeconfig, or in a pod from its ServiceAccount, with the
    apiserver's Service at the address the pod's environment gives, as client-go does (kopf's
    own ``login_with_service_account`` names kubernetes.default.svc, which only a cluster DNS
    resolves)."""
    import kopf
    from kubernetes_asyncio import client, config

    configuration = client.Configuration()
    if not settings.kubeconfig and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(  # type: ignore[no-untyped-call]  # kubernetes_asyncio
            client_configuration=configuration,
            token_filename=str(service_account / "token"),
            cert_filename=str(service_account / "ca.crt"),
        )
    else:
        await config.load_kube_config(
            config_file=settings.kubeconfig, client_configuration=configuration
        )
    token = (configuration.api_key or {}).get("BearerToken") or ""
    if configuration.host is None:
        raise kopf.LoginError(f"{settings.kubeconfig or 'the kubeconfig'} names no server")
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
        scheme="Bearer" if token else None,
        token=token.removeprefix("Bearer ").strip() or None,
    )


def main(argv: list[str]) -> int:
    if argv and argv[0] == "manifests":
        from conveyor.operator.install import main_manifests

        return main_manifests(argv[1:])
    try:
        settings = parse_settings(argv)
    except ValueError as exc:
        print(f"conveyor operator: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # kopf logs every successful handler at INFO: one line per child event is noise
    logging.getLogger("kopf.objects").setLevel(max(logging.WARNING, logging.getLogger().level))
    return asyncio.run(run(settings))
