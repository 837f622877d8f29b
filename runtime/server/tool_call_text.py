"""A model's tool calls in its own text (``tool_choice: "auto"``): the calls between a parser's
tags, each body JSON (Hermes', SmolLM2's list) or Qwen3-Coder's and Seed-OSS's XML
(``<function=NAME><parameter=KEY>value</parameter></function>``), whose parameters take the
JSON types the function's schema gives them (``tool_calls.py`` says which parser reads what).
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Callable
from typing import Any

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
SEED_OPEN, SEED_CLOSE = "<seed:tool_call>", "</seed:tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(
    r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL
)


def call_tags(parser: str | None) -> tuple[str, str]:
    """The tags around a call in ``parser``'s format."""
    return (SEED_OPEN, SEED_CLOSE) if parser == "seed_oss" else (HERMES_OPEN, HERMES_CLOSE)


def parse_calls(
    text: str, tags: tuple[str, str], types: Callable[[str, str], str | None]
) -> tuple[str | None, list[dict[str, Any]]] | None:
    """The calls between ``tags`` (the last may be unclosed), each body JSON (one call or a
    list) or Qwen3-Coder's XML; None when there are none or one does not parse."""
    opening, closing = tags
    at = text.find(opening)
    if at < 0:
        return None
    block = re.compile(f"{re.escape(opening)}(.*?)(?:{re.escape(closing)}|$)", re.DOTALL)
    calls = []
    for body in block.findall(text, at):
        body = body.strip()
        found = _xml_calls(body, types) if body.startswith("<function=") else _json_calls(body)
        if found is None:
            return None
        calls += found
    if not calls:  # "<tool_call>[]</tool_call>": the model said it calls nothing
        return block.sub("", text), []
    content = text[:at].strip()
    return content or None, calls


def _json_calls(body: str) -> list[dict[str, Any]] | None:
    try:
        parsed = json.loads(body, parse_constant=_no_constant)
    except (ValueError, RecursionError):  # RecursionError: nested too deep
        return None
    calls = []
    for c in parsed if isinstance(parsed, list) else [parsed]:
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            return None
        args = c.get("arguments", c.get("parameters", {}))
        calls.append(new_call(c["name"], json.dumps(args, ensure_ascii=False)))
    return calls


def _xml_calls(body: str, types: Callable[[str, str], str | None]) -> list[dict[str, Any]] | None:
    calls = []
    for name, inner in _FUNCTION.findall(body):
        name = name.strip()
        args: dict[str, Any] = {}
        for key, value in _PARAMETER.findall(inner):
            key = key.strip()
            value = value.removeprefix("\n").removesuffix("\n")  # the lines the tags sit on
            args[key] = _typed(value, types(name, key))
        calls.append(new_call(name, json.dumps(args, ensure_ascii=False)))
    return calls or None  # "<function=>": not a call


def _typed(value: str, kind: str | None) -> Any:
    """A parameter's text as the JSON type its schema names; the text itself where that
    does not read (or no type is named, or a string is)."""
    if kind in (None, "string"):
        return value
    text = value.strip()
    if text.lower() == "null":
        return None
    try:
        if kind in ("integer", "number") and re.fullmatch(r"-?\d+", text):
            return int(text)  # ValueError past Python's 4,300 digits
        if kind == "number":
            number = float(text)
            return number if math.isfinite(number) else value  # JSON has no inf or nan
        if kind == "boolean":
            return {"true": True, "false": False}[text.lower()]
        if kind == "integer":
            return value
        return json.loads(text, parse_constant=_no_constant)  # object, array, another type
    except (ValueError, KeyError, RecursionError):
        return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # json.loads reads NaN and Infinity by default


def new_call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }
