"""Bad input the gateway answers itself: a 4xx in OpenAI's error shape, never a 500."""

from __future__ import annotations

import pytest

from conveyor.gateway.errors import ClientError
from conveyor.gateway.proxy import _parse


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"model": "m", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    ],
)
def test_a_body_nested_too_deep_for_the_parser_is_a_400(raw: bytes) -> None:
    with pytest.raises(ClientError) as info:
        _parse(raw)
    assert info.value.status == 400
    assert "not valid JSON" in str(info.value)
