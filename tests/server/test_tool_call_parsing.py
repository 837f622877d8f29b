"""The parts of tool calling that need no model: the parsers, what streams, and the tool
prompts written for chat templates that ignore ``tools``."""

from __future__ import annotations

import json

from conveyor.runtime.server.protocol import Tool
from conveyor.runtime.server.settings import TOOL_CALL_PARSERS
from conveyor.runtime.server.tool_calls import ToolCalling, ToolCallStream
from conveyor.runtime.server.tool_prompt import TOOL_PROMPTS

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


def test_forced_output_cut_before_a_call_begins_is_no_call() -> None:
    required = ToolCalling([TOOL], "required")
    assert required.extract('[{"name": "f", "parameters": {}}]') is not None
    assert required.extract('[{"name": "f", "param') is None
    assert required.extract("[1]") is None
    named = ToolCalling([TOOL], "named", name="f").extract('{"a": ')
    assert named is not None and named[1][0]["function"]["arguments"] == '{"a": '


def _stream(tools: ToolCalling, text: str) -> list[tuple[int, dict, bool]]:
    """(character, tool-call delta, called) for ``text`` streamed a character at a time."""
    stream = ToolCallStream(tools)
    sent = []
    for at, ch in enumerate(text):
        deltas, called = stream.update(ch, at == len(text) - 1)
        sent += [(at, call, called) for d in deltas for call in d.get("tool_calls", [])]
        assert not called or at == len(text) - 1, "called before the choice's end"
    return sent


def test_required_arguments_stream_as_they_are_generated() -> None:
    """A call opens (id, name) once its name is whole and its arguments begin; then its
    arguments go out as generated: a string holding brackets, quotes and escapes does not
    end them, and nothing after them (the element's brace, the comma) is sent. The deltas
    add up to the whole answer's calls, the one cut short by max_tokens too."""
    required = ToolCalling([TOOL], "required")
    first = '{"name": "f", "parameters": {"s": "}] \\" {["}}'
    text = f'[{first}, {{"name" : "f" ,"parameters":  {{"n": [2]}}}}, {{"name": "f", "parameters": {{"a'
    sent = _stream(required, text)
    opens = [(at, c) for at, c, _ in sent if "id" in c]
    assert [at for at, _ in opens] == [
        text.index("{", 2),
        text.index("{", text.index('"parameters":  ')),
        text.rindex("{"),
    ]
    assert [c["index"] for _, c in opens] == [0, 1, 2]
    assert all(c["function"]["name"] == "f" for _, c in opens)
    args = ["", "", ""]
    for _, c, _ in sent:
        args[c["index"]] += c["function"]["arguments"]
    assert args == ['{"s": "}] \\" {["}', '{"n": [2]}', '{"a']
    assert json.loads(args[0]) == {"s": '}] " {['}
    whole = required.extract(text)
    assert whole is not None
    assert [c["function"]["arguments"] for c in whole[1]] == args
    assert not sent[-1][2], "a choice whose last call was cut short is no call"
    assert not required.complete(text)


def test_only_whole_calls_make_a_tool_calls_finish() -> None:
    """Cut short (max_tokens or a stop string): the calls go out as generated, but the
    finish reason stays the engine's; whole, it is ``tool_calls``."""

    def called(tools: ToolCalling, text: str) -> bool:
        stream = ToolCallStream(tools)
        stream.update(text[:-1], False)
        return stream.update(text[-1], True)[1]

    required = ToolCalling([TOOL], "required")
    whole = '[{"name": "f", "parameters": {"a": 1}}]'
    assert required.complete(whole) and called(required, whole)
    assert required.complete(whole[:-1])  # its call closed; only the array did not
    cut = '[{"name": "f", "parameters": {'
    assert not required.complete(cut) and not called(required, cut)
    assert required.finish_reason(whole, "stop") == "tool_calls"
    assert required.finish_reason(cut, "length") == "length"
    named = ToolCalling([TOOL], "named", name="f")  # forced by name: the engine's, as OpenAI's
    assert named.complete('{"a": 1}') and not called(named, '{"a": 1}')
    assert named.finish_reason('{"a": 1}', "stop") == "stop"
    assert not named.complete('{"a": ')


def test_required_scanner_reads_odd_elements_as_json_would() -> None:
    """What the grammar cannot produce still reads sensibly: a second ``parameters`` key
    does not restart the arguments, and a name that is not a string is no name."""
    required = ToolCalling([TOOL], "required")
    found = required.extract('[{"name": "f", "parameters": {"a": 1}, "parameters": {"b": 2}}]')
    assert found is not None and found[1][0]["function"]["arguments"] == '{"a": 1}'
    assert required.extract('[{"name": 5, "parameters": {}}]') is None


def test_required_scalar_arguments_go_whole() -> None:
    required = ToolCalling([TOOL], "required")
    sent = _stream(required, '[{"name": "f", "parameters": "x, y"}]')
    assert [c["function"]["arguments"] for _, c, _ in sent] == ['"x, y"']


def test_required_element_with_parameters_first_is_sent_when_it_closes() -> None:
    required = ToolCalling([TOOL], "required")
    sent = _stream(required, '[{"parameters": {"n": 1}, "name": "f"}]')
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for _, c, _ in sent
    ] == [("f", {"n": 1})]


def test_named_call_streams_from_its_first_character() -> None:
    sent = _stream(ToolCalling([TOOL], "named", name="f"), '{"a": 1}')
    assert sent[0][0] == 0 and sent[0][1]["function"] == {"name": "f", "arguments": "{"}
    assert "".join(c["function"]["arguments"] for _, c, _ in sent) == '{"a": 1}'


SMOLLM2 = ToolCalling([TOOL], "auto", parser="smollm2")


def test_smollm2_list_of_calls_with_arguments_or_parameters() -> None:
    """SmolLM2's trained form is one ``<tool_call>`` holding a JSON list; either parser reads
    it, and ``parameters`` (APIGen data) as well as ``arguments``."""
    text = '<tool_call>[{"name": "f", "arguments": {"x": 1}}, {"name": "g", "parameters": {"y": 2}}]</tool_call>'
    for auto in (SMOLLM2, AUTO):
        found = auto.extract(text)
        assert found is not None and found[0] is None
        assert [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in found[1]
        ] == [
            ("f", {"x": 1}),
            ("g", {"y": 2}),
        ]
    found = SMOLLM2.extract('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert found is not None and found[1][0]["function"]["arguments"] == "{}"


def test_an_empty_list_of_calls_is_an_answer_in_text() -> None:
    """The SmolLM2 prompt asks for ``<tool_call>[]</tool_call>`` when no call is needed: no
    tool calls, and the list is not part of the content, streamed or not."""
    found = SMOLLM2.extract("Hello there!<tool_call>[]</tool_call>")
    assert found == ("Hello there!", [])
    assert SMOLLM2.extract("<tool_call>[]</tool_call>") == ("", [])
    stream = ToolCallStream(SMOLLM2)
    sent = []
    for piece, last in (("Hello", False), (" there!<tool_", False), ("call>[]</tool_call>", True)):
        deltas, called = stream.update(piece, last)
        assert not called
        sent += [d.get("content", "") for d in deltas]
    assert "".join(sent) == "Hello there!"


def test_a_call_without_a_name_is_no_call() -> None:
    assert SMOLLM2.extract('<tool_call>[{"arguments": {}}]</tool_call>') is None
    assert SMOLLM2.extract("<tool_call>[1, 2]</tool_call>") is None


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_every_parser_has_a_tool_prompt_and_only_auto_uses_it() -> None:
    assert set(TOOL_PROMPTS) == set(TOOL_CALL_PARSERS)
    assert SMOLLM2.tool_prompt is TOOL_PROMPTS["smollm2"]
    assert ToolCalling([TOOL], "required", parser="smollm2").tool_prompt is None
    assert ToolCalling([TOOL], "none", parser="smollm2").tool_prompt is None


def test_smollm2_prompt_lists_the_functions_and_asks_for_a_list_of_calls() -> None:
    conversation = TOOL_PROMPTS["smollm2"].rewrite([{"role": "user", "content": "hi"}], [WEATHER])
    assert [m["role"] for m in conversation] == ["system", "user"]
    system = conversation[0]["content"]
    listed = system[system.index("<tools>") + 7 : system.index("</tools>")]
    assert json.loads(listed) == [WEATHER["function"]]  # the functions, as in APIGen
    assert "<tool_call>[" in system and "'[]'" in system


def test_hermes_prompt_lists_each_tool_and_keeps_the_users_system_text() -> None:
    conversation = TOOL_PROMPTS["hermes"].rewrite(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], [WEATHER]
    )
    assert [m["role"] for m in conversation] == ["system", "user"]
    system = conversation[0]["content"]
    assert system.startswith("Be brief.\n\n")
    assert f"<tools>\n{json.dumps(WEATHER)}\n</tools>" in system


def test_tool_history_becomes_text_in_the_familys_format() -> None:
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
    ]
    smol = TOOL_PROMPTS["smollm2"].rewrite(history, [WEATHER])
    assert [m["role"] for m in smol] == ["system", "user", "assistant", "user"]
    assert smol[2] == {
        "role": "assistant",
        "content": '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call>',
    }
    assert smol[3] == {"role": "user", "content": "<tool_response>\n-3 C\n</tool_response>"}
    hermes = TOOL_PROMPTS["hermes"].rewrite(history, [WEATHER])
    assert hermes[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    coder = TOOL_PROMPTS["qwen3_coder"].rewrite(history, [WEATHER])
    assert coder[2]["content"] == (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    # what each parser reads back is the call it wrote
    for parser, prompt in TOOL_PROMPTS.items():
        written = prompt.rewrite(history, [WEATHER])[2]["content"]
        found = ToolCalling([TOOL], "auto", parser=parser).extract(written)
        assert found is not None
        assert json.loads(found[1][0]["function"]["arguments"]) == {"city": "Oslo"}


def test_output_nested_too_deep_for_the_json_parser_is_no_call() -> None:
    """A recursive parameters schema (or a regex) lets the model nest past ``json.loads``'
    recursion limit within the context: not a 500 once the answer is written. ``auto`` and
    ``required`` read no call; a named function's arguments are the text as generated (as
    streamed), which is never parsed."""
    deep = "[" * 100_000 + "]" * 100_000
    for calling, text in [
        (AUTO, f"<tool_call>{deep}</tool_call>"),
        (ToolCalling([TOOL], "required"), deep),
    ]:
        assert calling.extract(text) is None
    named = ToolCalling([TOOL], "named", name="f").extract(deep)
    assert named is not None and named[1][0]["function"]["arguments"] == deep


TYPED = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "book",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "nights": {"type": "integer"},
                    "budget": {"type": "number"},
                    "late": {"type": "boolean"},
                    "guests": {"type": "array"},
                    "extras": {"type": ["object", "null"]},
                    "note": {"type": "string"},
                },
            },
        },
    }
)


def test_qwen3_coder_calls_take_their_schemas_types() -> None:
    """Qwen3-Coder's XML: each parameter's text (less the lines its tags sit on) becomes the
    JSON type the schema names; a string stays as written, numbers and all; a parameter the
    schema does not name stays text."""
    text = (
        "Booking.\n<tool_call>\n<function=book>\n<parameter=city>\n 12 Rue X\n\n</parameter>\n"
        "<parameter=nights>\n3\n</parameter>\n<parameter=budget>\n-2.5e2\n</parameter>\n"
        '<parameter=late>\nTrue\n</parameter>\n<parameter=guests>\n["a", 1]\n</parameter>\n'
        "<parameter=extras>\nnull\n</parameter>\n<parameter=note>\n42\n</parameter>\n"
        "<parameter=other>\n{}\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=book>\n<parameter=nights>\n2"
    )
    found = ToolCalling([TYPED], "auto", parser="qwen3_coder").extract(text)
    assert found is not None
    content, calls = found
    assert content == "Booking."
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {
            "city": " 12 Rue X\n",
            "nights": 3,
            "budget": -250.0,
            "late": True,
            "guests": ["a", 1],
            "extras": None,
            "note": "42",
            "other": "{}",
        },
        {"nights": 2},  # cut short by max_tokens: what it has
    ]


def test_a_parameter_that_does_not_read_as_its_type_stays_text() -> None:
    params = {"nights": "three", "budget": "NaN", "guests": "[1,", "late": "maybe"}
    body = "".join(f"<parameter={k}>{v}</parameter>" for k, v in params.items())
    big = "9" * 5000  # past Python's int() digits
    body += f'<parameter=extras>{{"x": Infinity}}</parameter><parameter=city>{big}</parameter>'
    found = ToolCalling([TYPED], "auto", parser="qwen3_coder").extract(
        f"<tool_call><function=book>{body}</function></tool_call>"
    )
    assert found is not None
    args = json.loads(found[1][0]["function"]["arguments"])
    assert args == {**params, "extras": '{"x": Infinity}', "city": big}
    nights = f"<tool_call><function=book><parameter=nights>{big}</parameter></function>"
    found = ToolCalling([TYPED], "auto", parser="qwen3_coder").extract(nights)
    assert found is not None and json.loads(found[1][0]["function"]["arguments"]) == {"nights": big}


def test_seed_oss_reads_its_own_tags_only() -> None:
    seed = ToolCalling([TYPED], "auto", parser="seed_oss")
    found = seed.extract(
        "<seed:tool_call>\n<function=book>\n<parameter=nights>4</parameter>\n</function>\n"
        "</seed:tool_call>"
    )
    assert found is not None and json.loads(found[1][0]["function"]["arguments"]) == {"nights": 4}
    assert seed.extract('<tool_call>{"name": "book", "arguments": {}}</tool_call>') is None
    assert seed.visible_len("ok <seed:tool") == len("ok ")
    assert seed.visible_len("ok <tool_call>") == len("ok <tool_call>")
    # the JSON forms inside its tags, as every parser reads them
    found = seed.extract('<seed:tool_call>{"name": "book", "arguments": {"a": 1}}</seed:tool_call>')
    assert found is not None and json.loads(found[1][0]["function"]["arguments"]) == {"a": 1}


def test_hermes_reads_the_xml_form_too() -> None:
    found = AUTO.extract("<tool_call><function=f><parameter=x>1</parameter></function></tool_call>")
    assert found is not None and json.loads(found[1][0]["function"]["arguments"]) == {"x": "1"}


def test_the_xml_prompt_asks_for_its_own_tags() -> None:
    for parser, opening in (("qwen3_coder", "<tool_call>"), ("seed_oss", "<seed:tool_call>")):
        system = TOOL_PROMPTS[parser].rewrite([{"role": "user", "content": "hi"}], [WEATHER])
        text = system[0]["content"]
        assert f"<tools>\n{json.dumps(WEATHER)}\n</tools>" in text
        assert f"{opening}\n<function=FUNCTION_NAME>" in text
