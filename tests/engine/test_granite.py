"""Granite beside transformers: what the shared correctness tests (``model_dirs``'s
``granite``: batching, chunking, preemption, prefix caching, tensor parallelism, LoRA) do not
reach. Its logits' divisor never changes a greedy token, only logprobs."""

from __future__ import annotations

import random

import pytest
import torch
from model_shapes import GRANITE
from test_correctness import greedy_logprobs, make_engine

from conveyor.runtime.engine.llm_engine import LLMEngine
from conveyor.runtime.engine.settings import EngineSettings
from conveyor.runtime.kernels import cpu
from conveyor.runtime.model.builtin import generate_model


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_logprobs_are_of_the_divided_logits(model_dirs, backend):
    """Each generated token's logprob and top alternatives are transformers', whose logits
    are divided by ``logits_scaling``; undivided ones would give other numbers."""
    if backend == "cpu" and (not cpu.enabled() or cpu.load() is None):
        pytest.skip(f"the CPU kernels are {cpu.load_error()}")
    from transformers import AutoModelForCausalLM

    path = model_dirs["granite"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert hf.config.logits_scaling != 1
    engine = make_engine(model_dirs, "granite", attention_backend=backend)
    prompt = [random.Random(3).randrange(256) for _ in range(30)]
    logprobs = greedy_logprobs(engine, prompt, 4, 3)
    tokens = prompt + [lp.token_id for lp in logprobs]
    with torch.inference_mode():
        logits = hf(torch.tensor([tokens])).logits[0].float()
    divided = torch.log_softmax(logits, -1)
    undivided = torch.log_softmax(logits * hf.config.logits_scaling, -1)
    for i, lp in enumerate(logprobs):
        row = len(prompt) - 1 + i
        assert lp.logprob == pytest.approx(divided[row, lp.token_id].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == divided[row].topk(3).indices.tolist()
        assert abs(undivided[row, lp.token_id].item() - lp.logprob) > 1e-2  # the divisor matters


def test_a_bfloat16_checkpoint_served_in_float32_scales_its_residuals_exactly(tmp_path):
    """Granite's residual multiplier is folded into weights at load; a bf16 checkpoint's
    must be scaled in float32, not rounded to bf16 once more before it is served."""
    from safetensors.torch import load_file, save_file

    path = generate_model(tmp_path / "g", dict(GRANITE, residual_multiplier=0.22), seed=3)
    weights = {k: v.to(torch.bfloat16) for k, v in load_file(path / "model.safetensors").items()}
    save_file(weights, str(path / "model.safetensors"))
    engine = LLMEngine(EngineSettings(model=str(path), device="cpu", dtype="float32"))
    o_proj = engine.runner.model.layers[0].self_attn.o_proj.weight
    want = weights["model.layers.0.self_attn.o_proj.weight"].float() * 0.22
    assert torch.equal(o_proj, want)
