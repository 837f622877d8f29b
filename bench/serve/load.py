"""``conveyor bench serve --url URL``: an HTTP load generator for a replica or a gateway.

In the spirit of SGLang's bench_serving: closed-loop concurrency or open-loop Poisson
arrivals, synthetic workloads (prompt and output length distributions, optional shared
prefixes), streamed requests timed chunk by chunk. Prints a table and writes JSON of TTFT,
TPOT, ITL and end-to-end latency (mean, p50/p95/p99), request and token throughput, and
errors by kind. Torch-free: only httpx (and tqdm, matplotlib when asked).

Prompts are token id lists sent to ``/v1/completions`` by default, so their lengths are
exact whatever the model; ``--endpoint chat`` sends text of about that many characters.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from conveyor.bench.serve.summary import RequestResult, scrape_metrics, server_delta, summarize
from conveyor.bench.serve.workload import BenchRequest, WorkloadSettings, build_workload


@dataclass(frozen=True)
class BenchSettings:
    """Where to send the load and how fast."""

    url: str = "http://127.0.0.1:8000"
    """Base URL of a runtime replica or a gateway."""
    endpoint: str = "completions"
    """``completions`` (token id prompts, exact lengths) or ``chat``."""
    model: str | None = None
    """Model name in each request; default: the first of the server's /v1/models."""
    concurrency: int | None = 64
    """Closed loop: this many requests in flight at all times. Ignored with request_rate."""
    request_rate: float | None = None
    """Open loop: Poisson arrivals at this many requests per second."""
    max_concurrency: int | None = None
    """Open loop: cap on requests in flight (arrivals wait for a slot)."""
    api_key: str | None = field(default=None, repr=False)
    """Sent as a bearer token."""
    temperature: float = 0.0
    """Sampling temperature of every request (0 = greedy)."""
    timeout: float = 600.0
    """Seconds before one request counts as a timeout error."""
    progress: bool = True
    """Show a tqdm progress bar on stderr."""
    warmup: int = 2
    """Short requests sent (one at a time) before the run, outside its figures."""
    scrape_metrics: bool = True
    """Read the server's /metrics before and after, for prefix-cache and step figures."""
    workload: WorkloadSettings = field(default_factory=WorkloadSettings)


def _payload(s: BenchSettings, model: str, r: BenchRequest, index: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": r.max_tokens,
        "temperature": s.temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "seed": s.workload.seed + index,
    }
    if s.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": r.prompt}]
    else:
        body["prompt"] = r.prompt
    return body


async def send(
    http: httpx.AsyncClient, path: str, payload: dict[str, Any], t0: float
) -> RequestResult:
    """One streamed request, timed chunk by chunk (relative to ``t0``)."""
    res = RequestResult(start=time.perf_counter() - t0)
    done = False
    try:
        async with http.stream("POST", path, json=payload) as resp:
            if resp.status_code != 200:
                await resp.aread()
                res.error = f"http_{resp.status_code}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = "stream_error"
                    return res
                now = time.perf_counter() - t0
                for choice in chunk.get("choices") or ():
                    # A chunk per step that made tokens (text may still be empty, e.g. half a
                    # character); the chat role chunk has no content key and does not count.
                    text = choice.get("text")
                    delta = choice.get("delta") or {}
                    if text is None and "role" not in delta:
                        text = delta.get("content")
                    if text is not None and (text or choice.get("finish_reason") is None):
                        if res.ttft is None:
                            res.ttft = now - res.start
                        res.chunk_times.append(now)
                usage = chunk.get("usage")
                if usage:
                    res.prompt_tokens = usage.get("prompt_tokens", 0)
                    res.output_tokens = usage.get("completion_tokens", 0)
    except httpx.TimeoutException:
        res.error = "timeout"
        return res
    except httpx.TransportError as exc:
        res.error = f"connection_error:{type(exc).__name__}"
        return res
    if not done:
        res.error = "incomplete_stream"
        return res
    res.e2e = time.perf_counter() - t0 - res.start
    res.ok = True
    return res


async def run(
    settings: BenchSettings, requests: list[BenchRequest] | None = None
) -> dict[str, Any]:
    """Run the workload against ``settings.url``; the summary (what ``--json`` writes)."""
    requests = (
        requests if requests is not None else build_workload(settings.workload, settings.endpoint)
    )
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    in_flight = settings.max_concurrency if settings.request_rate else settings.concurrency
    limits = httpx.Limits(
        max_connections=max(100, (in_flight or len(requests)) + 10),
        max_keepalive_connections=max(100, (in_flight or len(requests)) + 10),
    )
    path = "/v1/chat/completions" if settings.endpoint == "chat" else "/v1/completions"
    async with httpx.AsyncClient(
        base_url=settings.url,
        headers=headers,
        limits=limits,
        timeout=httpx.Timeout(settings.timeout, connect=30.0),
    ) as http:
        model = settings.model or await _first_model(http)
        for i in range(
            settings.warmup
        ):  # first steps allocate and warm caches: not part of the run
            warm = BenchRequest(
                prompt=requests[i % len(requests)].prompt, prompt_len=0, max_tokens=4
            )
            await send(http, path, _payload(settings, model, warm, -1 - i), time.perf_counter())
        before = await scrape_metrics(http) if settings.scrape_metrics else None
        bar = _progress(len(requests), settings.progress)
        results: list[RequestResult | None] = [None] * len(requests)
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            results[i] = await send(http, path, _payload(settings, model, requests[i], i), t0)
            if bar is not None:
                bar.update(1)

        if settings.request_rate:
            await _open_loop(settings, len(requests), one)
        else:
            await _closed_loop(settings.concurrency or len(requests), len(requests), one)
        duration = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        after = await scrape_metrics(http) if settings.scrape_metrics else None
    done = [r for r in results if r is not None]
    summary = summarize(done, duration)
    summary.update(
        {
            "url": settings.url,
            "endpoint": settings.endpoint,
            "model": model,
            "concurrency": None if settings.request_rate else settings.concurrency,
            "request_rate": settings.request_rate,
            "max_concurrency": settings.max_concurrency,
            "workload": asdict(settings.workload),
        }
    )
    if before is not None and after is not None:
        summary["server"] = server_delta(before, after)
    summary["_results"] = done
    return summary


async def _closed_loop(concurrency: int, n: int, one: Any) -> None:
    next_index = iter(range(n))

    async def worker() -> None:
        for i in next_index:
            await one(i)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, n))))


async def _open_loop(settings: BenchSettings, n: int, one: Any) -> None:
    rng = random.Random(settings.workload.seed + 1)
    gate = asyncio.Semaphore(settings.max_concurrency) if settings.max_concurrency else None

    async def gated(i: int) -> None:
        if gate is None:
            await one(i)
            return
        async with gate:
            await one(i)

    tasks = []
    assert settings.request_rate
    for i in range(n):
        tasks.append(asyncio.create_task(gated(i)))
        await asyncio.sleep(rng.expovariate(settings.request_rate))  # the arrival process itself
    await asyncio.gather(*tasks)


async def _first_model(http: httpx.AsyncClient) -> str:
    r = await http.get("/v1/models")
    if r.status_code != 200:
        raise SystemExit(
            f"GET /v1/models answered {r.status_code}: {r.text[:200]}; pass --model or --api-key"
        )
    return r.json()["data"][0]["id"]


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", file=sys.stderr, dynamic_ncols=True)
