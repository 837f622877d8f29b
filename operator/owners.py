"""Owner references: every child names the LLMService (or, for the gateway, every LLMService)."""

from __future__ import annotations

from typing import Any

from conveyor.operator.names import API_VERSION, KIND


def owner_reference(llmservice: dict[str, Any], *, controller: bool = True) -> dict[str, Any]:
    """A reference to ``llmservice``; the controller one for its own children.

    ``blockOwnerDeletion`` makes a foreground deletion of the LLMService wait for the child.
    """
    meta = llmservice["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": controller,
        "blockOwnerDeletion": True,
    }
