"""The whole engine on the Triton backend (attention and the fused layers) against the torch one.

On CPU the kernels run in Triton's interpreter, which is slow: a short run. It
covers chunked prefill against a cached prefix (chunks of 32), a prefix-cache
hit, mixed decode + prefill steps and plain decode.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.runtime import LLM, SamplingParams

PROMPTS = [
    "Hello there, how are you doing today?",  # 37 tokens: two chunks
    "The quick brown fox",
    "Hello there, how are you doing today? Fine",  # shares two full blocks with the first
]


def _greedy(backend: str, device: str) -> tuple[list[list[int]], int]:
    llm = LLM(
        "conveyor-tiny",
        attention_backend=backend,
        device=device,
        max_total_tokens=2048,
        chunked_prefill_size=32,
        block_size=16,
    )
    out = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    return [o.token_ids for o in out], sum(o.num_cached_tokens for o in out)


def test_triton_backend_greedy_equals_torch(device):
    expected, _ = _greedy("torch", device.type)
    actual, cached = _greedy("triton", device.type)
    assert actual == expected
    assert cached > 0, "the prefix cache was not exercised"


def test_triton_backend_runs_a_moe_model_as_torch(device, tmp_path):
    """Qwen2-MoE's experts through ``fused_moe`` (and its shared expert): the torch backend's
    greedy tokens, prefill and decode."""
    from conveyor.runtime.model.builtin import generate_model

    config = dict(
        model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], hidden_size=64,
        intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, vocab_size=320,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="float32",
    )  # fmt: skip
    path = str(generate_model(tmp_path / "moe", config, seed=3))
    tokens = []
    for backend in ("torch", "triton"):
        llm = LLM(path, attention_backend=backend, device=device.type, max_total_tokens=512)
        out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=4))
        tokens.append([o.token_ids for o in out])
    assert tokens[1] == tokens[0]


def test_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from conveyor.runtime.layers.attention import select_backend

    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_backend("triton", torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graphs_greedy_equals_torch():
    """Decode replayed from CUDA graphs (batches padded to captured sizes, requests finishing at
    different steps) gives the torch backend's greedy ids, as does the eager Triton path."""
    from conveyor.bench.gpu.kernels import check_engine_greedy

    check_engine_greedy()
