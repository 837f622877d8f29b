"""The inference runtime: a continuous-batching engine over a paged KV cache.

``from conveyor.runtime import LLM, SamplingParams`` is the offline API. The
package import itself stays torch-free (the gateway and the operator import
metric names and schemas from here), so the engine is loaded lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from conveyor.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from conveyor.runtime.engine.llm import LLM
    from conveyor.runtime.engine.llm_engine import LLMEngine

__all__ = ["LLM", "LLMEngine", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from conveyor.runtime.engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from conveyor.runtime.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'conveyor.runtime' has no attribute {name!r}")
