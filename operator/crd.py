"""The LLMService CRD (``crds/llmservice.yaml``) and the schema defaults it declares.

The apiserver applies the schema's ``default`` values before anything reads an object;
:func:`apply_defaults` does the same from the same file, so unit tests (and any code that
reads a manifest from disk) see exactly what a handler sees on a real cluster.
"""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path
from typing import Any

import yaml

CRD_FILE = Path(__file__).resolve().parent.parent / "crds" / "llmservice.yaml"


def crd_text() -> str:
    """The CRD as written (the checkout's ``crds/llmservice.yaml``; the image keeps the checkout)."""
    return CRD_FILE.read_text()


@cache
def load_crd() -> dict[str, Any]:
    """The CRD manifest (parsed once per process; callers must not modify it)."""
    crd: dict[str, Any] = yaml.safe_load(crd_text())
    return crd


def schema() -> dict[str, Any]:
    """The OpenAPI v3 schema of the one served version."""
    (version,) = load_crd()["spec"]["versions"]
    openapi: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return openapi


def apply_defaults(obj: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``obj`` with the schema's defaults filled in, as the apiserver fills them."""
    result = copy.deepcopy(obj)
    _default(schema(), result)
    return result


def _default(node: dict[str, Any], value: Any) -> None:
    if isinstance(value, dict):
        for key, sub in (node.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                _default(sub, value[key])
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value.keys() - (node.get("properties") or {}).keys():
                _default(extra, value[key])
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for item in value:
            _default(node["items"], item)
