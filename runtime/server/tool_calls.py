"""Tool calling on chat completions: ``tool_choice`` into a grammar or a parser, and the
generated text back into OpenAI ``tool_calls``.

- ``none``: plain text.
- ``required`` / a named function: forced by a grammar, so the arguments always parse and
  match the function's parameter schema, on any model. ``required`` generates a JSON array
  of ``{"name", "parameters"}`` (one element unless ``parallel_tool_calls``); a named function
  generates its arguments object.
- ``auto``: the model writes its own tool-call format, read by the parser the server was
  started with (``--tool-call-parser``): ``hermes`` (Hermes, Qwen:
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one per call) or ``smollm2``
  (``<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>``). Both read either
  form, ``parameters`` for ``arguments``, and an empty list as "no call"; they differ in how
  ``tool_prompt.py`` shows the tools to a model whose chat template ignores them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from conveyor.runtime.sampling_params import StructuredOutputParams
from conveyor.runtime.server.errors import bad_request
from conveyor.runtime.server.protocol import ChatCompletionRequest, NamedToolChoice, Tool
from conveyor.runtime.server.settings import TOOL_CALL_PARSERS
from conveyor.runtime.server.tool_prompt import TOOL_PROMPTS, ToolPrompt

NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_HERMES_BLOCK = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.DOTALL)


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
        at = text.find(HERMES_OPEN)
        if at >= 0:
            return at
        for keep in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):
            if HERMES_OPEN.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)

    def extract(self, text: str) -> tuple[str | None, list[dict[str, Any]]] | None:
        """``(content, tool_calls)`` from the whole output, or None when it holds no tool
        call that parses (plain text, or a forced call cut short by max_tokens). For ``auto``,
        ``tool_calls`` is empty when the model wrote an empty list of calls; ``content`` is
        then its text without that list."""
        if self.mode == "named":
            try:
                json.loads(text)
            except (ValueError, RecursionError):  # RecursionError: nested too deep
                return None
            return None, [_call(self.name or "", text)]
        if self.mode == "required":
            # The grammar's array; its complete calls, should max_tokens or a stop string
            # have cut it short (a streamed choice has sent them as they closed).
            calls = [c for e in ArrayElements().feed(text) if (c := _required_call(e))]
            return (None, calls) if calls else None
        if self.mode == "auto":
            return _parse_hermes(text)
        return None


class ToolCallStream:
    """One streamed choice's deltas when the request has tools.

    A named function's arguments stream as they are generated (the call's id and name in
    the first delta, as OpenAI streams them). Otherwise text that is, or may start, a tool
    call is held back, and the calls go whole into the choice's last chunk.
    """

    def __init__(self, tools: ToolCalling) -> None:
        self.tools = tools
        self.text = ""
        self.sent = 0
        """Characters of ``text`` already sent (as content or as arguments)."""
        self.call_id: str | None = None
        self.elements = ArrayElements()
        """``required``: the forced array's elements, each sent as a call once it closes."""
        self.calls_sent = 0

    def update(self, new_text: str, finished: bool) -> tuple[list[dict[str, Any]], bool]:
        """The deltas to send for ``new_text`` (at least one), and whether the choice ended
        in tool calls (its finish reason is then ``tool_calls``)."""
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
        calls = []
        for element in self.elements.feed(new_text):
            if (call := _required_call(element)) is not None:
                calls.append({"index": self.calls_sent, **call})
                self.calls_sent += 1
        if calls:
            return [{"tool_calls": calls}], True
        if finished and not self.calls_sent:  # no whole call came: the text is the answer
            return [{"content": self.text}] if self.text else [{}], False
        return [{}], self.calls_sent > 0

    def _named(self, new_text: str, finished: bool) -> tuple[list[dict[str, Any]], bool]:
        called = finished and self.tools.extract(self.text) is not None
        if not new_text:
            return [{}], called
        if self.call_id is None:
            first = _call(self.tools.name or "", new_text)
            self.call_id = first["id"]
            return [{"tool_calls": [{"index": 0, **first}]}], called
        return [{"tool_calls": [{"index": 0, "function": {"arguments": new_text}}]}], called


class ArrayElements:
    """The elements of a JSON array as its text arrives: ``feed`` returns the text of each
    element that closed (an object or array at depth one), so that a forced ``required``
    call streams as soon as it is whole rather than with the choice's end."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escaped = False
        self.start: int | None = None
        self.buffer = ""

    def feed(self, text: str) -> list[str]:
        done = []
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
            elif ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
                if self.depth == 2:
                    self.start = i
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1 and self.start is not None:
                    done.append(self.buffer[self.start : i + 1])
                    self.start = None
        return done


def _required_call(element: str) -> dict[str, Any] | None:
    """One element of the ``required`` array as an OpenAI tool call; None if it is not one."""
    try:
        c = json.loads(element)
        return _call(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
    except (ValueError, RecursionError, KeyError, TypeError):
        return None


def _parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]] | None:
    at = text.find(HERMES_OPEN)
    if at < 0:
        return None
    calls = []
    for body in _HERMES_CALL.findall(text, at):
        try:
            parsed = json.loads(body)
        except (ValueError, RecursionError):  # RecursionError: nested too deep
            return None
        for c in parsed if isinstance(parsed, list) else [parsed]:
            if not isinstance(c, dict) or not isinstance(c.get("name"), str):
                return None
            args = c.get("arguments", c.get("parameters", {}))
            calls.append(_call(c["name"], json.dumps(args, ensure_ascii=False)))
    if not calls:  # "<tool_call>[]</tool_call>": the model said it calls nothing
        return _HERMES_BLOCK.sub("", text), []
    content = text[:at].strip()
    return content or None, calls


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _describe(choice: object) -> str:
    if isinstance(choice, NamedToolChoice):
        return f"naming {choice.function.name!r}"
    return repr(choice)
