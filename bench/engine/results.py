"""One scheduling mode's figures in ``conveyor bench offline``: throughput and latency
percentiles of one run."""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.bench.stats import percentile


@dataclass
class ModeResult:
    mode: str
    duration: float
    num_requests: int
    output_tokens: int
    output_throughput: float
    request_throughput: float
    ttft_p50: float
    ttft_p95: float
    ttft_p99: float
    tpot_p50: float
    tpot_p95: float
    tpot_p99: float
    mean_running: float
    max_running: int
    occupancy_while_waiting: float | None
    preemptions: int
    prefix_cache_hit_rate: float
    steps: int
    throughput_ratio_to_continuous: float | None = None
    step_times: list[tuple[int, float]] = field(default_factory=list, repr=False)


def _percentile(values: list[float], q: float) -> float:
    """The shared percentile, NaN for no values (the JSON's figures stay numbers)."""
    value = percentile(values, q)
    return float("nan") if value is None else value


def summarise(mode, duration, num_requests, tokens, ttfts, tpots, **rest) -> ModeResult:
    """Throughput and latency percentiles of one mode's run."""
    return ModeResult(
        mode=mode,
        duration=duration,
        num_requests=num_requests,
        output_tokens=tokens,
        output_throughput=tokens / duration,
        request_throughput=num_requests / duration,
        ttft_p50=_percentile(ttfts, 50),
        ttft_p95=_percentile(ttfts, 95),
        ttft_p99=_percentile(ttfts, 99),
        tpot_p50=_percentile(tpots, 50),
        tpot_p95=_percentile(tpots, 95),
        tpot_p99=_percentile(tpots, 99),
        **rest,
    )
