"""The engine on its own thread, behind a narrow asyncio interface: submit, stream, abort.

The asyncio event loop never waits on the model. Requests and aborts enter the engine
thread through a queue; after each step the thread hands that step's outputs, its stats
and its timing back to the loop with one ``call_soon_threadsafe``. Tokenising and
detokenising happen on the asyncio side (``serving_common.py``, ``choices.py``), never inside
a step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import xgrammar

    from conveyor.runtime.engine.bad_words import BadWords
    from conveyor.runtime.engine.llm_engine import LLMEngine
    from conveyor.runtime.engine.outputs import EngineStats, RequestOutput
    from conveyor.runtime.sampling_params import SamplingParams
    from conveyor.runtime.server.metrics import ServerMetrics

logger = logging.getLogger("conveyor.runtime.server")


class EngineDeadError(RuntimeError):
    """The engine thread stopped (a failed load or an exception in a step)."""


@dataclass(frozen=True)
class EngineSnapshot:
    """What the engine looked like after its latest step (read by /load and /metrics)."""

    num_running: int = 0
    num_waiting: int = 0
    """Queue depth: the engine's waiting requests plus those submitted but not yet seen by it."""
    kv_cache_usage: float = 0.0
    max_running_requests: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    """Engine steps taken since the server started."""
    max_loras: int = 0
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    """LoRA slots, and the adapters of running and waiting requests (``EngineStats``)."""


@dataclass
class _Request:
    """Asyncio-side state of one engine request."""

    outputs: asyncio.Queue[RequestOutput | BaseException]
    """Shared by the requests of one API call (its ``n`` choices)."""
    last_token_time: float | None = None
    finish_reason: str | None = None
    """Set when the server ends the request itself (a stop string): reported instead of abort."""
    aborted: bool = False


@dataclass(frozen=True)
class EngineRequest:
    """One request for the engine: already tokenised and checked."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    """``time.monotonic()`` when the API call arrived, so queue time and TTFT include tokenising."""
    grammar: xgrammar.CompiledGrammar | None = None
    """``params.structured_output``, compiled off the engine thread."""
    priority: int = 0
    """Lower runs sooner under ``--scheduling-policy priority``; checked with the request."""
    cache_salt: str | None = None
    """Prefix-cache blocks are shared only between requests with the same salt."""
    bad_words: BadWords | None = None
    """``params.bad_words`` as tokens, made off the engine thread."""
    lora: str | None = None
    """The LoRA adapter it runs with (the request's ``model``); None: the base model."""


@dataclass(frozen=True)
class _Call:
    """To the engine thread: run ``fn(engine)`` between two steps; its result, or its
    ``ValueError``, settles ``future`` on the event loop."""

    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future[Any]


@dataclass(frozen=True)
class _Abort:
    """To the engine thread: drop this request."""

    request_id: str


class _Stop:
    """To the engine thread: stop after the current step."""


_STOP = _Stop()


class EngineClient:
    """Owns the engine thread. Build it, ``start()`` it inside the event loop, ``shutdown()``."""

    def __init__(
        self, engine_factory: Callable[[], LLMEngine], metrics: ServerMetrics | None = None
    ) -> None:
        self._factory = engine_factory
        self._metrics = metrics
        self._inbox: queue.SimpleQueue[EngineRequest | _Abort | _Call | _Stop] = queue.SimpleQueue()
        """Requests, aborts and ``_STOP``, for the engine thread."""
        self._requests: dict[str, _Request] = {}
        self._calls: set[asyncio.Future[Any]] = set()
        """``call``s the engine thread has not answered yet (failed if it stops first)."""
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stats: EngineStats | None = None
        self._steps = 0
        """The engine's stats after its latest step."""
        self._loaded = asyncio.Event()
        self._dead = asyncio.Event()
        self.engine: LLMEngine | None = None
        """Set once loaded; only its constants (tokenizer, limits, check_request) are used here."""
        self.error: BaseException | None = None

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread, which loads the model and then runs the step loop."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="conveyor-engine", daemon=True)
        self._thread.start()

    async def wait_loaded(self) -> None:
        await self._loaded.wait()
        if self.error is not None:
            raise EngineDeadError(f"engine failed: {self.error!r}") from self.error

    async def wait_dead(self) -> BaseException | None:
        """Return once the engine thread has failed (its error)."""
        await self._dead.wait()
        return self.error

    @property
    def loaded(self) -> bool:
        return self.engine is not None and self.error is None

    @property
    def alive(self) -> bool:
        """The engine thread runs (loading or stepping) and has not failed."""
        return self._thread is not None and self._thread.is_alive() and self.error is None

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop after the current step and fail whatever is still in flight."""
        if self._thread is None:
            return
        self._inbox.put(_STOP)
        await asyncio.to_thread(self._thread.join, timeout)
        self._fail_all(EngineDeadError("the server is shutting down"))

    # -- requests ----------------------------------------------------------------------

    @property
    def num_requests(self) -> int:
        """Requests submitted and not yet finished by the engine."""
        return len(self._requests)

    def snapshot(self) -> EngineSnapshot:
        s = self._stats
        if s is None:
            return EngineSnapshot(num_waiting=len(self._requests))
        return EngineSnapshot(
            num_running=s.num_running,
            # Requests not yet seen by the engine count as waiting at once, so a burst
            # between two steps is visible to /load and to --max-queued-requests.
            num_waiting=max(s.num_waiting, len(self._requests) - s.num_running),
            kv_cache_usage=s.kv_cache_usage,
            max_running_requests=s.max_running_requests,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            prompt_tokens=s.prompt_tokens,
            generation_tokens=s.generation_tokens,
            preemptions=s.preemptions,
            steps=self._steps,
            max_loras=s.max_loras,
            running_loras=s.running_loras,
            waiting_loras=s.waiting_loras,
        )

    def submit(self, requests: list[EngineRequest]) -> OutputStream:
        """Submit requests (the choices of one API call) now; iterate the returned stream
        for their outputs. Synchronous on purpose: admission control counts a request the
        moment it is admitted, with no ``await`` in between.
        """
        if self.error is not None or self._thread is None:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        for r in requests:
            if r.request_id in self._requests:
                raise ValueError(f"request id {r.request_id!r} is already in flight")
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        for r in requests:
            self._requests[r.request_id] = _Request(outputs)
            self._inbox.put(r)
        return OutputStream(self, outputs, {r.request_id for r in requests})

    def abort(self, request_id: str, finish_reason: str | None = None) -> None:
        """Ask the engine to drop a request; ``finish_reason`` is what metrics record for it."""
        state = self._requests.get(request_id)
        if state is None or state.aborted:
            return
        state.aborted = True
        state.finish_reason = finish_reason
        self._inbox.put(_Abort(request_id))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """``fn(engine)`` on the engine thread, between two steps (a LoRA load or unload)."""
        if self.error is not None or self._thread is None:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        assert self._loop is not None
        future: asyncio.Future[Any] = self._loop.create_future()
        self._calls.add(future)
        future.add_done_callback(self._calls.discard)
        self._inbox.put(_Call(fn, future))
        return await future

    # -- the asyncio side of a step ----------------------------------------------------

    def _on_step(
        self, outputs: list[RequestOutput], stats: EngineStats, start: float, end: float
    ) -> None:
        self._stats = stats
        self._steps += 1
        m = self._metrics
        if m is not None:
            m.step_duration.observe(end - start)
        for out in outputs:
            state = self._requests.get(out.request_id)
            if state is None:
                continue
            if m is not None and out.new_token_ids:
                if state.last_token_time is not None:
                    m.itl.observe(end - state.last_token_time)
                state.last_token_time = end
            state.outputs.put_nowait(out)
            if out.finished:
                del self._requests[out.request_id]
                if m is not None:
                    self._observe_finished(
                        m, out, state.finish_reason or out.finish_reason or "abort"
                    )

    @staticmethod
    def _observe_finished(m: ServerMetrics, out: RequestOutput, reason: str) -> None:
        m.request_finished(reason)
        if out.finish_time is None:
            return
        m.e2e.observe(out.finish_time - out.arrival_time)
        if out.first_scheduled_time is not None:
            m.queue_time.observe(out.first_scheduled_time - out.arrival_time)
        if out.first_token_time is not None:
            m.ttft.observe(out.first_token_time - out.arrival_time)
            n = len(out.output_token_ids)
            if n > 1:
                m.tpot.observe((out.finish_time - out.first_token_time) / (n - 1))

    def _on_loaded(self, engine: LLMEngine, stats: EngineStats) -> None:
        self.engine = engine
        self._stats = stats
        self._loaded.set()

    def _on_request_error(self, request_id: str, error: BaseException) -> None:
        state = self._requests.pop(request_id, None)
        if state is not None:
            state.outputs.put_nowait(error)

    def _on_dead(self, error: BaseException) -> None:
        self.error = error
        self._loaded.set()
        self._dead.set()
        self._fail_all(EngineDeadError(f"engine failed: {error!r}"))

    def _fail_all(self, error: BaseException) -> None:
        for state in self._requests.values():
            state.outputs.put_nowait(error)
        self._requests.clear()
        for future in list(self._calls):
            _settle(future, None, error)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        # A closed loop means the process is exiting: nobody is left to tell.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(fn, *args)

    # -- the engine thread -------------------------------------------------------------

    def _run(self) -> None:
        try:
            engine = self._factory()
        except ValueError as exc:
            # A model or setting that cannot work: the message says what to change, and a
            # traceback would only bury it.
            logger.error("cannot start the engine: %s", exc)
            self._post(self._on_dead, exc)
            return
        except BaseException as exc:
            logger.exception("engine failed to load")
            self._post(self._on_dead, exc)
            return
        try:
            self._post(self._on_loaded, engine, engine.stats())
            engine.on_rank_failure(self._on_rank_failure)
            self._loop_steps(engine)
        except BaseException as exc:
            logger.exception("engine thread failed")
            self._post(self._on_dead, exc)
        finally:
            engine.close()  # a tensor-parallel engine's other ranks stop with it

    def _on_rank_failure(self, error: BaseException) -> None:
        """A tensor-parallel rank died between steps (on its watcher thread): the engine is
        dead now, and its thread leaves the loop."""
        self._post(self._on_dead, error)
        self._inbox.put(_STOP)

    def _loop_steps(self, engine: LLMEngine) -> None:
        inbox = self._inbox
        while True:
            # Idle: block until something arrives. Busy: take whatever is there, then step.
            msgs = [inbox.get()] if not engine.has_unfinished_requests() else []
            while True:
                try:
                    msgs.append(inbox.get_nowait())
                except queue.Empty:
                    break
            aborted = False
            for msg in msgs:
                if isinstance(msg, _Stop):
                    return
                if isinstance(msg, _Abort):
                    engine.abort_request(msg.request_id)
                    aborted = True
                    continue
                if isinstance(msg, _Call):
                    try:
                        result = msg.fn(engine)
                    except ValueError as exc:  # refused: the engine is as it was
                        self._post(_settle, msg.future, None, exc)
                    except BaseException as exc:  # the engine dies of it: say so to the caller
                        self._post(_settle, msg.future, None, exc)
                        raise
                    else:
                        self._post(_settle, msg.future, result, None)
                    continue
                try:
                    engine.add_request(
                        msg.request_id,
                        msg.prompt_token_ids,
                        msg.params,
                        arrival_time=msg.arrival_time,
                        grammar=msg.grammar,
                        priority=msg.priority,
                        cache_salt=msg.cache_salt,
                        bad_words=msg.bad_words,
                        lora=msg.lora,
                    )
                except ValueError as exc:
                    # Checked before submit; kept so that one bad request cannot end the loop.
                    self._post(self._on_request_error, msg.request_id, exc)
            if not (engine.has_unfinished_requests() or aborted):
                continue
            start = time.monotonic()
            outputs = engine.step()
            end = time.monotonic()
            self._post(self._on_step, outputs, engine.stats(), start, end)


class OutputStream:
    """The outputs of submitted requests, interleaved as steps produce them, until every one
    has finished. ``close()`` (idempotent) aborts whatever is still running: call it in a
    ``finally`` so a client that goes away frees its KV blocks at the next step.
    """

    def __init__(
        self,
        client: EngineClient,
        outputs: asyncio.Queue[RequestOutput | BaseException],
        live: set[str],
    ) -> None:
        self._client = client
        self._outputs = outputs
        self._live = live

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._live:
            raise StopAsyncIteration
        out = await self._outputs.get()
        if isinstance(out, BaseException):
            self._live.clear()
            raise out
        if out.finished:
            self._live.discard(out.request_id)
        return out

    def close(self) -> None:
        for request_id in self._live:
            self._client.abort(request_id)
        self._live.clear()


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # its caller went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
