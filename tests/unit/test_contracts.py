"""The documents components exchange: each written and read by one module."""

from __future__ import annotations

import json

import pytest

from conveyor.contracts import endpoint_slice
from conveyor.contracts.load import ReplicaLoad
from conveyor.contracts.openai_error import error_body, error_type


def test_load_record_round_trips_and_reads_what_the_document_may_grow():
    record = ReplicaLoad(2, 3, 0.25, 8, None, True, model="tiny", in_flight=5)
    doc = json.loads(json.dumps(record.to_json()))
    assert doc == {
        "running": 2, "waiting": 3, "kv_cache_usage": 0.25, "max_running_requests": 8,
        "max_queued_requests": None, "ready": True, "model": "tiny", "in_flight": 5,
    }  # fmt: skip
    assert ReplicaLoad.from_json(doc) == record
    minimal = {
        k: v for k, v in doc.items() if k not in ("model", "in_flight", "max_queued_requests")
    }
    assert ReplicaLoad.from_json({**minimal, "new": [1]}) == ReplicaLoad(2, 3, 0.25, 8, None, True)
    assert ReplicaLoad.from_json({**doc, "max_running_requests": 0}).max_running_requests == 1
    assert "model" not in ReplicaLoad(0, 0, 0.0, 1, None, False).to_json()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"waiting": None}, "waiting"),
        ({"running": True}, "running"),
        ({"kv_cache_usage": "0.5"}, "kv_cache_usage"),
        ({"max_queued_requests": "4"}, "max_queued_requests"),
        ({"ready": None}, "ready"),
        ({"model": 3}, "model"),
        ({"in_flight": "2"}, "in_flight"),
    ],
)
def test_load_reader_names_the_wrong_field(change, field):
    doc = ReplicaLoad(1, 1, 0.5, 4, 2, True).to_json()
    with pytest.raises(ValueError, match=f"'{field}'"):
        ReplicaLoad.from_json({**doc, **change})


def slice_with(*endpoints: dict, ports: list | None = None) -> dict:
    return {
        "metadata": {"name": "s"},
        "ports": [{"name": "http", "port": 8000}] if ports is None else ports,
        "endpoints": list(endpoints),
    }


def endpoint(address: str, pod: str | None = None, **conditions: bool) -> dict:
    return {
        "addresses": [address],
        "conditions": conditions,
        **({"targetRef": {"kind": "Pod", "name": pod}} if pod else {}),
    }


def test_endpoint_slice_ready_endpoints_drop_unready_and_terminating():
    found = endpoint_slice.ready_endpoints(
        slice_with(
            endpoint("10.0.0.1", "p1", ready=True),
            endpoint("10.0.0.2", "p2"),  # ready unset means ready
            endpoint("10.0.0.3", "p3", ready=False),
            endpoint("10.0.0.4", "p4", ready=True, terminating=True),
            endpoint("fd00::5"),
            {"addresses": [], "conditions": {}},
        ),
        "http",
    )
    assert found == [
        endpoint_slice.ReadyEndpoint("http://10.0.0.1:8000", "p1"),
        endpoint_slice.ReadyEndpoint("http://10.0.0.2:8000", "p2"),
        endpoint_slice.ReadyEndpoint("http://[fd00::5]:8000", None),
    ]


def test_endpoint_slice_port_by_name_or_first():
    ports = [{"name": "metrics", "port": 9090}, {"name": "http", "port": 8000}]
    one = slice_with(endpoint("10.0.0.1"), ports=ports)
    assert [e.url for e in endpoint_slice.ready_endpoints(one, None)] == ["http://10.0.0.1:9090"]
    assert [e.url for e in endpoint_slice.ready_endpoints(one, "http")] == ["http://10.0.0.1:8000"]
    assert endpoint_slice.ready_endpoints(one, "grpc") == []
    assert endpoint_slice.ready_endpoints({"ports": None, "endpoints": None}, None) == []


def test_openai_error_body_and_vocabulary():
    assert error_body(503, "shutting down", code="draining") == {
        "error": {
            "message": "shutting down", "type": "service_unavailable_error",
            "param": None, "code": "draining",
        }
    }  # fmt: skip
    assert error_body(400, "bad", param="model")["error"]["param"] == "model"
    assert [error_type(s) for s in (401, 404, 413, 415, 429, 500, 502, 504, 599)] == [
        "authentication_error", "not_found_error", "invalid_request_error",
        "invalid_request_error", "rate_limit_error", "internal_server_error",
        "upstream_error", "upstream_error", "api_error",
    ]  # fmt: skip
    assert all(error_type(s).endswith("_error") for s in range(400, 600) if s != 499)
