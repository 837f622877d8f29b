"""``conveyor dashboard render``: the dashboards as PNG images, from any Prometheus."""

from __future__ import annotations

import argparse
import datetime as dt
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

_RELATIVE = re.compile(r"^now(?:-(\d+)([smhd]))?$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_time(text: str, now: float) -> float:
    """``now``, ``now-15m``, Unix seconds, or an ISO 8601 time (local time unless it says)."""
    if match := _RELATIVE.match(text.strip()):
        amount, unit = match.groups()
        return now - (int(amount) * _UNITS[unit] if amount else 0)
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return dt.datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise ValueError(
            f"cannot read the time {text!r}: use now, now-30m, Unix seconds or 2025-01-31T12:00:00"
        ) from None


@dataclass(frozen=True)
class RenderSettings:
    """What ``conveyor dashboard render`` draws, from where, into where."""

    prometheus: str
    """Base URL of the Prometheus to query (e.g. the one ``conveyor up`` printed)."""
    start: float
    """Start of the time range (Unix seconds)."""
    end: float
    """End of the time range (Unix seconds)."""
    out: Path
    """Folder the PNG images are written to (one per dashboard)."""
    scrape_interval_s: float = 15.0
    """The Prometheus' scrape interval, which bounds $__interval and $__rate_interval as in Grafana."""


def parse_settings(argv: list[str]) -> RenderSettings:
    parser = argparse.ArgumentParser(
        prog="conveyor dashboard",
        description="Draw Conveyor's Grafana dashboards from Prometheus, without Grafana.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    render = sub.add_parser("render", help="render every dashboard to a PNG image")
    render.add_argument("--prometheus", required=True, help="Prometheus base URL")
    render.add_argument("--from", dest="start", default="now-1h", help="start (default now-1h)")
    render.add_argument("--to", dest="end", default="now", help="end (default now)")
    render.add_argument("--out", required=True, type=Path, help="output folder")
    render.add_argument(
        "--scrape-interval",
        type=float,
        default=15.0,
        help="Prometheus scrape interval, s (default 15)",
    )
    args = parser.parse_args(argv)
    now = time.time()
    settings = RenderSettings(
        prometheus=args.prometheus,
        start=parse_time(args.start, now),
        end=parse_time(args.end, now),
        out=args.out,
        scrape_interval_s=args.scrape_interval,
    )
    if settings.end <= settings.start:
        raise ValueError(f"--to ({args.end}) must be after --from ({args.start})")
    if settings.scrape_interval_s <= 0:
        raise ValueError("--scrape-interval must be positive")
    return settings


def main(argv: list[str]) -> int:
    try:
        settings = parse_settings(argv)
    except ValueError as exc:
        print(f"conveyor dashboard: {exc}", file=sys.stderr)
        return 2
    from conveyor.observability.prometheus import PrometheusAPI, PrometheusError
    from conveyor.observability.render import render_all

    try:
        results = render_all(
            PrometheusAPI(settings.prometheus),
            settings.start,
            settings.end,
            settings.out,
            scrape_interval_s=settings.scrape_interval_s,
        )
    except (PrometheusError, OSError) as exc:
        print(f"conveyor dashboard: {exc}", file=sys.stderr)
        return 1
    for path, panels in results.items():
        empty = [p.title for p in panels if not p.series]
        note = f"; no data: {', '.join(empty)}" if empty else ""
        print(f"{path}: {len(panels)} panels{note}")
    return 0
