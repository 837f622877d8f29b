"""A request body becomes the engine's ``SamplingParams`` in one step (no server needed)."""

from __future__ import annotations

import dataclasses

import pytest

from conveyor.runtime.sampling_params import SamplingParams, StructuredOutputParams
from conveyor.runtime.server.protocol import ChatCompletionRequest, CompletionRequest


def test_fields_left_out_keep_the_sampling_defaults():
    req = CompletionRequest(prompt="hi", temperature=None, top_k=None)
    params = req.to_sampling_params(max_tokens=7, logprobs=None, structured_output=None)
    assert params == dataclasses.replace(SamplingParams(), max_tokens=7)


def test_given_fields_reach_the_sampling_params_unchanged():
    spec = StructuredOutputParams(regex="[ab]+")
    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}],
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        repetition_penalty=1.2,
        presence_penalty=0.3,
        frequency_penalty=-0.4,
        seed=11,
        stop="\n",
        stop_token_ids=[3],
        skip_special_tokens=False,
        include_stop_str_in_output=True,
        logit_bias={"42": -100},
    )
    params = req.to_sampling_params(max_tokens=9, logprobs=2, structured_output=spec)
    assert params == SamplingParams(
        max_tokens=9,
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        repetition_penalty=1.2,
        presence_penalty=0.3,
        frequency_penalty=-0.4,
        seed=11,
        stop=["\n"],
        stop_token_ids=[3],
        logprobs=2,
        skip_special_tokens=False,
        include_stop_str_in_output=True,
        logit_bias={42: -100.0},
        structured_output=spec,
    )


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
    ],
)
def test_a_refused_value_is_a_value_error_naming_its_field(fields, named):
    req = CompletionRequest(prompt="hi", **fields)
    with pytest.raises(ValueError) as exc:
        req.to_sampling_params(max_tokens=4, logprobs=None, structured_output=None)
    assert str(exc.value).split(" ", 1)[0] == named
