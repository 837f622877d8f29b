"""The request fields that constrain the output, read into one ``StructuredOutputParams``,
and its grammar compiled off the event loop and off the engine thread.

Accepted, one per request: OpenAI's ``response_format`` (``json_object``, ``json_schema``
strict or not), vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` and its newer ``structured_outputs`` object.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from conveyor.runtime.sampling_params import StructuredOutputParams
from conveyor.runtime.server.context import ServerContext
from conveyor.runtime.server.errors import bad_request
from conveyor.runtime.server.protocol import GenerateRequestBody

if TYPE_CHECKING:
    import xgrammar

STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def structured_output(req: GenerateRequestBody) -> tuple[StructuredOutputParams, str] | None:
    """The request's constraint and the field it came in, or None; 400 naming the field."""
    found: list[tuple[StructuredOutputParams, str]] = []
    if req.response_format is not None:
        spec = _response_format(req.response_format)
        if spec is not None:
            found.append((spec, "response_format"))
    if req.guided_json is not None:
        found.append(
            (StructuredOutputParams(json=_schema(req.guided_json, "guided_json")), "guided_json")
        )
    if req.guided_regex is not None:
        found.append((StructuredOutputParams(regex=req.guided_regex), "guided_regex"))
    if req.guided_choice is not None:
        found.append((StructuredOutputParams(choice=tuple(req.guided_choice)), "guided_choice"))
    if req.guided_grammar is not None:
        found.append((StructuredOutputParams(grammar=req.guided_grammar), "guided_grammar"))
    if req.structured_outputs is not None:
        found.append((_structured_outputs(req.structured_outputs), "structured_outputs"))
    if not found:
        return None
    if len(found) > 1:
        names = " and ".join(param for _, param in found)
        raise bad_request(
            f"give one way to constrain the output, got {names}; keep one of them",
            param=found[1][1],
        )
    spec, param = found[0]
    try:
        spec.validate()
    except ValueError as exc:
        raise bad_request(str(exc).replace("structured_output", param, 1), param=param) from None
    return spec, param


def _response_format(rf: dict[str, Any]) -> StructuredOutputParams | None:
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputParams(json_object=True)
    if kind != "json_schema":
        raise bad_request(
            f"response_format type must be text, json_object or json_schema, got {kind!r}",
            param="response_format",
        )
    spec = rf.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise bad_request(
            'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
            param="response_format",
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(
            f"response_format json_schema.strict must be a boolean, got {strict!r}",
            param="response_format",
        )
    return StructuredOutputParams(
        json=_schema(spec["schema"], "response_format"), strict=bool(strict)
    )


def _structured_outputs(so: dict[str, Any]) -> StructuredOutputParams:
    unknown = sorted(set(so) - set(STRUCTURED_OUTPUTS_KEYS))
    if unknown:
        raise bad_request(
            f"structured_outputs takes {', '.join(STRUCTURED_OUTPUTS_KEYS)}; unknown {unknown}",
            param="structured_outputs",
        )
    fields: dict[str, Any] = {}
    for key, value in so.items():
        if value is None:
            continue
        if key == "json":
            fields["json"] = _schema(value, "structured_outputs")
        elif key == "json_object":
            if not isinstance(value, bool):
                raise bad_request(
                    "structured_outputs json_object must be a boolean", param="structured_outputs"
                )
            fields["json_object"] = value
        elif key == "choice":
            if not isinstance(value, list):
                raise bad_request(
                    "structured_outputs choice must be a list of strings",
                    param="structured_outputs",
                )
            fields["choice"] = tuple(value)
        else:
            if not isinstance(value, str):
                raise bad_request(
                    f"structured_outputs {key} must be a string", param="structured_outputs"
                )
            fields[key] = value
    return StructuredOutputParams(**fields)


def _schema(schema: Any, param: str) -> str:
    """A JSON schema given as an object or as its JSON text, serialised."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as exc:  # nested too deep, a number too long
            raise bad_request(
                f"{param}: the JSON schema is not valid JSON ({exc})", param=param
            ) from None
    if not isinstance(schema, dict):
        raise bad_request(
            f"{param}: a JSON schema must be an object, got {type(schema).__name__}", param=param
        )
    return json.dumps(schema)


async def compile_grammar(
    ctx: ServerContext, spec: StructuredOutputParams, param: str
) -> xgrammar.CompiledGrammar:
    """The compiled grammar, built on the grammar pool (cached by the library, so a schema
    seen before costs microseconds); a grammar the library refuses is a 400 saying why."""
    assert ctx.client.engine is not None
    grammars = ctx.client.engine.structured_outputs
    try:
        return await asyncio.get_running_loop().run_in_executor(
            ctx.grammar_pool, grammars.compile, spec
        )
    except ValueError as exc:  # GrammarError; caught by its base so torch stays unimported
        raise bad_request(
            f"{param}: the grammar library cannot compile this: {exc}",
            param=param,
            code="unsupported_grammar",
        ) from None
