"""Schemathesis fuzzes every operation of the runtime's OpenAPI document (request bodies of
completions, chat, /tokenize and /detokenize, structured outputs and tools included): no
input gets a 5xx, and the server still serves afterwards.

Its strategies are driven with hypothesis directly: schemathesis' pytest plugin does not run
under this pytest.
"""

from __future__ import annotations

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings

from conveyor.bench.procs import ChildProcess

EXAMPLES_PER_OPERATION = 40


def test_no_input_gets_a_5xx(server: ChildProcess) -> None:
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"} <= paths
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def no_5xx(case: schemathesis.Case) -> None:
            if isinstance(case.body, dict) and "max_tokens" in case.body:
                case.body["max_tokens"] = 2  # bounded work per case
            response = case.call(base_url=server.url, timeout=60)
            assert response.status_code < 500, (case.path, case.body, response.text)

        no_5xx()
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200
