"""The parts of tool calling that need no model: the Hermes parser and what streams."""

from __future__ import annotations

import json

from conveyor.runtime.server.protocol import Tool
from conveyor.runtime.server.tool_calls import ToolCalling

TOOL = Tool.model_validate({"type": "function", "function": {"name": "f"}})
AUTO = ToolCalling([TOOL], "auto", parser="hermes")


def test_hermes_calls_and_the_text_before_them() -> None:
    text = (
        'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    )
    found = AUTO.extract(text)
    assert found is not None
    content, calls = found
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("f", {"x": 1}),
        ("g", {}),
    ]


def test_hermes_list_form_and_an_unclosed_last_call() -> None:
    found = AUTO.extract('<tool_call>[{"name": "f", "arguments": {"a": "b"}}]')
    assert found is not None and found[0] is None
    assert json.loads(found[1][0]["function"]["arguments"]) == {"a": "b"}


def test_hermes_plain_text_or_broken_json_is_no_call() -> None:
    assert AUTO.extract("just text") is None
    assert AUTO.extract("<tool_call>{not json</tool_call>") is None


def test_auto_streams_everything_but_what_may_start_a_call() -> None:
    assert AUTO.visible_len("hello") == 5
    assert AUTO.visible_len("hello <tool") == len("hello ")
    assert AUTO.visible_len("hello <tool_call>{") == len("hello ")
    assert AUTO.visible_len("a < b") == 5
    forced = ToolCalling([TOOL], "required")
    assert forced.visible_len("[{") == 0


def test_forced_output_cut_short_is_no_call() -> None:
    required = ToolCalling([TOOL], "required")
    assert required.extract('[{"name": "f", "parameters": {}}]') is not None
    assert required.extract('[{"name": "f", "param') is None
    assert required.extract("[1]") is None
    assert ToolCalling([TOOL], "named", name="f").extract('{"a": ') is None
