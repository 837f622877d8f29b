"""Tool calling on chat completions: ``tool_choice`` into a grammar or a parser, and the
generated text back into OpenAI ``tool_calls``.

- ``none``: plain text.
- ``required`` / a named function: forced by a grammar, so the arguments always parse and
  match the function's parameter schema, on any model. ``required`` generates a JSON array
  of ``{"name", "parameters"}`` (one element unless ``parallel_tool_calls``); a named function
  generates its arguments object.
- ``auto``: the model writes its own tool-call format, read by the parser the server was
  started with (``--tool-call-parser``): ``hermes`` (Hermes, Qwen:
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one per call), ``smollm2``
  (``<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>``), ``qwen3_coder``
  (Qwen3-Coder's ``<tool_call><function=NAME><parameter=KEY>value</parameter>...</function>
  </tool_call>``) or ``seed_oss`` (the same inside ``<seed:tool_call>``). Within its tags each
  reads any of these forms, ``parameters`` for ``arguments``, and an empty list as "no call";
  a ``<parameter=...>``'s text becomes the JSON type the function's schema gives that
  parameter (as vLLM's ``qwen3_coder`` parser converts it: a string where it says none). The
  parsers differ in their tags (the text is read by ``tool_call_text.py``) and in how
  ``tool_prompt.py`` shows the tools to a model whose chat template ignores them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from conveyor.runtime.sampling_params import StructuredOutputParams
from conveyor.runtime.server.errors import bad_request
from conveyor.runtime.server.protocol import ChatCompletionRequest, NamedToolChoice, Tool
from conveyor.runtime.server.settings import TOOL_CALL_PARSERS
from conveyor.runtime.server.tool_call_text import call_tags, new_call, parse_calls
from conveyor.runtime.server.tool_prompt import TOOL_PROMPTS, ToolPrompt

NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolCalling:
    """One request's tools and how its output becomes tool calls."""

    tools: list[Tool]
    mode: str
    """``none``, ``auto``, ``required`` or ``named``."""
    name: str | None = None
    """The function a ``named`` choice forces."""
    parallel: bool = True
    parser: str | None = None
    """For ``auto``: the server's ``--tool-call-parser``."""

    @classmethod
    def from_request(cls, req: ChatCompletionRequest, parser: str | None) -> ToolCalling | None:
        """None when the request has no tools; 400s that say what to change."""
        choice = req.tool_choice
        if not req.tools:
            if choice not in (None, "none"):
                raise bad_request(
                    f"tool_choice {_describe(choice)} needs tools; send the functions in tools",
                    param="tool_choice",
                )
            return None
        names = [t.function.name for t in req.tools]
        if len(set(names)) != len(names):
            raise bad_request(f"tools must have distinct names, got {names}", param="tools")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise bad_request(
                    f"tool_choice names function {choice.function.name!r}, which is not in "
                    f"tools ({', '.join(names)})",
                    param="tool_choice",
                )
            return cls(req.tools, "named", name=choice.function.name)
        mode = choice or "auto"
        if mode == "auto" and parser is None:
            raise bad_request(
                'tool_choice "auto" needs a server started with --tool-call-parser '
                f'({", ".join(TOOL_CALL_PARSERS)}); use "required", a named function or '
                '"none" here',
                param="tool_choice",
            )
        return cls(req.tools, mode, parallel=req.parallel_tool_calls, parser=parser)

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates read them (Hugging Face's ``tools=`` convention)."""
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @property
    def tool_prompt(self) -> ToolPrompt | None:
        """For ``auto``: how to show the tools when the chat template ignores them, in the
        format the parser reads (forced modes are steered by their grammar instead)."""
        return TOOL_PROMPTS[self.parser] if self.mode == "auto" and self.parser else None

    def constraint(self) -> StructuredOutputParams | None:
        """The grammar that forces ``required`` and ``named`` output."""
        if self.mode == "named":
            return StructuredOutputParams(json=json.dumps(self._parameters(self.name)))
        if self.mode != "required":
            return None
        calls: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "enum": [t.function.name]},
                            "parameters": self._parameters(t.function.name),
                        },
                        "required": ["name", "parameters"],
                        "additionalProperties": False,
                    }
                    for t in self.tools
                ]
            },
        }
        if not self.parallel:
            calls["maxItems"] = 1
        return StructuredOutputParams(json=json.dumps(calls))

    def _parameters(self, name: str | None) -> dict[str, Any]:
        tool = next(t for t in self.tools if t.function.name == name)
        return tool.function.parameters or NO_PARAMETERS

    def visible_len(self, text: str) -> int:
        """How much of the text generated so far may be streamed as ``content``: none when
        forced, and for ``auto`` everything before a tool call (or what may start one)."""
        if self.forced:
            return 0
        if self.mode != "auto":
            return len(text)
        opening = call_tags(self.parser)[0]
        at = text.find(opening)
        if at >= 0:
            return at
        for keep in range(min(len(opening) - 1, len(text)), 0, -1):
            if opening.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)

    def finish_reason(self, text: str, finish: str | None) -> str | None:
        """The choice's finish reason when its output ``text`` holds calls: ``tool_calls``
        when they are whole, else the engine's (``length`` or ``stop``: cut short). A named
        function's stays the engine's ``stop``, as OpenAI and vLLM answer a call the request
        forced by name."""
        if self.mode == "named" or not self.complete(text):
            return finish
        return "tool_calls"

    def complete(self, text: str) -> bool:
        """Whether a forced output holds whole calls: a stop string can end it part-way,
        as max_tokens can (the finish reason then stays the engine's)."""
        if self.mode == "named":
            try:
                json.loads(text)
            except (ValueError, RecursionError):  # RecursionError: nested too deep
                return False
            return True
        if self.mode == "required":
            calls = RequiredCalls()
            calls.feed(text)
            return bool(calls.calls) and not calls.open
        return True

    def extract(self, text: str) -> tuple[str | None, list[dict[str, Any]]] | None:
        """``(content, tool_calls)`` from the whole output, or None when it holds no tool
        call (plain text, or an ``auto`` call that does not parse). A forced call cut short
        by max_tokens is kept with the arguments it has, as its stream sent them (the
        choice's finish reason says ``length``). For ``auto``, ``tool_calls`` is empty when
        the model wrote an empty list of calls; ``content`` is then its text without it."""
        if self.mode == "named":
            return (None, [new_call(self.name or "", text)]) if text else None
        if self.mode == "required":
            calls = RequiredCalls()
            calls.feed(text)
            return (None, calls.calls) if calls.calls else None
        if self.mode == "auto":
            return parse_calls(text, call_tags(self.parser), self._parameter_types)
        return None

    def _parameter_types(self, function: str, parameter: str) -> str | None:
        """The JSON type the function's schema gives a parameter (the first that is not
        ``null`` of a list of types); None where it gives none."""
        tool = next((t for t in self.tools if t.function.name == function), None)
        properties = ((tool.function.parameters or {}) if tool else {}).get("properties")
        spec = properties.get(parameter) if isinstance(properties, dict) else None
        kind = spec.get("type") if isinstance(spec, dict) else None
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), None)
        return kind if isinstance(kind, str) else None


class ToolCallStream:
    """One streamed choice's deltas when the request has tools.

    A forced call's arguments stream as they are generated (the call's id and name in its
    first delta, as OpenAI streams them). For ``auto``, text that is, or may start, a tool
    call is held back, and the calls go whole into the choice's last chunk.
    """

    def __init__(self, tools: ToolCalling) -> None:
        self.tools = tools
        self.text = ""
        self.sent = 0
        """Characters of ``text`` already sent (as content or as arguments)."""
        self.call_id: str | None = None
        self.required = RequiredCalls()

    def update(self, new_text: str, finished: bool) -> tuple[list[dict[str, Any]], bool]:
        """The deltas to send for ``new_text`` (at least one), and, with the choice's last
        text, whether it ended in tool calls (its finish reason is then ``tool_calls``)."""
        self.text += new_text
        if self.tools.mode == "named":
            return self._named(new_text, finished)
        if self.tools.mode == "required":
            return self._required(new_text, finished)
        visible = self.tools.visible_len(self.text)
        deltas: list[dict[str, Any]] = []
        if finished:
            found = self.tools.extract(self.text)
            if found is not None and not found[1]:  # an empty list of calls: not content
                content = (found[0] or "")[self.sent :]
                self.sent = len(self.text)
                return [{"content": content} if content else {}], False
            if found is not None:
                if self.sent < visible:
                    deltas.append({"content": self.text[self.sent : visible]})
                calls = [{"index": k, **call} for k, call in enumerate(found[1])]
                return [*deltas, {"tool_calls": calls}], True
            visible = len(self.text)  # no call after all: what was held back is content
        content = self.text[self.sent : max(self.sent, visible)]
        self.sent = max(self.sent, visible)
        return [{"content": content} if content else {}], False

    def _required(self, new_text: str, finished: bool) -> tuple[list[dict[str, Any]], bool]:
        calls = self.required.feed(new_text)
        if finished and not self.required.calls:  # no call came: the text is the answer
            return [{"content": self.text}] if self.text else [{}], False
        called = finished and bool(self.required.calls) and not self.required.open
        return [{"tool_calls": calls} if calls else {}], called

    def _named(self, new_text: str, finished: bool) -> tuple[list[dict[str, Any]], bool]:
        called = False  # the finish reason stays the engine's (``ToolCalling.finish_reason``)
        if not new_text:
            return [{}], called
        if self.call_id is None:
            first = new_call(self.tools.name or "", new_text)
            self.call_id = first["id"]
            return [{"tool_calls": [{"index": 0, **first}]}], called
        return [{"tool_calls": [{"index": 0, "function": {"arguments": new_text}}]}], called


class RequiredCalls:
    """The calls of a forced ``required`` array (``[{"name": ..., "parameters": {...}}, ...]``)
    read as its text arrives, so that each call's arguments stream as they are generated, as
    vLLM and OpenAI stream them: ``feed`` returns chat tool-call deltas, the first of a call
    with its id and name once the name is whole and its arguments have begun.

    The arguments are the generated text of ``parameters`` as it is (a named function's are
    too), so a streamed call's deltas add up to the whole answer's. An element whose name or
    arguments cannot be read this way (a grammar that put ``parameters`` first) is sent
    whole when it closes."""

    def __init__(self) -> None:
        self.buffer = ""
        self.depth = 0
        self.in_string = self.escaped = False
        self.calls: list[dict[str, Any]] = []
        """The calls begun so far; the last is open until its element closes."""
        self.closed = 0
        """Calls whose element has closed."""
        self._new_element(0)

    def _new_element(self, start: int) -> None:
        self.element_start = start
        self.string_start: int | None = None
        self.last_string: str | None = None
        self.key: str | None = None
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.awaiting_args = False
        self.sent = 0
        """Characters of ``buffer`` sent as the open call's arguments."""

    @property
    def open(self) -> bool:
        """Whether a call has begun and its element has not closed (it was cut short)."""
        return len(self.calls) > self.closed

    def feed(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        base = len(self.buffer)
        self.buffer += text
        for i, ch in enumerate(text, base):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 2 and self.string_start is not None:
                        self.last_string = _string(self.buffer[self.string_start : i + 1])
                continue
            if self.awaiting_args and not ch.isspace():
                self.awaiting_args, self.args_start = False, i
            if ch == '"':
                self.in_string = True
                self.string_start = i
            elif ch in "[{":
                self.depth += 1
                if self.depth == 2:
                    self._new_element(i)
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 2 and self.args_start is not None and self.args_end is None:
                    self.args_end = i + 1
                elif self.depth == 1:
                    self._end_member(i)
                    self._close(i + 1, out)
            elif self.depth == 2 and ch == ":":
                self.key, self.last_string = self.last_string, None
                self.awaiting_args = self.key == "parameters" and self.args_start is None
            elif self.depth == 2 and ch == ",":
                self._end_member(i)
        self._send(out)
        return out

    def _end_member(self, at: int) -> None:
        if self.key == "name" and self.name is None:
            self.name = self.last_string
        if self.args_start is not None and self.args_end is None:  # a scalar's end
            self.args_end = at

    def _send(self, out: list[dict[str, Any]]) -> None:
        """The open call's arguments generated since the last send (a scalar's only whole)."""
        if self.name is None or self.args_start is None:
            return
        if self.args_end is None and self.buffer[self.args_start] not in "[{":
            return
        end = len(self.buffer) if self.args_end is None else self.args_end
        if not self.open and self.sent == 0:
            call = new_call(self.name, self.buffer[self.args_start : end])
            self.calls.append(call)
            # a copy: the call's arguments grow as they come; the delta has what came so far
            out.append({"index": len(self.calls) - 1, **call, "function": {**call["function"]}})
        elif end > self.sent:
            arguments = self.buffer[self.sent : end]
            self.calls[-1]["function"]["arguments"] += arguments
            out.append({"index": len(self.calls) - 1, "function": {"arguments": arguments}})
        self.sent = end

    def _close(self, end: int, out: list[dict[str, Any]]) -> None:
        self._send(out)
        if not self.open:  # not read as it came: the element whole, if it is a call
            try:
                c = json.loads(self.buffer[self.element_start : end])
                if not isinstance(c["name"], str):
                    return
                call = new_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
            except (ValueError, RecursionError, KeyError, TypeError):
                return
            self.calls.append(call)
            out.append({"index": len(self.calls) - 1, **call})
        self.closed = len(self.calls)


def _string(token: str) -> str | None:
    try:
        value = json.loads(token)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _describe(choice: object) -> str:
    if isinstance(choice, NamedToolChoice):
        return f"naming {choice.function.name!r}"
    return repr(choice)
