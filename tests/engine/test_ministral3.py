"""Ministral 3 scales its queries past its original context (Llama 4's
``llama_4_scaling_beta``), which Conveyor does not: it serves the context before that, where
the scale is 1 and its tokens are transformers' (the greedy suite), and says so."""

from __future__ import annotations

import pytest
from model_shapes import MINISTRAL3
from test_correctness import make_engine

ORIGINAL = MINISTRAL3["rope_parameters"]["original_max_position_embeddings"]


def test_the_served_context_stops_where_the_query_scale_begins(model_dirs):
    engine = make_engine(model_dirs, "ministral3")
    assert engine.state.max_model_len == ORIGINAL  # not max_position_embeddings' 4096
    assert make_engine(model_dirs, "ministral3", max_model_len=ORIGINAL // 2)
    with pytest.raises(ValueError, match=r"--max-model-len 1024 exceeds the context .*512"):
        make_engine(model_dirs, "ministral3", max_model_len=1024)
