"""``--reasoning-parser``: the thinking between <think> and </think> (Seed-OSS's <seed:think>
and </seed:think>) apart from the answer, whole and streamed in pieces of any size (a tag
split across pieces never leaks)."""

from __future__ import annotations

import pytest

from conveyor.runtime.server.reasoning import ReasoningParser, ReasoningStream

CASES = [
    # (parser, output, (reasoning, answer))
    ("qwen3", "<think>Two and two.</think>Four.", ("Two and two.", "Four.")),
    ("qwen3", "<think>\nhm\n</think>\n\nFour.", ("\nhm\n", "\n\nFour.")),
    ("qwen3", "Four.", (None, "Four.")),  # thinking off: the template closed it in the prompt
    ("qwen3", "<think>all thought</think>", ("all thought", None)),
    ("qwen3", "<thin", (None, "<thin")),  # not a tag after all
    ("qwen3", "a <think>b</think> c", (None, "a <think>b</think> c")),
    ("deepseek_r1", "Two and two.</think>Four.", ("Two and two.", "Four.")),
    ("deepseek_r1", "<think>Two.</think>Four.", ("Two.", "Four.")),
    ("deepseek_r1", "still thinking when cut off", ("still thinking when cut off", None)),
    ("deepseek_r1", "</think>", ("", None)),
    ("seed_oss", "<seed:think>Two and two.</seed:think>Four.", ("Two and two.", "Four.")),
    ("seed_oss", "Two.</seed:think>Four.", ("Two.", "Four.")),
    ("seed_oss", "<seed:think>cut off", ("cut off", None)),
    ("seed_oss", "<think>x</think>y", ("<think>x</think>y", None)),  # not Seed-OSS's tags
    (
        "seed_oss",
        "<seed:think>a<seed:cot_budget_reflect>5 used</seed:cot_budget_reflect>b</seed:think>c",
        ("a<seed:cot_budget_reflect>5 used</seed:cot_budget_reflect>b", "c"),
    ),
]


@pytest.mark.parametrize(("name", "output", "expected"), CASES)
def test_a_whole_output_splits_into_reasoning_and_answer(name, output, expected):
    assert ReasoningParser(name).split(output) == expected


@pytest.mark.parametrize("size", [1, 2, 3, 5, 100])
@pytest.mark.parametrize(("name", "output", "expected"), CASES)
def test_a_streamed_output_gives_the_same_parts_in_any_pieces(name, output, expected, size):
    stream = ReasoningStream(ReasoningParser(name))
    pieces = [output[i : i + size] for i in range(0, len(output), size)]
    reasoning = answer = ""
    for k, piece in enumerate(pieces):
        r, a = stream.update(piece, finished=k == len(pieces) - 1)
        reasoning, answer = reasoning + r, answer + a
    assert (reasoning, answer) == (expected[0] or "", expected[1] or "")


def test_an_unknown_parser_is_refused():
    with pytest.raises(
        ValueError, match="reasoning_parser must be one of qwen3, deepseek_r1, seed_oss"
    ):
        ReasoningParser("o1")
