"""``conveyor bench gateway``'s routing phases without replicas: the parts option, how a
replica is added to each proxy mid-run (the gateway's backends file, the routers' HTTP API
as a loopback server records it), and the grow phase's rows in the summary."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from conveyor.bench.gateway import report, routers
from conveyor.bench.gateway.command import parse_parts
from conveyor.bench.gateway.routing import write_backends
from conveyor.bench.gateway.workload import Counters, hit_rate, requests_each
from conveyor.gateway.static_discovery import parse_backends


def test_parts_option() -> None:
    assert parse_parts("all") == {"overhead", "routing", "grow"}
    assert parse_parts("routing, grow") == {"routing", "grow"}
    with pytest.raises(ValueError, match=r"--part takes all or .*overhead, routing, grow"):
        parse_parts("routing,scale")


def test_the_backends_file_the_gateway_reads_gains_the_new_replica(tmp_path: Path) -> None:
    path = tmp_path / "backends.txt"
    write_backends(path, ["http://127.0.0.1:1", "http://127.0.0.1:2"])
    write_backends(path, [*path.read_text().split(), "http://127.0.0.1:3"])
    assert parse_backends(path.read_text().splitlines()) == [
        (None, "http://127.0.0.1:1"), (None, "http://127.0.0.1:2"), (None, "http://127.0.0.1:3"),
    ]  # fmt: skip
    assert [p.name for p in tmp_path.iterdir()] == ["backends.txt"]


class _Router(BaseHTTPRequestHandler):
    """Answers like the routers' worker API: POST adds (query or JSON body), GET /workers lists."""

    workers: list[dict[str, object]]

    def do_POST(self) -> None:
        parts = urlsplit(self.path)
        length = int(self.headers.get("content-length") or 0)
        body = json.loads(self.rfile.read(length)) if length else {}
        url = parse_qs(parts.query).get("url", [body.get("url")])[0]
        if parts.path not in ("/add_worker", "/workers") or not url:
            self.send_response(400)
            self.end_headers()
            return
        self.workers.append(
            {"url": url, "is_healthy": parts.path == "/add_worker", "via": parts.path}
        )
        self.send_response(200 if parts.path == "/add_worker" else 202)
        self.end_headers()

    def do_GET(self) -> None:
        data = json.dumps({"workers": self.workers, "total": len(self.workers)}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def router_api() -> Iterator[tuple[str, list[dict[str, object]]]]:
    workers: list[dict[str, object]] = []
    handler = type("Handler", (_Router,), {"workers": workers})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", workers
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_each_router_is_asked_to_add_a_worker_its_own_way(
    router_api: tuple[str, list[dict[str, object]]],
) -> None:
    base, workers = router_api
    routers.add_worker(routers.VLLM_ROUTER, base, "http://127.0.0.1:7")
    routers.add_worker(routers.SGLANG_ROUTER, base, "http://127.0.0.1:8")
    assert [(w["url"], w["via"]) for w in workers] == [
        ("http://127.0.0.1:7", "/add_worker"), ("http://127.0.0.1:8", "/workers"),
    ]  # fmt: skip
    assert routers.has_healthy_worker(base, "http://127.0.0.1:7")
    assert not routers.has_healthy_worker(base, "http://127.0.0.1:8")  # queued, not checked yet
    assert not routers.has_healthy_worker(base, "http://127.0.0.1:9")


def test_a_refused_worker_says_which_router_and_why(
    router_api: tuple[str, list[dict[str, object]]],
) -> None:
    base, _ = router_api
    odd = routers.RustRouter("odd-router", "1", add_worker_path="/nowhere")
    with pytest.raises(RuntimeError, match=r"odd-router refused to add worker .* answered 400"):
        routers.add_worker(odd, base, "http://127.0.0.1:7")


def test_counters_between_two_snapshots() -> None:
    before = [Counters(100, 50, 3), Counters(0, 0, 0)]
    after = [Counters(300, 200, 8), Counters(100, 10, 4)]
    assert hit_rate(before, after) == pytest.approx(160 / 300)
    assert requests_each(before, after) == [5, 4]
    assert hit_rate(before, before) == 0.0


def test_summary_has_the_grow_phase_under_each_proxys_policy() -> None:
    proxies = ["conveyor", "vllm-router", "sglang-router"]
    base = {"ttft_p95": 1.0, "req_s": 1.0, "hit": 0.5, "spread": 1.0}
    routing: report.Routing = {
        "conveyor prefix-aware": {**base, "ttft_p50": 0.4},
        "vllm-router cache_aware": {**base, "ttft_p50": 0.9},
        "vllm-router consistent_hash": {**base, "ttft_p50": 0.5},
        "sglang-router cache_aware": {**base, "ttft_p50": 0.6},
    }
    grow = {"hit_before": 0.7, "new_req": 1.0, "join_s": 1.0}
    grown: report.Routing = {
        "conveyor prefix-aware": {**grow, "hit_after": 0.8, "new_share": 0.2},
        "vllm-router cache_aware": {**grow, "hit_after": 0.9, "new_share": 0.0},
        "vllm-router consistent_hash": {**grow, "hit_after": 0.6, "new_share": 0.25},
        "sglang-router cache_aware": {**grow, "hit_after": 0.85, "new_share": 0.0},
    }
    lines = report.summary(proxies, {}, {}, routing, grown).splitlines()

    def row(metric: str) -> list[str]:
        return next(re.split(r"\s{2,}", line) for line in lines if line.startswith(metric))

    # vllm-router's routing row is its consistent_hash (lower TTFT): so is its grow row
    assert row("grow: prefix hit after join")[1:5] == ["80.0%", "60.0%", "85.0%", "0.94x"]
    assert row("grow: new replica's share after")[1:5] == ["20.0%", "25.0%", "0.0%", "0.80x"]
