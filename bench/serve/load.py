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

import argparse
import asyncio
import itertools
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from conveyor.runtime import metrics_names as names

PERCENTILES = (50, 95, 99)


@dataclass(frozen=True)
class WorkloadSettings:
    """The synthetic requests: the same seed gives the same requests."""

    num_requests: int = 128
    """Requests in the run."""
    input_len_min: int = 32
    """Shortest prompt (tokens), not counting a shared prefix."""
    input_len_max: int = 128
    """Longest prompt (tokens); lengths are uniform in [min, max]."""
    output_len_mean: int = 64
    """Mean output length (tokens), sent as max_tokens with ignore_eos."""
    output_len_max: int = 256
    """Cap on output length (tokens)."""
    output_len_dist: str = "exponential"
    """``exponential`` (a long tail, as real traffic), ``uniform`` in [1, 2*mean], or ``fixed``."""
    shared_prefix_len: int = 0
    """Tokens of a prefix shared by every request of a group (a system prompt); 0 = none."""
    num_prefix_groups: int = 1
    """How many distinct shared prefixes; requests are spread over them round-robin."""
    token_id_min: int = 32
    """Prompt token ids are drawn from [min, max): valid in any vocabulary of 256 or more."""
    token_id_max: int = 127
    seed: int = 0
    """Seeds the workload and, per request, the sampling."""


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


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int] | str
    prompt_len: int
    max_tokens: int


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    start: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)
    """Arrival time of every chunk that carried text, relative to the run's start."""

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


# -- workload ------------------------------------------------------------------------


def build_workload(w: WorkloadSettings, endpoint: str) -> list[BenchRequest]:
    rng = random.Random(w.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(w.token_id_min, w.token_id_max) for _ in range(n)]

    prefixes = [ids(w.shared_prefix_len) for _ in range(max(1, w.num_prefix_groups))]
    requests = []
    for i in range(w.num_requests):
        body = ids(rng.randint(w.input_len_min, w.input_len_max))
        prompt = (prefixes[i % len(prefixes)] + body) if w.shared_prefix_len else body
        requests.append(
            BenchRequest(
                prompt=prompt if endpoint == "completions" else _as_text(prompt),
                prompt_len=len(prompt),
                max_tokens=_output_len(rng, w),
            )
        )
    return requests


def _as_text(ids: list[int]) -> str:
    # Printable characters from the ids: about one token per character on a byte-level
    # tokenizer; the server's usage reports the true count.
    return "".join(chr(32 + (t % 95)) for t in ids)


def _output_len(rng: random.Random, w: WorkloadSettings) -> int:
    if w.output_len_dist == "fixed":
        n = w.output_len_mean
    elif w.output_len_dist == "uniform":
        n = rng.randint(1, 2 * w.output_len_mean)
    elif w.output_len_dist == "exponential":
        n = math.ceil(rng.expovariate(1.0 / w.output_len_mean))
    else:
        raise ValueError(
            f"output_len_dist must be fixed, uniform or exponential; got {w.output_len_dist!r}"
        )
    return max(1, min(n, w.output_len_max))


# -- one request ---------------------------------------------------------------------


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


# -- the run -------------------------------------------------------------------------


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
        before = await _scrape(http) if settings.scrape_metrics else None
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
        after = await _scrape(http) if settings.scrape_metrics else None
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


# -- figures -------------------------------------------------------------------------


def percentile(values: list[float], p: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), or None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _describe(prefix: str, values: list[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {f"{prefix}_mean": sum(values) / len(values) if values else None}
    for p in PERCENTILES:
        out[f"{prefix}_p{p}"] = percentile(values, p)
    return out


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "num_requests": len(results),
        "completed": len(ok),
        "errors": errors,
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "input_throughput": prompt_tokens / duration if duration else 0.0,
        "output_throughput": output_tokens / duration if duration else 0.0,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration if duration else 0.0,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
    }
    summary.update(_describe("ttft", [r.ttft for r in ok if r.ttft is not None]))
    summary.update(_describe("tpot", [t for r in ok if (t := r.tpot) is not None]))
    summary.update(_describe("itl", [x for r in ok for x in r.itls]))
    summary.update(_describe("e2e", [r.e2e for r in ok if r.e2e is not None]))
    return summary


async def _scrape(http: httpx.AsyncClient) -> dict[str, float] | None:
    """The server's counters (a runtime replica's; a gateway has none of these)."""
    try:
        r = await http.get("/metrics")
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {
        names.PREFIX_CACHE_QUERIES,
        names.PREFIX_CACHE_HITS,
        names.NUM_PREEMPTIONS,
        names.PROMPT_TOKENS,
        names.GENERATION_TOKENS,
        f"{names.ENGINE_STEP_DURATION}_sum",
        f"{names.ENGINE_STEP_DURATION}_count",
        f"{names.TOKENIZE_DURATION}_sum",
        f"{names.TOKENIZE_DURATION}_count",
        f"{names.DETOKENIZE_DURATION}_sum",
        f"{names.DETOKENIZE_DURATION}_count",
    }
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if sample.name in wanted:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def server_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    queries = d.get(names.PREFIX_CACHE_QUERIES, 0.0)
    steps = d.get(f"{names.ENGINE_STEP_DURATION}_count", 0.0)
    step_s = d.get(f"{names.ENGINE_STEP_DURATION}_sum", 0.0)
    tok_n = d.get(f"{names.TOKENIZE_DURATION}_count", 0.0)
    detok_s = d.get(f"{names.DETOKENIZE_DURATION}_sum", 0.0)
    return {
        "prefix_cache_hit_rate": d.get(names.PREFIX_CACHE_HITS, 0.0) / queries if queries else None,
        "preemptions": int(d.get(names.NUM_PREEMPTIONS, 0.0)),
        "engine_steps": int(steps),
        "step_ms_mean": 1000 * step_s / steps if steps else None,
        "tokenize_ms_mean": 1000 * d.get(f"{names.TOKENIZE_DURATION}_sum", 0.0) / tok_n
        if tok_n
        else None,
        # All detokenising of one step's outputs, summed over its requests, per step.
        "detokenize_ms_per_step": 1000 * detok_s / steps if steps else None,
        "detokenize_share_of_step": detok_s / step_s if step_s else None,
    }


# -- output --------------------------------------------------------------------------


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.1f}"


def format_table(s: dict[str, Any]) -> str:
    rows = [
        ("requests completed", f"{s['completed']}/{s['num_requests']}"),
        ("errors", ", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "none"),
        ("duration (s)", f"{s['duration_s']:.2f}"),
        ("request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("input throughput (tok/s)", f"{s['input_throughput']:.1f}"),
        ("output throughput (tok/s)", f"{s['output_throughput']:.1f}"),
    ]
    for key, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E")):
        rows.append(
            (
                f"{label} mean/p50/p95/p99 (ms)",
                " / ".join(_ms(s[f"{key}_{p}"]) for p in ("mean", "p50", "p95", "p99")),
            )
        )
    server = s.get("server")
    if server:
        hit = server["prefix_cache_hit_rate"]
        rows.append(("prefix-cache hit rate", "-" if hit is None else f"{100 * hit:.1f}%"))
        rows.append(("preemptions", str(server["preemptions"])))
        rows.append(("engine step mean (ms)", _num(server["step_ms_mean"])))
        rows.append(("tokenize per request (ms)", _num(server["tokenize_ms_mean"], 3)))
        rows.append(("detokenize per step (ms)", _num(server["detokenize_ms_per_step"], 3)))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def write_json(path: str, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(_public(data), f, indent=2)
        f.write("\n")


def _public(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _public(v) for k, v in data.items() if not k.startswith("_")}
    if isinstance(data, list):
        return [_public(v) for v in data]
    return data


def plot(summary: dict[str, Any], path: str) -> None:
    """Latency distributions and output throughput over time, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results: list[RequestResult] = [r for r in summary["_results"] if r.ok]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    series = [
        ("TTFT (ms)", [1000 * r.ttft for r in results if r.ttft is not None]),
        ("TPOT (ms)", [1000 * t for r in results if (t := r.tpot) is not None]),
        ("ITL (ms)", [1000 * x for r in results for x in r.itls]),
        ("E2E latency (s)", [r.e2e for r in results if r.e2e is not None]),
    ]
    for ax, (title, values) in zip(axes.flat, series, strict=False):
        if values:
            ax.hist(values, bins=50)
        ax.set_title(title)
        ax.set_ylabel("count")
    ax = axes.flat[4]
    times = sorted(t for r in results for t in r.chunk_times)
    if times:
        width = max(summary["duration_s"] / 60, 0.1)
        bins = max(1, math.ceil(times[-1] / width))
        counts = [0] * bins
        for t in times:
            counts[min(int(t / width), bins - 1)] += 1
        ax.plot([width * (i + 0.5) for i in range(bins)], [c / width for c in counts])
    ax.set_title("output chunks/s over time")
    ax.set_xlabel("s")
    ax = axes.flat[5]
    ax.scatter([r.start for r in results], [r.e2e for r in results], s=4)
    ax.set_title("E2E latency (s) by start time")
    ax.set_xlabel("start (s)")
    fig.suptitle(f"conveyor bench serve: {summary['url']} ({summary['completed']} requests)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- command line --------------------------------------------------------------------


def add_workload_args(
    parser: argparse.ArgumentParser, defaults: WorkloadSettings | None = None
) -> None:
    d = defaults or WorkloadSettings()
    g = parser.add_argument_group("workload")
    g.add_argument(
        "--num-requests",
        "--num-prompts",
        type=int,
        default=d.num_requests,
        help=f"requests in the run (default {d.num_requests})",
    )
    g.add_argument(
        "--input-len-min",
        type=int,
        default=d.input_len_min,
        help=f"shortest prompt in tokens (default {d.input_len_min})",
    )
    g.add_argument(
        "--input-len-max",
        type=int,
        default=d.input_len_max,
        help=f"longest prompt in tokens (default {d.input_len_max})",
    )
    g.add_argument(
        "--output-len-mean",
        type=int,
        default=d.output_len_mean,
        help=f"mean output length in tokens (default {d.output_len_mean})",
    )
    g.add_argument(
        "--output-len-max",
        type=int,
        default=d.output_len_max,
        help=f"cap on output length (default {d.output_len_max})",
    )
    g.add_argument(
        "--output-len-dist",
        choices=["exponential", "uniform", "fixed"],
        default=d.output_len_dist,
        help="output length distribution (default exponential)",
    )
    g.add_argument(
        "--shared-prefix-len",
        type=int,
        default=d.shared_prefix_len,
        help=f"tokens of a prefix shared within a group of requests (default {d.shared_prefix_len})",
    )
    g.add_argument(
        "--num-prefix-groups",
        type=int,
        default=d.num_prefix_groups,
        help=f"distinct shared prefixes, assigned round-robin (default {d.num_prefix_groups})",
    )
    g.add_argument(
        "--token-id-range",
        type=int,
        nargs=2,
        default=(d.token_id_min, d.token_id_max),
        metavar=("LO", "HI"),
        help="prompt token ids drawn from [LO, HI) (default 32 127)",
    )
    g.add_argument(
        "--seed", type=int, default=d.seed, help=f"workload and sampling seed (default {d.seed})"
    )


def workload_from_args(a: argparse.Namespace) -> WorkloadSettings:
    w = WorkloadSettings(
        num_requests=a.num_requests,
        input_len_min=a.input_len_min,
        input_len_max=a.input_len_max,
        output_len_mean=a.output_len_mean,
        output_len_max=a.output_len_max,
        output_len_dist=a.output_len_dist,
        shared_prefix_len=a.shared_prefix_len,
        num_prefix_groups=a.num_prefix_groups,
        token_id_min=a.token_id_range[0],
        token_id_max=a.token_id_range[1],
        seed=a.seed,
    )
    if not 1 <= w.input_len_min <= w.input_len_max:
        raise SystemExit("--input-len-min must be >= 1 and <= --input-len-max")
    if w.num_requests < 1 or w.output_len_mean < 1 or w.output_len_max < 1:
        raise SystemExit("--num-requests, --output-len-mean and --output-len-max must be >= 1")
    return w


def add_load_args(
    parser: argparse.ArgumentParser, *, concurrency: int | None = None, model: bool = True
) -> None:
    d = BenchSettings()
    concurrency = concurrency or d.concurrency
    g = parser.add_argument_group("load")
    g.add_argument(
        "--endpoint",
        choices=["completions", "chat"],
        default=d.endpoint,
        help="completions (token id prompts, exact lengths; default) or chat",
    )
    if model:
        g.add_argument("--model", default=None, help="model name (default: the server's first)")
    g.add_argument(
        "--concurrency",
        type=int,
        default=concurrency,
        help=f"closed loop: requests kept in flight (default {concurrency})",
    )
    g.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="open loop: Poisson arrivals per second (overrides --concurrency)",
    )
    g.add_argument(
        "--max-concurrency", type=int, default=None, help="open loop: cap on requests in flight"
    )
    g.add_argument("--api-key", default=None, help="bearer token for the server")
    g.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (default 0)"
    )
    g.add_argument(
        "--timeout", type=float, default=d.timeout, help="per-request timeout in seconds"
    )
    g.add_argument(
        "--warmup",
        type=int,
        default=d.warmup,
        help=f"short requests sent before the run, not measured (default {d.warmup})",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def settings_from_args(a: argparse.Namespace, url: str) -> BenchSettings:
    return BenchSettings(
        url=url.rstrip("/"),
        endpoint=a.endpoint,
        model=getattr(a, "model", None),
        concurrency=a.concurrency,
        request_rate=a.request_rate,
        max_concurrency=a.max_concurrency,
        api_key=a.api_key,
        temperature=a.temperature,
        timeout=a.timeout,
        progress=not a.no_progress,
        warmup=a.warmup,
        workload=workload_from_args(a),
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="conveyor bench serve",
        description=(
            "An HTTP load generator for a runtime replica or a gateway: closed-loop concurrency "
            "or Poisson arrivals, synthetic workloads; prints a table, writes JSON and a plot."
        ),
    )
    parser.add_argument(
        "--url", default="http://127.0.0.1:8000", help="base URL of a replica or a gateway"
    )
    parser.add_argument("--json", default=None, help="write the summary as JSON here")
    parser.add_argument(
        "--plot", default=None, help="draw latency distributions and throughput to this PNG"
    )
    add_load_args(parser)
    add_workload_args(parser)
    args = parser.parse_args(argv)
    settings = settings_from_args(args, args.url)
    summary = asyncio.run(run(settings))
    print(format_table(summary))
    if args.json:
        write_json(args.json, summary)
    if args.plot:
        plot(summary, args.plot)
    return 0 if summary["completed"] else 1
