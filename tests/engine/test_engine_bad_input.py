"""Bad requests are refused with a ValueError naming the parameter, before entering the batch."""

from __future__ import annotations

import pytest

from conveyor.runtime import LLM, SamplingParams
from conveyor.runtime.engine.settings import EngineSettings


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -3}, "top_k must be -1"),
        ({"min_p": 2.0}, r"min_p must be in \[0, 1\]"),
        ({"logprobs": 50}, r"logprobs must be in \[0, 20\]"),
        ({"presence_penalty": 3.0}, r"presence_penalty must be in \[-2, 2\]"),
        ({"temperature": float("nan")}, "temperature"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_sampling_params_say_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"scheduler": "fifo"}, "scheduler must be one of continuous, static, none"),
        ({"block_size": 0}, "block_size must be a positive integer"),
        ({"mem_fraction_static": 1.5}, r"mem_fraction_static must be in \(0, 1\)"),
        ({"dtype": "int8"}, "dtype must be one of"),
        (
            {"piecewise_cuda_graph_max_tokens": -1},
            "piecewise_cuda_graph_max_tokens must be 0 .off. or a positive integer",
        ),
    ],
)
def test_engine_settings_say_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineSettings(**kwargs)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(
        "conveyor-tiny", max_total_tokens=1024, max_model_len=256, num_threads=1, device="cpu"
    )


def test_prompt_longer_than_the_context_is_refused(llm):
    with pytest.raises(ValueError, match=r"prompt 1: prompt is 300 tokens.*context length is 256"):
        llm.generate(["fine", "x" * 300], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished_requests(), "nothing entered the batch"


def test_empty_prompt_is_refused(llm):
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm.generate([""], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="prompt token ids must be integers"):
        llm.generate([[1, 2, 100_000]], SamplingParams(max_tokens=4))


def test_a_bad_request_does_not_disturb_the_others(llm):
    engine = llm.engine
    engine.add_request("good", "hello there", SamplingParams(max_tokens=6, temperature=0))
    engine.step()
    with pytest.raises(ValueError):
        engine.add_request("bad", "y" * 400, SamplingParams(max_tokens=6))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", "again", SamplingParams(max_tokens=6))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = [o for o in outputs if o.finished]
    assert [o.request_id for o in final] == ["good"]
    reference = llm.generate("hello there", SamplingParams(max_tokens=6, temperature=0))[0]
    assert final[0].output_token_ids == reference.token_ids


def test_output_never_exceeds_the_context(llm):
    out = llm.generate("z" * 250, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    assert len(out.prompt_token_ids) + len(out.token_ids) == 256
    assert out.finish_reason == "length"


def test_abort_frees_the_blocks(llm):
    engine = llm.engine
    engine.add_request("gone", "abandoned request", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    engine.abort_request("gone")
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("gone", "abort")]
    assert engine.block_manager.num_used_blocks == 0
    assert not engine.has_unfinished_requests()
