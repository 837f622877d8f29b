"""The inference runtime: a continuous-batching engine over a paged KV cache.

``from conveyor.runtime import LLM, SamplingParams`` is the offline API. The
package import itself stays torch-free (the gateway and the operator import
metric names and schemas from here), so the engine is loaded lazily.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

# OpenMP threads that spin while waiting for work cost a CPU engine step 20x
# when the cores are shared (measured on 2 cores under load: 376 ms vs 17 ms
# per step). libgomp reads this once, when torch is first imported, which in
# Conveyor's processes happens after this package is imported. An explicit
# setting in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from conveyor.runtime.sampling_params import SamplingParams, StructuredOutputParams

if TYPE_CHECKING:
    from conveyor.runtime.engine.llm import LLM
    from conveyor.runtime.engine.llm_engine import LLMEngine

__all__ = ["LLM", "LLMEngine", "SamplingParams", "StructuredOutputParams"]


def __getattr__(name: str):
    if name == "LLM":
        from conveyor.runtime.engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from conveyor.runtime.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'conveyor.runtime' has no attribute {name!r}")
