"""``SamplingParams.prompt_logprobs``: each prompt token's logprob given the tokens before it,
as transformers' forward pass gives them, over chunked prefills, on the torch and C++
attention paths, and whole even when the prompt's prefix is in the prefix cache."""

from __future__ import annotations

import random

import pytest
import torch

from conveyor.runtime import SamplingParams
from conveyor.runtime.engine.llm_engine import LLMEngine
from conveyor.runtime.engine.settings import EngineSettings
from conveyor.runtime.kernels import cpu
from conveyor.runtime.model.builtin import builtin_model_path


@pytest.fixture(scope="module")
def hf_logprobs():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(builtin_model_path(), dtype=torch.float32).eval()

    def logprobs(prompt: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)

    return logprobs


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_prompt_logprobs_equal_transformers(hf_logprobs, backend):
    if backend == "cpu" and (not cpu.enabled() or cpu.load() is None):
        pytest.skip(f"the CPU kernels are {cpu.load_error()}")
    engine = LLMEngine(
        EngineSettings(
            model=str(builtin_model_path()), device="cpu", attention_backend=backend,
            max_total_tokens=4096, num_threads=1, chunked_prefill_size=32,
        )
    )  # fmt: skip
    rng = random.Random(1)
    shared = [rng.randrange(256) for _ in range(48)]
    prompts = [shared + [1, 2, 3], [rng.randrange(256) for _ in range(70)], [7], shared + [4]]
    engine.add_request("warm", shared + [9], SamplingParams(max_tokens=1))  # fills the cache
    while engine.has_unfinished_requests():
        engine.step()
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)
        engine.add_request(f"r{i}", prompt, params)
    firsts: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                firsts.setdefault(out.request_id, out.prompt_logprobs)
    for i, prompt in enumerate(prompts):
        got = firsts[f"r{i}"]
        ref = hf_logprobs(prompt)
        assert len(got) == len(prompt) and got[0] is None
        for pos in range(1, len(prompt)):
            lp = got[pos]
            assert lp.token_id == prompt[pos]
            assert lp.logprob == pytest.approx(ref[pos - 1, prompt[pos]].item(), abs=1e-4)
            assert [t for t, _ in lp.top] == ref[pos - 1].topk(2).indices.tolist()
            # its rank among the vocabulary, as vLLM reports it (1: the likeliest); a token
            # within rounding of another may sit one place apart
            ref_rank = int((ref[pos - 1] > ref[pos - 1, prompt[pos]]).sum()) + 1
            assert abs(lp.rank - ref_rank) <= 1 and lp.rank >= 1


def test_prompt_logprobs_out_of_range_are_refused():
    with pytest.raises(ValueError, match=r"prompt_logprobs must be in \[0, 20\]"):
        SamplingParams(prompt_logprobs=21)
