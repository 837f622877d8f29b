"""``conveyor gateway``: parse flags into :class:`GatewaySettings` once, then serve."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from typing import Any

from conveyor.gateway.auth import API_KEY_ENV, load_api_keys
from conveyor.gateway.metrics import MULTIPROC_ENV
from conveyor.gateway.settings import (
    ROUTING_POLICIES,
    SETTINGS_ENV,
    GatewaySettings,
    setting_docs,
    settings_to_json,
)
from conveyor.gateway.static_discovery import parse_backend

# flag -> settings field (flags follow the names vLLM/SGLang users know where there is one)
FLAGS: dict[str, str] = {
    "--host": "host",
    "--port": "port",
    "--routing": "routing",
    "--backends-file": "backends_file",
    "--discovery-interval": "discovery_interval_s",
    "--k8s-namespace": "k8s_namespace",
    "--k8s-service": "k8s_service",
    "--k8s-selector": "k8s_selector",
    "--k8s-model": "k8s_model",
    "--k8s-port-name": "k8s_port_name",
    "--load-poll-interval": "load_poll_interval_s",
    "--load-poll-timeout": "load_poll_timeout_s",
    "--load-stale-after": "load_stale_after_s",
    "--connect-timeout": "connect_timeout_s",
    "--upstream-timeout": "upstream_timeout_s",
    "--client-stall-timeout": "client_stall_timeout_s",
    "--max-attempts": "max_attempts",
    "--retry-backoff": "retry_backoff_s",
    "--ejection-time": "ejection_s",
    "--bounded-load-factor": "bounded_load_factor",
    "--prefix-block-chars": "prefix_block_chars",
    "--prefix-max-blocks": "prefix_max_blocks",
    "--ring-vnodes": "ring_vnodes",
    "--backend-api-key": "backend_api_key",
    "--max-body-bytes": "max_body_bytes",
    "--retry-after": "retry_after_s",
    "--hold-timeout": "hold_timeout_s",
    "--max-held-requests": "max_held_requests",
    "--replica-queue": "replica_queue",
    "--log-level": "log_level",
    "--workers": "workers",
}


def build_parser() -> argparse.ArgumentParser:
    docs = setting_docs()
    defaults = GatewaySettings()
    parser = argparse.ArgumentParser(
        prog="conveyor gateway",
        description="OpenAI-compatible gateway that routes each request by its model to a pool of "
        "runtime replicas, by load and prompt-prefix affinity.",
    )
    parser.add_argument(
        "--backend", action="append", default=[], metavar="[MODEL=]URL", help=docs["backends"]
    )
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        help=docs["api_keys"] + f" Also from ${API_KEY_ENV}.",
    )
    parser.add_argument("--api-key-file", help="File with accepted API keys, one per line.")
    parser.add_argument("--k8s-llmservices", action="store_true", help=docs["k8s_llmservices"])
    parser.add_argument("--queue-at-gateway", action="store_true", help=docs["queue_at_gateway"])
    for flag, name in FLAGS.items():
        default = getattr(defaults, name)
        kind = type(default) if default is not None and not isinstance(default, str) else str
        kwargs: dict[str, Any] = {
            "type": kind,
            "default": default,
            "help": f"{docs[name]} (default: %(default)s)",
        }
        if name == "routing":
            kwargs["choices"] = ROUTING_POLICIES
        parser.add_argument(flag, **kwargs)
    return parser


def parse_settings(argv: list[str]) -> GatewaySettings:
    """Flags -> settings; raises ValueError with what to change when they cannot work."""
    args = build_parser().parse_args(argv)
    values = {name: getattr(args, flag[2:].replace("-", "_")) for flag, name in FLAGS.items()}
    for spec in args.backend:
        parse_backend(spec)  # fail at start-up on a malformed URL, not on the first request
    settings = GatewaySettings(
        **values,
        backends=tuple(args.backend),
        k8s_llmservices=args.k8s_llmservices,
        queue_at_gateway=args.queue_at_gateway,
        api_keys=load_api_keys(args.api_key, args.api_key_file),
    )
    if not (settings.backends or settings.backends_file or settings.k8s_namespace):
        raise ValueError(
            "no replicas to route to: give --backend URL (repeatable), --backends-file FILE, "
            "or --k8s-namespace NS with --k8s-service NAME"
        )
    if settings.k8s_namespace and not (
        settings.k8s_service or settings.k8s_selector or settings.k8s_llmservices
    ):
        raise ValueError(
            "--k8s-namespace needs --k8s-service NAME, --k8s-selector LABELS or --k8s-llmservices"
        )
    if settings.k8s_llmservices and not settings.k8s_namespace:
        raise ValueError("--k8s-llmservices needs --k8s-namespace NS")
    if settings.bounded_load_factor < 1.0:
        raise ValueError(
            f"--bounded-load-factor must be at least 1.0 (got {settings.bounded_load_factor})"
        )
    for name in ("load_poll_interval_s", "load_poll_timeout_s", "max_attempts", "prefix_block_chars",
                 "prefix_max_blocks", "ring_vnodes", "max_body_bytes", "workers", "replica_queue"):  # fmt: skip
        if getattr(settings, name) <= 0:
            flag = next(f for f, n in FLAGS.items() if n == name)
            raise ValueError(f"{flag} must be positive (got {getattr(settings, name)})")
    return settings


def main(argv: list[str]) -> int:
    try:
        settings = parse_settings(argv)
    except (ValueError, OSError) as exc:
        print(f"conveyor gateway: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings)
    import uvicorn

    options: dict[str, Any] = dict(
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,  # one line per request is noise at gateway rates; metrics count them
        # nothing reads the client's address or scheme: no X-Forwarded-* parsing per request
        proxy_headers=False,
        backlog=4096,
        # clients' pools keep idle connections for a while (15 s in aiohttp's): uvicorn's 5 s
        # default closed them as they were reused when the gateway was busy; 75 s as nginx
        timeout_keep_alive=75,
        timeout_graceful_shutdown=30,
    )
    if settings.workers == 1:
        from conveyor.gateway.app import ProxyFirst, build_app

        uvicorn.Server(uvicorn.Config(ProxyFirst(build_app(settings)), **options)).run()
        return 0
    # Workers are fresh interpreters (uvicorn spawns them): the settings and the directory
    # of the metrics they share go through the environment, read before their first import
    # of prometheus_client.
    with tempfile.TemporaryDirectory(prefix="conveyor-gateway-metrics-") as metrics_dir:
        os.environ[MULTIPROC_ENV] = metrics_dir
        os.environ[SETTINGS_ENV] = settings_to_json(settings)
        uvicorn.run(
            "conveyor.gateway.app:from_environment",
            factory=True,
            workers=settings.workers,
            **options,
        )
    return 0


def configure_logging(settings: GatewaySettings) -> None:
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per proxied request is noise
