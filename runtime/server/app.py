"""The FastAPI app of one runtime replica: routes, admission, and the lifespan that builds
the engine client, the metrics and the tokenizer pool and hands them to the handlers.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conveyor.contracts.load import LOAD_HEADER, ReplicaLoad
from conveyor.runtime.server.chat_template import use_chat_template
from conveyor.runtime.server.context import Drain, ServerContext
from conveyor.runtime.server.engine_client import EngineClient, EngineDeadError
from conveyor.runtime.server.errors import (
    UNAUTHORIZED,
    UNAVAILABLE,
    APIError,
    api_error_handler,
    draining,
    http_error_handler,
    internal_error_handler,
    validation_error_handler,
)
from conveyor.runtime.server.metrics import ServerMetrics
from conveyor.runtime.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from conveyor.runtime.server.response_store import ResponseStore
from conveyor.runtime.server.responses_protocol import ResponsesRequest
from conveyor.runtime.server.serving_chat import create_chat_completion
from conveyor.runtime.server.serving_completions import create_completion
from conveyor.runtime.server.serving_lora import (
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    load_lora_adapter,
    unload_lora_adapter,
)
from conveyor.runtime.server.serving_responses import (
    create_response,
    delete_response,
    get_response,
    list_input_items,
)
from conveyor.runtime.server.serving_tokenize import create_detokenize, create_tokenize
from conveyor.runtime.server.settings import ServerSettings

if TYPE_CHECKING:
    from conveyor.runtime.engine.llm_engine import LLMEngine

logger = logging.getLogger("conveyor.runtime.server")

LOAD_HEADER_BYTES = LOAD_HEADER.encode()
TOKENIZER_THREADS = 2
"""Tokenising threads: the fast tokenizer releases the GIL, and two keep one long prompt
from delaying every short one behind it."""
GRAMMAR_THREADS = 2
"""Grammar compiling threads: two keep one large schema from delaying every cached one."""


def default_engine_factory(
    settings: ServerSettings, timings: dict[str, float] | None = None
) -> Callable[[], LLMEngine]:
    """Builds the engine on the engine thread; ``timings`` gets the seconds of each start-up
    step, for the log line ``log_ready`` writes."""

    def build() -> LLMEngine:
        started = time.monotonic()
        from conveyor.runtime.engine.llm_engine import LLMEngine
        from conveyor.runtime.model.loader import LOAD_TIMES

        imported = time.monotonic()
        LOAD_TIMES.clear()
        engine = LLMEngine(settings.engine, on_progress=logging.getLogger("conveyor.runtime").info)
        if settings.chat_template is not None:
            try:
                use_chat_template(engine, settings.chat_template)
            except ValueError:
                engine.close()
                raise
        if timings is not None:
            timings["engine imports"] = imported - started
            timings.update(LOAD_TIMES)
            timings["engine set-up"] = time.monotonic() - imported - sum(LOAD_TIMES.values())
            if (age := process_age()) is not None:
                timings["process start"] = age - (time.monotonic() - started)
        return engine

    return build


def process_age() -> float | None:
    """Seconds since this process was exec'd (Linux: /proc); None where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


STARTUP_STEPS = (
    ("process start", "process start (interpreter + server imports)"),
    ("engine imports", "engine imports (torch)"),
    ("resolve", "model resolve"),
    ("config", "config"),
    ("tokenizer", "tokenizer"),
    ("weights", "weights"),
    ("engine set-up", "engine set-up (runner + KV cache)"),
)
"""(key in the timings, what the start-up line calls it), in the order they happen."""


def startup_line(total: float | None, timings: dict[str, float], cpu: float | None = None) -> str:
    """``ready in 9.1 s (CPU 7.9 s): process start (...) 2.0 s, engine imports (torch) 3.1 s,
    ...``. The process's CPU seconds (all threads) beside the wall seconds tell a start slowed
    by a busy node or a CPU limit (wall far above CPU) from one that did more work."""
    steps = ", ".join(
        f"{label} {timings[key]:.1f} s" for key, label in STARTUP_STEPS if key in timings
    )
    head = f"ready in {total:.1f} s" if total is not None else "ready"
    if cpu is not None:
        head += f" (CPU {cpu:.1f} s)"
    return f"{head}: {steps}" if steps else head


async def log_ready(client: EngineClient, timings: dict[str, float]) -> None:
    """One line once the engine is loaded: how long since exec and where the time went."""
    try:
        await client.wait_loaded()
    except EngineDeadError:
        return
    logger.info("%s", startup_line(process_age(), timings, time.process_time()))


def build_app(
    settings: ServerSettings,
    *,
    drain: Drain | None = None,
    engine_factory: Callable[[], LLMEngine] | None = None,
) -> FastAPI:
    """The app; ``drain`` is shared with whoever handles SIGTERM (``cli.serve``)."""
    drain = drain or Drain()
    timings: dict[str, float] = {}
    factory = engine_factory or default_engine_factory(settings, timings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        metrics = ServerMetrics(settings.model_name, vllm_names=settings.vllm_metrics)
        client = EngineClient(factory, metrics)
        metrics.track_engine(client.snapshot)
        pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="conveyor-tokenize")
        grammar_pool = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="conveyor-grammar")
        ctx = ServerContext(
            settings=settings,
            client=client,
            metrics=metrics,
            drain=drain,
            tokenize_pool=pool,
            grammar_pool=grammar_pool,
            responses=ResponseStore(int(settings.responses_store_mb * 2**20)),
            loras={m.name: m.path for m in settings.engine.lora_modules},
        )
        client.start()
        stats_log = (
            asyncio.create_task(log_stats(client, settings.log_stats_interval))
            if settings.log_stats_interval
            else None
        )
        grammars = asyncio.create_task(prepare_grammars(client, grammar_pool))
        ready_log = asyncio.create_task(log_ready(client, timings))
        try:
            yield {"ctx": ctx}
        finally:
            if stats_log is not None:
                stats_log.cancel()
            grammars.cancel()
            ready_log.cancel()
            await client.shutdown()
            pool.shutdown(wait=False, cancel_futures=True)
            grammar_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="Conveyor runtime", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(Exception, internal_error_handler)
    app.add_middleware(AdmissionMiddleware, settings=settings, drain=drain)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(request.state.ctx, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(request.state.ctx, body, request)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await create_response(request.state.ctx, body, request)

    @app.get("/v1/responses/{response_id}")
    async def read_response(response_id: str, request: Request) -> Response:
        return get_response(request.state.ctx, response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(
        response_id: str,
        request: Request,
        after: Annotated[str | None, Query(description="list the items after this id")] = None,
        before: Annotated[str | None, Query(description="list the items before this id")] = None,
        limit: Annotated[int, Query(ge=1, le=100, description="items per page")] = 20,
        order: Annotated[Literal["asc", "desc"], Query(description="desc: newest first")] = "desc",
        include: Annotated[list[str] | None, Query(description="accepted; adds nothing")] = None,
    ) -> dict[str, Any]:
        return list_input_items(request.state.ctx, response_id, after, before, limit, order)

    @app.delete("/v1/responses/{response_id}")
    async def remove_response(response_id: str, request: Request) -> dict[str, Any]:
        return delete_response(request.state.ctx, response_id)

    if settings.allow_runtime_lora_updating:

        @app.post("/v1/load_lora_adapter")
        async def load_lora(body: LoadLoRAAdapterRequest, request: Request) -> Response:
            return await load_lora_adapter(request.state.ctx, body)

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora(body: UnloadLoRAAdapterRequest, request: Request) -> Response:
            return await unload_lora_adapter(request.state.ctx, body)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
        return await create_tokenize(request.state.ctx, body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
        return await create_detokenize(request.state.ctx, body)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        ctx: ServerContext = request.state.ctx
        engine = ctx.client.engine
        card: dict[str, Any] = {
            "id": ctx.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "conveyor",
            "root": settings.engine.model,
            "parent": None,  # as vLLM lists a base model beside its adapters
        }
        if engine is not None:
            card["max_model_len"] = engine.max_model_len
        # LoRA adapters as vLLM lists them: the folder as root, the base model as parent.
        adapters = [
            {**card, "id": name, "root": path, "parent": ctx.model_name}
            for name, path in ctx.loras.items()
        ]
        return {"object": "list", "data": [card, *adapters]}

    @app.get("/health")
    async def health(request: Request) -> Response:
        ctx: ServerContext = request.state.ctx
        if ctx.client.alive:
            return JSONResponse({"status": "ok", "loaded": ctx.client.loaded})
        return APIError(
            UNAVAILABLE, f"the engine loop is not running: {ctx.client.error!r}", code="engine_dead"
        ).response()

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        ctx: ServerContext = request.state.ctx
        if ctx.ready:
            return JSONResponse({"status": "ready"})
        reason = (
            "draining"
            if ctx.drain.draining
            else "engine failed"
            if ctx.client.error is not None
            else "loading"
        )
        return APIError(
            UNAVAILABLE,
            f"not ready: {reason}",
            code=reason.replace(" ", "_"),
            headers={"Retry-After": str(settings.retry_after)},
        ).response()

    @app.get("/load")
    async def load(request: Request) -> dict[str, Any]:
        return load_report(request.state.ctx).to_json()

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        ctx: ServerContext = request.state.ctx
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def load_report(ctx: ServerContext) -> ReplicaLoad:
    """The replica's load now: the ``/load`` document, and the ``x-conveyor-load`` header."""
    snap = ctx.client.snapshot()
    return ReplicaLoad(
        running=snap.num_running,
        waiting=snap.num_waiting,
        kv_cache_usage=snap.kv_cache_usage,
        max_running_requests=snap.max_running_requests or ctx.settings.engine.max_running_requests,
        max_queued_requests=ctx.settings.max_queued_requests,
        ready=ctx.ready,
        model=ctx.model_name,
        in_flight=ctx.drain.in_flight,
        steps=snap.steps,
    )


async def prepare_grammars(client: EngineClient, pool: ThreadPoolExecutor) -> None:
    """Once the model is loaded, index its vocabulary for structured outputs on the grammar
    pool, so the first constrained request does not wait a second for it."""
    try:
        await client.wait_loaded()
    except EngineDeadError:
        return  # /health and /ready report it
    assert client.engine is not None
    try:
        await asyncio.get_running_loop().run_in_executor(
            pool, client.engine.structured_outputs.prepare
        )
    except (ImportError, RuntimeError, ValueError, TypeError) as exc:
        # Requests with a grammar get a 400 that says so; everything else is served.
        logger.warning("structured outputs are not available: %s", exc)


async def log_stats(client: EngineClient, interval: float) -> None:
    """Every ``interval`` seconds while anything happens: one line on what the engine did."""
    last = client.snapshot()
    while True:
        await asyncio.sleep(interval)  # a periodic report, not synchronisation
        snap = client.snapshot()
        busy = snap.num_running or snap.num_waiting
        if not busy and snap.generation_tokens == last.generation_tokens:
            continue
        queries = snap.prefix_cache_queries - last.prefix_cache_queries
        hits = snap.prefix_cache_hits - last.prefix_cache_hits
        logger.info(
            "running %d, waiting %d, KV cache %.1f%%, prompt %.1f tok/s, generation %.1f tok/s, "
            "prefix-cache hits %.1f%%, preemptions %d",
            snap.num_running,
            snap.num_waiting,
            100 * snap.kv_cache_usage,
            (snap.prompt_tokens - last.prompt_tokens) / interval,
            (snap.generation_tokens - last.generation_tokens) / interval,
            100 * hits / queries if queries else 0.0,
            snap.preemptions - last.preemptions,
        )
        last = snap


class AdmissionMiddleware:
    """Before any body is read on ``/v1/*``: the API key (401), and while draining 503.

    Also counts in-flight API requests for the drain; a streamed response counts until
    its last byte; and says the replica's load in each response's head (``LOAD_HEADER``),
    so that a gateway need not poll ``/load`` while it sends traffic. Plain ASGI: the body
    passes through untouched.
    """

    def __init__(self, app: ASGIApp, *, settings: ServerSettings, drain: Drain) -> None:
        self.app = app
        self.drain = drain
        self.retry_after = settings.retry_after
        self.expected = f"Bearer {settings.api_key}".encode() if settings.api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        if self.expected is not None and not self._authorized(scope):
            err = APIError(
                UNAUTHORIZED,
                "missing or wrong API key; send `Authorization: Bearer KEY` "
                "with the key this server was started with",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await err.response()(scope, receive, send)
            return
        if self.drain.draining and scope["method"] == "POST":
            await draining(self.retry_after).response()(scope, receive, send)
            return
        self.drain.enter()
        ctx: ServerContext | None = scope.get("state", {}).get("ctx")

        async def send_with_load(message: Message) -> None:
            if message["type"] == "http.response.start" and ctx is not None:
                headers = [
                    *message.get("headers", ()),
                    (LOAD_HEADER_BYTES, load_report(ctx).to_header()),
                ]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_load)
        finally:
            self.drain.exit()

    def _authorized(self, scope: Scope) -> bool:
        assert self.expected is not None
        for name, value in scope["headers"]:
            if name == b"authorization":
                return hmac.compare_digest(value, self.expected)
        return False
