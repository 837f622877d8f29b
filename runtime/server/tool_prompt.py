"""Tools into the prompt for a model whose chat template ignores them.

vLLM and SGLang hand ``tools=`` to the chat template and nothing more: a template without a
tools section (SmolLM2's, for one) drops them silently, so with ``tool_choice: "auto"`` the
model never learns it has tools and never calls one. Here, when the server has a
``--tool-call-parser`` and the template renders the same prompt with and without the tools,
the conversation is rewritten in the format that parser's model family was trained on, and
then rendered without ``tools``:

- the tools and the call format go into the system message (after the user's own system
  text, if any);
- an assistant message's ``tool_calls`` become text in the family's call format;
- a ``role: tool`` message becomes a user message holding ``<tool_response>...``.

A template that does render tools is never touched.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _hermes_system(tools: list[dict[str, Any]]) -> str:
    listed = "\n".join(_json(t) for t in tools)
    return (
        "# Tools\n\n"
        "You may call one or more functions to help with the user's request. The function "
        "signatures are inside <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "For each call, answer with a JSON object holding the function's name and arguments "
        "inside <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def _hermes_calls(calls: list[dict[str, Any]]) -> str:
    return "\n".join(f"<tool_call>\n{_json(c)}\n</tool_call>" for c in calls)


def _smollm2_system(tools: list[dict[str, Any]]) -> str:
    functions = [t.get("function", t) for t in tools]
    return (
        "You are an expert in composing functions. You are given a question and a set of "
        "possible functions. Based on the question, make one or more function/tool calls to "
        "achieve the purpose. If none of the functions can be used, point it out and refuse "
        "to answer. If the question lacks parameters the function requires, point that out.\n\n"
        f"You have access to the following tools:\n<tools>{_json(functions)}</tools>\n\n"
        "The output MUST strictly follow this format, with NO other text. Make sure each "
        "parameter has the right type. If no function call is needed, make the tool calls an "
        "empty list '[]'.\n"
        "<tool_call>[\n"
        '{"name": "func_name1", "arguments": {"argument1": "value1", "argument2": "value2"}},\n'
        "... (more tool calls as required)\n"
        "]</tool_call>"
    )


def _smollm2_calls(calls: list[dict[str, Any]]) -> str:
    return f"<tool_call>{_json(calls)}</tool_call>"


def _xml_system(opening: str, closing: str) -> Callable[[list[dict[str, Any]]], str]:
    def system(tools: list[dict[str, Any]]) -> str:
        listed = "\n".join(_json(t) for t in tools)
        return (
            "# Tools\n\n"
            "You can call the functions listed inside <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            f"To call one, answer with this block and nothing after it, one {opening} block "
            "per call, one <parameter> per argument:\n"
            f"{opening}\n<function=FUNCTION_NAME>\n<parameter=ARGUMENT_NAME>\nvalue\n"
            f"</parameter>\n</function>\n{closing}"
        )

    return system


def _xml_calls(opening: str, closing: str) -> Callable[[list[dict[str, Any]]], str]:
    def calls(history: list[dict[str, Any]]) -> str:
        blocks = []
        for c in history:
            args = c["arguments"]
            if isinstance(args, str):  # OpenAI's messages carry them as JSON text
                try:
                    args = json.loads(args)
                except ValueError:
                    args = {}
            parameters = "".join(
                f"<parameter={k}>\n{v if isinstance(v, str) else _json(v)}\n</parameter>\n"
                for k, v in (args.items() if isinstance(args, dict) else ())
            )
            blocks.append(f"{opening}\n<function={c['name']}>\n{parameters}</function>\n{closing}")
        return "\n".join(blocks)

    return calls


@dataclass(frozen=True)
class ToolPrompt:
    """One model family's way of showing tools, calls and results in plain chat messages."""

    system: Callable[[list[dict[str, Any]]], str]
    """The tools (OpenAI ``tools`` objects) as the system text the family was trained on."""
    calls: Callable[[list[dict[str, Any]]], str]
    """Earlier calls (``{"name", "arguments"}``, arguments as an object) as assistant text."""

    def rewrite(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """The conversation (chat-template dicts) with the tools and the tool history as text."""
        system = self.system(tools)
        out: list[dict[str, Any]] = []
        if messages and messages[0]["role"] == "system" and messages[0]["content"]:
            out.append({**messages[0], "content": f"{messages[0]['content']}\n\n{system}"})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": system})
            messages = messages[1:] if messages and messages[0]["role"] == "system" else messages
        for m in messages:
            if m["role"] == "assistant" and m.get("tool_calls"):
                calls = self.calls(
                    [
                        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                        for c in m["tool_calls"]
                    ]
                )
                text = f"{m['content']}\n{calls}" if m["content"] else calls
                out.append({"role": "assistant", "content": text})
            elif m["role"] == "tool":
                out.append(
                    {
                        "role": "user",
                        "content": f"<tool_response>\n{m['content']}\n</tool_response>",
                    }
                )
            else:
                out.append(m)
        return out


TOOL_PROMPTS = {
    "hermes": ToolPrompt(system=_hermes_system, calls=_hermes_calls),
    "smollm2": ToolPrompt(system=_smollm2_system, calls=_smollm2_calls),
    "qwen3_coder": ToolPrompt(
        system=_xml_system("<tool_call>", "</tool_call>"),
        calls=_xml_calls("<tool_call>", "</tool_call>"),
    ),
    "seed_oss": ToolPrompt(
        system=_xml_system("<seed:tool_call>", "</seed:tool_call>"),
        calls=_xml_calls("<seed:tool_call>", "</seed:tool_call>"),
    ),
}
"""By ``--tool-call-parser``: Hermes / Qwen 2.5 (one ``<tool_call>{...}</tool_call>`` per call),
SmolLM2 (the 1.7B's function-calling format, ``<tool_call>[{...}, ...]</tool_call>``), and
Qwen3-Coder's and Seed-OSS's XML (``<function=NAME><parameter=KEY>value</parameter>``, in
``<tool_call>`` or ``<seed:tool_call>``)."""
