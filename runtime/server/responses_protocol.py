"""The request body of OpenAI's Responses API (``POST /v1/responses``), and what it becomes.

A Responses request is a chat in other words: ``instructions`` is the system message,
``input`` the conversation (a string, or items: messages, function calls and their outputs),
``max_output_tokens`` the cap, ``text.format`` the structured output, and function tools are
flat (``{"type": "function", "name": ...}``) where chat nests them under ``function``.
``ResponsesRequest.to_chat`` writes it as the ``ChatCompletionRequest`` the chat path
serves, so both endpoints check, render and sample alike; ``serving_responses.py`` writes
the answer in the Responses shape. The sampling extensions vLLM and SGLang accept on chat
(``top_k``, ``seed``, ``stop``, ...) are accepted here too.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from conveyor.runtime.server.errors import bad_request
from conveyor.runtime.server.protocol import ChatCompletionRequest, GenerateRequestBody

LOGPROBS_INCLUDE = "message.output_text.logprobs"
"""The ``include`` entry that asks for each output token's logprob (and ``top_logprobs``)."""
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
"""Input roles and the chat role each is rendered as: chat templates know no ``developer``,
which OpenAI ranks with system messages."""
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
"""Content parts read as text (an assistant's earlier ``output_text`` or ``refusal`` too)."""
_CHAT_FIELDS = set(GenerateRequestBody.model_fields) - {
    "n",  # one output per response
    "stream_options",  # the Responses API's own stream_options is something else
    "response_format",  # text.format here
    "prompt_logprobs",  # not a Responses field; a chat completion answers it
}
"""Fields that go to the chat request as they are."""


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: str


class ResponsesRequest(GenerateRequestBody):
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    include: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    """Function tools, checked by ``to_chat`` (a hosted tool type is a 400 naming it)."""
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    """``{"format": {"type": "text" | "json_object" | "json_schema", ...}}``."""
    reasoning: dict[str, Any] | None = None
    """``{"effort": ...}`` goes to the chat template as ``reasoning_effort``."""
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    metadata: dict[str, str] | None = None
    truncation: Literal["disabled", "auto"] = "disabled"
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])

    @property
    def text_format(self) -> dict[str, Any] | None:
        """``text.format`` (checked by ``check``); None when not given."""
        fmt: dict[str, Any] | None = (self.text or {}).get("format")
        return fmt

    def check(self) -> None:
        """What is a field of the Responses API that this server cannot do: a 400 that says
        so, rather than an answer that ignores it."""
        if self.background:
            raise bad_request(
                "background responses are not supported here; send without background and "
                "stream the response (stream: true) to read it as it is generated",
                param="background",
            )
        if self.truncation == "auto":
            raise bad_request(
                'truncation "auto" (dropping the conversation\'s oldest items to fit) is not '
                'supported; send "disabled" and shorten the input yourself',
                param="truncation",
            )
        _check_format(self.text_format)
        if self.input == []:
            raise bad_request(
                "input has no items; send the user's message as a string or as items",
                param="input",
            )
        if "n" in self.model_fields_set and self.n != 1:
            raise bad_request("a response has one output; n is not a Responses field", param="n")

    def to_chat(self, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat completion request this response is served as. ``conversation``: its chat
        messages, the previous response's (``previous_response_id``) and this ``input``'s
        (``input_messages``); the ``instructions`` go before them."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        messages.extend(conversation)
        body: dict[str, Any] = {
            k: v for k, v in self.model_dump(include=_CHAT_FIELDS).items() if v is not None
        }
        body.update(
            messages=messages,
            max_completion_tokens=self.max_output_tokens,
            logprobs=self.wants_logprobs,
            top_logprobs=(self.top_logprobs or 0) if self.wants_logprobs else None,
            parallel_tool_calls=self.parallel_tool_calls,
            stream=self.stream,
        )
        if self.tools:
            body["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        if isinstance(self.tool_choice, NamedFunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if (fmt := _response_format(self.text_format)) is not None:
            body["response_format"] = fmt
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning and self.reasoning.get("effort") is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning["effort"])
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:  # a message or tool of the input that chat refuses
            raise bad_request(_describe(exc), param="input") from None


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a Responses ``input``: a string is one user message; items are
    messages, function calls (an assistant message's ``tool_calls``) and their outputs (tool
    messages). Item types this server cannot render are a 400 naming the item."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        kind = item.get("type", "message")
        param = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in ROLES:
                raise bad_request(
                    f"{param}.role must be one of {', '.join(ROLES)}, got {role!r}", param=param
                )
            messages.append({"role": ROLES[role], "content": _content(item.get("content"), param)})
        elif kind == "function_call":
            call = {
                "id": _text_field(item, "call_id", param),
                "type": "function",
                "function": {
                    "name": _text_field(item, "name", param),
                    "arguments": _text_field(item, "arguments", param),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the same turn's calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _content(output, param)
            call_id = _text_field(item, "call_id", param)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
        elif kind == "reasoning":
            continue  # an earlier turn's thinking: chat templates drop it from history too
        else:
            raise bad_request(
                f"{param} is a {kind!r} item, which this server cannot take; send messages, "
                "function_call and function_call_output items (a text-only model)",
                param=param,
            )
    return messages


ITEM_ID_PREFIXES = {
    "message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"
}  # fmt: skip


def input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The items of a Responses ``input`` as ``GET /v1/responses/{id}/input_items`` lists
    them (checked by ``input_messages`` first): a string is one user message; a message's
    string content becomes one text part; an item without an ``id`` gets one, and so does
    one whose id an earlier item has (a page's last id must say where the next begins)."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    items = []
    seen: set[str] = set()
    for given in value:
        item = {"type": "message", **given}
        kind = item["type"]
        if kind == "message":
            if isinstance(item.get("content"), str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": item["content"]}]
            item.setdefault("status", "completed")
        if not isinstance(item.get("id"), str) or item["id"] in seen:
            item["id"] = f"{ITEM_ID_PREFIXES.get(kind, kind)}_{uuid.uuid4().hex}"
        seen.add(item["id"])
        items.append(item)
    return items


def _content(content: Any, param: str) -> str | list[dict[str, str]]:
    """A message's content as chat takes it: a string, or text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param}.content must be a string or a list of parts", param=param)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise bad_request(
                f"{param}.content[{j}] is a {kind!r} part; this model reads text only "
                f"({', '.join(TEXT_PARTS[:2])})",
                param=param,
            )
        text = part.get("text", part.get("refusal"))
        if not isinstance(text, str):
            raise bad_request(f"{param}.content[{j}] has no text", param=param)
        parts.append({"type": "text", "text": text})
    return parts


def _describe(exc: ValidationError) -> str:
    """The first error pydantic found, as ``where: what``."""
    error = exc.errors()[0]
    return f"{'.'.join(str(p) for p in error['loc'])}: {error['msg']}"


def _text_field(item: dict[str, Any], name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad_request(f"{param}.{name} must be a string, got {value!r}", param=param)
    return value


def _chat_tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    """A flat Responses function tool as chat nests it; a hosted tool is a 400."""
    kind = tool.get("type")
    if kind != "function":
        raise bad_request(
            f"tools[{index}] is a {kind!r} tool; this server runs function tools only (the "
            "client runs them and sends back function_call_output items)",
            param="tools",
        )
    try:
        fn = FunctionTool.model_validate(tool)
    except ValidationError as exc:
        raise bad_request(f"tools[{index}].{_describe(exc)}", param="tools") from None
    return {"type": "function", "function": fn.model_dump(exclude={"type"}, exclude_none=True)}


FORMATS = ("text", "json_object", "json_schema")


def _check_format(fmt: Any) -> None:
    """``text.format``: one of ``FORMATS``; ``json_schema`` with its ``name`` and ``schema``."""
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in FORMATS:
        raise bad_request(
            f"text.format must be an object whose type is one of {', '.join(FORMATS)}, got "
            f"{fmt!r:.100}",
            param="text.format",
        )
    if kind == "json_schema" and not (
        isinstance(fmt.get("name"), str) and isinstance(fmt.get("schema"), dict)
    ):
        raise bad_request(
            "text.format of type json_schema needs a name (a string) and a schema (an object)",
            param="text.format",
        )


def _response_format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` (checked) as chat's ``response_format``; None for plain text."""
    if fmt is None or fmt["type"] == "text":
        return None
    if fmt["type"] == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": "json_object"}
