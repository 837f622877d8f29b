"""The gateway's ASGI app: components are built in the lifespan and passed to each other.

Routes: ``POST /v1/completions``, ``/v1/chat/completions``, ``/v1/responses``, ``/tokenize``
and ``/detokenize`` (proxied, see ``proxy.py``); ``GET`` and ``DELETE /v1/responses/{id}``
and ``GET /v1/responses/{id}/input_items`` (on the replica that stores it,
``stored_responses.py``); ``GET /v1/models`` (every pool's model, with the card its replicas
give), ``/health``, ``/ready``, ``/metrics``, ``/debug/pools``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from conveyor.gateway.auth import ApiKeyAuth, backend_headers
from conveyor.gateway.errors import error_json
from conveyor.gateway.k8s_discovery import K8sPoolSpec, KubernetesDiscovery, KubernetesSliceSource
from conveyor.gateway.llmservice_discovery import KubernetesLLMServiceSource, LLMServiceWatcher
from conveyor.gateway.load_poller import LoadPoller
from conveyor.gateway.metrics import GatewayMetrics
from conveyor.gateway.pool import Registry
from conveyor.gateway.proxy import Proxy
from conveyor.gateway.routing import RoutingPolicy, make_policy
from conveyor.gateway.settings import GatewaySettings
from conveyor.gateway.static_discovery import StaticDiscovery
from conveyor.gateway.stored_responses import on_holder

log = logging.getLogger("conveyor.gateway")

PROXIED_PATHS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/tokenize",
    "/detokenize",
)
"""Forwarded to a replica of the body's ``model``, bodies unchanged (structured outputs,
tools, logit_bias included); ``/tokenize`` and ``/detokenize`` are vLLM's."""


KEEPALIVE_S = 4.0
"""Seconds an idle upstream connection is kept: under the runtime's (uvicorn's) 5 s."""


@dataclass
class Gateway:
    """Everything one running gateway holds; built and torn down by the lifespan."""

    settings: GatewaySettings
    client: httpx.AsyncClient
    session: aiohttp.ClientSession
    metrics: GatewayMetrics
    registry: Registry
    auth: ApiKeyAuth
    proxy: Proxy
    synced: list[asyncio.Event] = field(default_factory=list)
    """One per discovery source; the gateway is ready once each has synced once."""
    cards: dict[str, tuple[float, dict[str, Any]]] = field(default_factory=dict)
    """Model -> (loop time fetched, the card one of its replicas gives on /v1/models)."""


CARD_MAX_AGE_S = 30.0
"""How long a replica's model card is shown before it is asked for again."""


async def model_card(gateway: Gateway, model: str) -> dict[str, Any]:
    """``model``'s card on ``GET /v1/models``: the one a ready replica of its pool gives
    (``max_model_len`` and ``root``, as vLLM's and Conveyor's replicas have them), named as
    the gateway serves it; the bare card when no replica answers."""
    loop = asyncio.get_running_loop()
    cached = gateway.cards.get(model)
    if cached is not None and loop.time() - cached[0] < CARD_MAX_AGE_S:
        return cached[1]
    bare = {"id": model, "object": "model", "created": 0, "owned_by": "conveyor"}
    pool = gateway.registry.pools.get(model)
    now = loop.time()
    ready = [r for r in pool.replicas.values() if r.admitted(now)] if pool else []
    if not ready:
        return bare
    try:
        response = await gateway.client.get(
            ready[0].url + "/v1/models", headers=backend_headers(gateway.settings.backend_api_key)
        )
        response.raise_for_status()
        cards = [c for c in response.json()["data"] if isinstance(c, dict)]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        log.debug("no model card from %s: %s", ready[0].url, exc)
        return bare
    card = next((c for c in cards if c.get("id") == model), cards[0] if len(cards) == 1 else None)
    if card is None:
        return bare
    card = {**card, "id": model}
    gateway.cards[model] = (loop.time(), card)
    return card


def make_control_client(settings: GatewaySettings) -> httpx.AsyncClient:
    """Client for discovery's checks of replicas (/v1/models): a few requests per replica.

    ``trust_env=False`` so no proxy variable reroutes traffic meant for pods.
    """
    return httpx.AsyncClient(
        timeout=httpx.Timeout(settings.load_poll_timeout_s),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=1024),
        trust_env=False,
    )


def make_upstream_session(settings: GatewaySettings) -> aiohttp.ClientSession:
    """A pooled client to the replicas: one for the data path (proxied requests), one for
    the /load polls (``load_poller``).

    aiohttp rather than httpx here: httpcore's pool scans every connection on each request
    and release, which took two thirds of the gateway's CPU at 200 concurrent streams
    (``conveyor bench gateway --part overhead``); aiohttp's connector does not. Replicas'
    silence (``--upstream-timeout``) is watched by ``upstream_attempt``, not by a
    ``sock_read`` timeout that moves a timer on every chunk; replicas set no cookies, so
    there is no jar to filter each request and response through.
    """
    return aiohttp.ClientSession(
        # idle connections go before the replica's keep-alive (uvicorn's 5 s) ends them, so
        # few are reused just as the replica closes them (upstream_attempt retries those)
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S, use_dns_cache=True),
        timeout=aiohttp.ClientTimeout(total=None, connect=settings.connect_timeout_s),
        cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=False,  # bytes pass through as the replica encoded them
        trust_env=False,
        skip_auto_headers=("User-Agent",),
    )


@contextlib.asynccontextmanager
async def running_gateway(settings: GatewaySettings) -> AsyncIterator[Gateway]:
    """Build every component, start discovery and load polling; stop all of it on exit."""
    metrics = GatewayMetrics()

    def policy_factory(name: str | None) -> RoutingPolicy:
        return make_policy(
            name or settings.routing,
            bounded_load_factor=settings.bounded_load_factor,
            ring_vnodes=settings.ring_vnodes,
        )

    registry = Registry(policy_factory)
    auth = ApiKeyAuth(settings.api_keys)
    async with (
        make_control_client(settings) as client,
        make_upstream_session(settings) as session,
        make_upstream_session(settings) as poll_session,
        contextlib.AsyncExitStack() as stack,
    ):
        proxy = Proxy(
            registry=registry, session=session, metrics=metrics, auth=auth, settings=settings
        )
        gateway = Gateway(settings, client, session, metrics, registry, auth, proxy)
        poller = LoadPoller(
            registry=registry,
            session=poll_session,
            metrics=metrics,
            interval_s=settings.load_poll_interval_s,
            timeout_s=settings.load_poll_timeout_s,
            backend_api_key=settings.backend_api_key,
            heard_max_age_s=settings.load_stale_after_s / 2,
        )
        proxy.hear_load_with(poller.heard_in_response)
        tasks = [
            asyncio.create_task(poller.run(), name="load poller"),
            asyncio.create_task(proxy.silence_watch().run(), name="upstream silence watch"),
        ]
        if settings.backends or settings.backends_file:
            static = StaticDiscovery(
                registry=registry,
                client=client,
                backends=settings.backends,
                backends_file=settings.backends_file,
                interval_s=settings.discovery_interval_s,
                timeout_s=settings.load_poll_timeout_s,
                backend_api_key=settings.backend_api_key,
            )
            gateway.synced.append(static.synced)
            tasks.append(asyncio.create_task(static.run(), name="static discovery"))
        if settings.k8s_namespace:
            source = await KubernetesSliceSource.connect()
            stack.push_async_callback(source.close)
            k8s = KubernetesDiscovery(
                registry=registry,
                source=source,
                client=client,
                timeout_s=settings.load_poll_timeout_s,
                backend_api_key=settings.backend_api_key,
            )
            stack.push_async_callback(k8s.close)
            if settings.k8s_service or settings.k8s_selector:
                selector = (
                    settings.k8s_selector or f"kubernetes.io/service-name={settings.k8s_service}"
                )
                k8s.add_pool(
                    K8sPoolSpec(
                        namespace=settings.k8s_namespace,
                        label_selector=selector,
                        model=settings.k8s_model,
                        port_name=settings.k8s_port_name,
                    )
                )
                gateway.synced.append(k8s.synced)
            if settings.k8s_llmservices:
                watcher = LLMServiceWatcher(
                    namespace=settings.k8s_namespace,
                    source=KubernetesLLMServiceSource(source.api_client),
                    discovery=k8s,
                )
                gateway.synced.append(watcher.synced)
                tasks.append(asyncio.create_task(watcher.run(), name="LLMService discovery"))
        for task in tasks:
            task.add_done_callback(_report_stopped)
        try:
            yield gateway
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            metrics.worker_exited()


def _report_stopped(task: asyncio.Task[None]) -> None:
    """A background task (poller, silence watch, discovery) that ended other than by the
    gateway's own shutdown: said loudly, since routing, ejection or timeouts stop with it."""
    if task.cancelled():
        return
    exc = task.exception()
    log.critical(
        "the gateway's %s stopped: %r; restart the gateway", task.get_name(), exc, exc_info=exc
    )


class ProxyFirst:
    """The ASGI app the gateway serves: the proxied paths go straight to the proxy, the rest
    to the FastAPI app.

    FastAPI's stack (error and exception middlewares, body limit, exit stack, the router's
    regex per route) wraps every request, and its receive and send, in a Python call per
    layer, every streamed chunk included: a tenth of the gateway's CPU at 2,000 streams
    (docs/profiles/gateway-proxy.md). The proxy answers its own errors and needs none of it.
    """

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in PROXIED_PATHS:
            await self.app.state.gateway.proxy(scope, receive, send)
        else:
            await self.app(scope, receive, send)


def from_environment() -> ProxyFirst:
    """The app of one worker of ``conveyor gateway --workers N`` (uvicorn's factory): the
    settings come as JSON in $CONVEYOR_GATEWAY_SETTINGS, set by the command."""
    import os

    from conveyor.gateway.cli import configure_logging
    from conveyor.gateway.settings import SETTINGS_ENV, settings_from_json

    settings = settings_from_json(os.environ[SETTINGS_ENV])
    configure_logging(settings)
    return ProxyFirst(build_app(settings))


class _ProxyRoute:
    """ASGI endpoint that hands the request to the running gateway's proxy."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await scope["app"].state.gateway.proxy(scope, receive, send)


async def http_error(request: Request, exc: Exception) -> Response:
    """A route or method the gateway does not have: an OpenAI error body, as the proxy's."""
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    message = str(exc.detail)
    if status == 404:
        message = f"no route {request.method} {request.url.path}; see GET /v1/models"
    elif status == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    return Response(
        error_json(status, message),
        status_code=status,
        media_type="application/json",
        headers=exc.headers,
    )


def build_app(settings: GatewaySettings) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with running_gateway(settings) as gateway:
            app.state.gateway = gateway
            log.info(
                "gateway listening on %s:%d, routing %s, %d API keys",
                settings.host, settings.port, settings.routing, len(settings.api_keys),
            )  # fmt: skip
            yield

    app = FastAPI(
        title="conveyor gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.add_exception_handler(StarletteHTTPException, http_error)
    for path in PROXIED_PATHS:
        app.router.routes.append(Route(path, _ProxyRoute(), methods=["POST"]))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        gateway: Gateway = request.app.state.gateway
        if all(event.is_set() for event in gateway.synced):
            return JSONResponse({"status": "ready", "models": gateway.registry.served_models()})
        return JSONResponse({"status": "discovering replicas"}, status_code=503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        gateway: Gateway = request.app.state.gateway
        return Response(gateway.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    def unauthorized(request: Request) -> Response | None:
        gateway: Gateway = request.app.state.gateway
        if gateway.auth.allows(request.headers.get("authorization", "").encode()):
            return None
        message = "missing or wrong API key: send the header 'Authorization: Bearer <key>'"
        body = error_json(401, message, code="invalid_api_key")
        return Response(
            body,
            status_code=401,
            media_type="application/json",
            headers={"WWW-Authenticate": "Bearer"},
        )

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        gateway: Gateway = request.app.state.gateway
        if (refused := unauthorized(request)) is not None:
            return refused
        models = gateway.registry.served_models()
        data = await asyncio.gather(*(model_card(gateway, model) for model in models))
        return JSONResponse({"object": "list", "data": list(data)})

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    async def stored_response(response_id: str, request: Request) -> Response:
        return await _on_holder(request, response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def stored_input_items(response_id: str, request: Request) -> Response:
        return await _on_holder(request, response_id, "/input_items")

    async def _on_holder(request: Request, response_id: str, suffix: str = "") -> Response:
        gateway: Gateway = request.app.state.gateway
        if (refused := unauthorized(request)) is not None:
            return refused
        headers = backend_headers(gateway.settings.backend_api_key)
        if (request_id := request.headers.get("x-request-id")) is not None:
            headers["x-request-id"] = request_id
        return await on_holder(
            gateway.registry, gateway.client, headers, request.method, response_id,
            request.url.query, gateway.settings.upstream_timeout_s, suffix,
        )  # fmt: skip

    @app.get("/debug/pools")
    async def pools(request: Request) -> Response:
        """Every pool's replicas and what the gateway knows of them (for people and tests)."""
        gateway: Gateway = request.app.state.gateway
        if (refused := unauthorized(request)) is not None:
            return refused
        now = asyncio.get_running_loop().time()
        stale = gateway.settings.load_stale_after_s
        return JSONResponse({
            model: {
                "policy": pool.policy.name,
                "replicas": [
                    {
                        "url": r.url,
                        "admitted": r.admitted(now),
                        "load_known": r.load_known(now, stale),
                        "in_flight": r.in_flight,
                        "load": None if r.load is None else vars(r.load),
                    }
                    for r in pool.replicas.values()
                ],
            }
            for model, pool in gateway.registry.pools.items()
        })  # fmt: skip

    return app
