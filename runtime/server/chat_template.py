"""Chat messages through the tokenizer's chat template to token ids: one path for
``/v1/chat/completions`` and ``/tokenize``. Runs on the tokenizer pool, not the event loop."""

from __future__ import annotations

import inspect
import json
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError, TemplateSyntaxError

from conveyor.runtime.server.errors import bad_request
from conveyor.runtime.server.protocol import ChatMessage, FunctionCall
from conveyor.runtime.server.tool_prompt import ToolPrompt

if TYPE_CHECKING:
    from conveyor.runtime.engine.llm_engine import LLMEngine


def render_chat(
    engine: LLMEngine,
    messages: list[ChatMessage],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    template_kwargs: dict[str, Any] | None,
    tools: list[dict[str, Any]] | None = None,
    tool_prompt: ToolPrompt | None = None,
    add_special_tokens: bool = False,
    max_tokens: int | None = None,
    keep_last: int | None = None,
) -> list[int]:
    """Chat template, then token ids (the template brings its own special tokens, so
    ``add_special_tokens`` is off unless asked for). With a ``tool_prompt``, tools that the
    template would drop are written into the conversation in that model family's format.
    ``max_tokens``: refuse a conversation too long for it unread; ``keep_last``: read only
    what the last this many tokens need (``encode_prompt``)."""
    tokenizer = engine.tokenizer
    if tokenizer.chat_template is None:
        raise bad_request(
            "this model's tokenizer has no chat template; use /v1/completions, or start the "
            "server with --chat-template",
            param="messages",
        )
    _check_template_kwargs(tokenizer, template_kwargs)
    conversation = [_as_dict(m) for m in messages]

    def render(conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        return tokenizer.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            **({"tools": tools} if tools else {}),
            **(template_kwargs or {}),
        )

    try:
        text = render(conversation, tools)
        if tools and tool_prompt is not None and text == render(conversation, None):
            text = render(tool_prompt.rewrite(conversation, tools), None)  # template ignores tools
    except (TemplateError, ValueError, TypeError) as exc:  # raise_exception, bad roles, kwargs
        raise bad_request(
            f"the chat template rejected these messages: {exc}", param="messages"
        ) from exc
    return engine.encode_prompt(
        text, add_special_tokens=add_special_tokens, max_tokens=max_tokens, keep_last=keep_last
    )


def use_chat_template(engine: LLMEngine, template: str) -> None:
    """``--chat-template``: ``template`` replaces the tokenizer's. One user message is
    rendered with it at start, so that a template that does not parse stops the server
    there, not at every request (a template may refuse that conversation: that is its own)."""
    engine.tokenizer.chat_template = template
    try:
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True
        )
    except TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template does not parse: {exc}") from None
    except (TemplateError, ValueError, TypeError):
        pass


def _check_template_kwargs(tokenizer: Any, template_kwargs: dict[str, Any] | None) -> None:
    """``chat_template_kwargs`` set the template's own variables (``enable_thinking``), never
    the rendering's arguments: ``chat_template`` would run a template of the client's in the
    server (the sandbox stops imports, not a loop of 10^10 steps), ``tokenize`` or
    ``return_dict`` would change what comes back."""
    if not template_kwargs:
        return
    refused = sorted(set(template_kwargs) & _rendering_arguments(tokenizer))
    if refused:
        raise bad_request(
            f"chat_template_kwargs sets the chat template's own variables (such as "
            f"enable_thinking), not {', '.join(refused)}; remove them",
            param="chat_template_kwargs",
        )


_RENDERING_ARGUMENTS: dict[type, frozenset[str]] = {}


def _rendering_arguments(tokenizer: Any) -> frozenset[str]:
    """The names the tokenizer's ``apply_chat_template`` takes (read once per class)."""
    cls = type(tokenizer)
    if cls not in _RENDERING_ARGUMENTS:
        names = {"messages", *inspect.signature(cls.apply_chat_template).parameters}
        names -= {"self", "documents"}  # documents: a template variable too (RAG templates)
        _RENDERING_ARGUMENTS[cls] = frozenset(names)
    return _RENDERING_ARGUMENTS[cls]


def _as_dict(m: ChatMessage) -> dict[str, Any]:
    content = m.content
    if isinstance(content, list):
        content = "".join(part.text for part in content)
    msg: dict[str, Any] = {"role": m.role, "content": content or ""}
    if m.name is not None:
        msg["name"] = m.name
    if m.tool_calls:
        msg["tool_calls"] = [
            {
                "id": call.id,
                "type": call.type,
                "function": {"name": call.function.name, "arguments": _arguments(call.function)},
            }
            for call in m.tool_calls
        ]
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    return msg


def _arguments(call: FunctionCall) -> Any:
    """Templates write ``arguments | tojson``, so they get the object, not its JSON text;
    text the parser refuses (not JSON, nested too deep, a number too long) stays text."""
    try:
        return json.loads(call.arguments)
    except (ValueError, RecursionError):
        return call.arguments
