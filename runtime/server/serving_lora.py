"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``, as vLLM serves them
(with ``--allow-runtime-lora-updating``): LoRA adapters added to and removed from a running
replica, as operators and KServe's or AIBrix's adapter controllers drive them.

The adapter is read and checked on a worker thread; only its copy into a device slot runs
on the engine thread, between two steps. An unloaded adapter takes no new requests at once;
its slot is emptied when the requests already running with it have finished.
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import TYPE_CHECKING, Annotated

from fastapi import Response
from pydantic import BaseModel, ConfigDict, Field

from conveyor.runtime.engine.settings import AdapterError, check_adapter_name
from conveyor.runtime.server.context import ServerContext
from conveyor.runtime.server.errors import NOT_FOUND, APIError, bad_request
from conveyor.runtime.server.serving_common import check_engine

if TYPE_CHECKING:
    from conveyor.runtime.engine.llm_engine import LLMEngine
    from conveyor.runtime.layers.lora import Adapter


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: Annotated[str, Field(min_length=1, description="the name requests send as model")]
    lora_path: Annotated[
        str, Field(min_length=1, description="the adapter's folder on the replica")
    ]
    load_inplace: bool = Field(
        default=False, description="replace a loaded adapter of this name with the folder's"
    )


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: Annotated[str, Field(min_length=1, description="the adapter to unload")]
    lora_int_id: int | None = Field(default=None, description="accepted, as vLLM has it; unused")


async def load_lora_adapter(ctx: ServerContext, req: LoadLoRAAdapterRequest) -> Response:
    check_engine(ctx)
    engine = ctx.client.engine
    assert engine is not None
    name = req.lora_name
    try:
        check_adapter_name(name)
    except AdapterError as exc:
        raise bad_request(str(exc), param="lora_name") from None
    if name == ctx.model_name:
        raise bad_request(
            f"{name!r} is the base model's name; give the adapter another", param="lora_name"
        )
    if name in ctx.loras and not req.load_inplace:
        raise bad_request(
            f"LoRA adapter {name!r} is already loaded; unload it first, or send load_inplace: true",
            param="lora_name",
        )
    try:
        adapter = await asyncio.to_thread(engine.runner.read_lora, name, req.lora_path)
    except AdapterError as exc:
        raise bad_request(str(exc), param="lora_path") from None
    try:
        ctx.loras = await ctx.client.call(partial(_load, adapter, req.load_inplace))
    except AdapterError as exc:
        raise bad_request(str(exc), param="lora_name") from None
    return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")


async def unload_lora_adapter(ctx: ServerContext, req: UnloadLoRAAdapterRequest) -> Response:
    check_engine(ctx)
    name = req.lora_name
    if name not in ctx.loras:
        raise APIError(
            NOT_FOUND,
            f"LoRA adapter {name!r} is not loaded (GET /v1/models lists those that are)",
            param="lora_name",
            code="model_not_found",
        )
    del ctx.loras[name]  # no new request may name it from here on
    try:
        ctx.loras = await ctx.client.call(partial(_unload, name))
    except AdapterError as exc:
        raise bad_request(str(exc), param="lora_name") from None
    return Response(
        f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain"
    )


# On the engine thread. Each answers with the adapters requests may then name: calls run in
# order there, so the last answer to arrive is what the engine serves, even where a load and
# an unload of one name race.


def _load(adapter: Adapter, replace: bool, engine: LLMEngine) -> dict[str, str]:
    engine.loras.load(adapter, replace=replace)
    return engine.loras.served()


def _unload(name: str, engine: LLMEngine) -> dict[str, str]:
    engine.loras.unload(name)
    return engine.loras.served()
