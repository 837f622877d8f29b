"""What a request is routed by: its model and a stable hash of its prompt's leading blocks
and its ``cache_salt`` (and, for a response that continues a stored one, the replica that
stores it).

The gateway has no tokenizer, so the prompt is cut in blocks of characters. A chat is keyed
by its opening (system messages and the first user message), which every later turn of the
same conversation repeats: all turns land where the conversation's prefix is cached. A plain
completion prompt is keyed by its leading whole blocks, up to a maximum.

The hash is blake2b, not ``hash()``: every gateway replica must compute the same key for the
same prompt, and Python salts ``hash()`` per process.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from conveyor.contracts.response_id import tag_of


def stable_hash(data: bytes) -> int:
    """64-bit hash that is the same in every process."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones
        return "".join(
            part.get("text", "")
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def _responses_opening(body: dict[str, Any]) -> str:
    """A Responses request's opening, written as a chat's: its instructions and its input up
    to the first user message."""
    instructions = body.get("instructions")
    parts = [f"system\n{instructions}\n"] if isinstance(instructions, str) and instructions else []
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, dict):
            continue
        role = item.get("role", item.get("type"))
        parts.append(f"{role}\n{_content_text(item.get('content'))}\n")
        if role == "user":
            break
    return "".join(parts)


def routing_text(path: str, body: dict[str, Any]) -> str:
    """The text whose leading blocks are hashed: a chat's opening, or the completion prompt."""
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            return ""
        parts: list[str] = []
        for message in messages:
            if not isinstance(message, dict):
                continue
            role = message.get("role")
            parts.append(f"{role}\n{_content_text(message.get('content'))}\n")
            if role == "user":
                break
        return "".join(parts)
    if path.endswith("/responses"):
        return _responses_opening(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of prompts goes where its first one is cached
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):  # token ids
        return ",".join(str(token) for token in prompt)
    return ""


def prefix_key(text: str, block_chars: int, max_blocks: int) -> int:
    """Hash of the leading whole blocks of ``text`` (all of it when shorter than one block)."""
    blocks = min(len(text) // block_chars, max_blocks)
    prefix = text[: blocks * block_chars] if blocks else text
    return stable_hash(prefix.encode("utf-8", "surrogatepass"))


@dataclass
class RouteRequest:
    """One request as the policies see it; the key is computed only if a policy asks for it."""

    path: str
    body: dict[str, Any]
    block_chars: int = 128
    max_blocks: int = 32

    @cached_property
    def key(self) -> int:
        """The prompt's prefix key; with vLLM's ``cache_salt``, one of that salt's own (a
        replica shares cached blocks only between requests with the same salt)."""
        key = prefix_key(routing_text(self.path, self.body), self.block_chars, self.max_blocks)
        salt = self.body.get("cache_salt")
        if isinstance(salt, str) and salt:
            key = stable_hash(key.to_bytes(8, "big") + salt.encode("utf-8", "surrogatepass"))
        return key

    @property
    def priority(self) -> int:
        """vLLM's ``priority`` (lower first), which orders requests held at the gateway, read
        as the replica reads it (``true``, ``5.0`` and ``"5"`` are integers to pydantic); 0
        when absent or not one (the replica answers that 400)."""
        value = self.body.get("priority", 0)
        if isinstance(value, (bool, int)):
            return int(value)
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                return 0
        return 0

    @cached_property
    def response_tag(self) -> str | None:
        """The tag of the replica holding the response this one continues
        (``previous_response_id``), which it must go to; None for any other request."""
        previous = self.body.get("previous_response_id")
        return tag_of(previous) if isinstance(previous, str) else None
