"""``--scheduling-policy``: the waiting queue's order on a real engine (conveyor-tiny), and a
priority the policy does not read refused as vLLM refuses it. The orders themselves, on fake
token ids: ``test_scheduler.py``."""

from __future__ import annotations

import pytest

from conveyor.runtime import LLM, SamplingParams
from conveyor.runtime.engine.settings import EngineSettings

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16], [17, 18]]


def first_token_order(llm: LLM, priority: list[int] | None = None) -> list[int]:
    results = llm.generate(PROMPTS, GREEDY, priority=priority)
    return sorted(range(len(results)), key=lambda i: results[i].first_token_time)


def test_priority_runs_lower_values_first_with_the_same_outputs():
    with LLM(max_running_requests=1, scheduling_policy="priority") as llm:
        order = first_token_order(llm, priority=[3, 0, 2, -1])
        assert order == [3, 1, 2, 0]
        texts = [r.token_ids for r in llm.generate(PROMPTS, GREEDY, priority=[3, 0, 2, -1])]
    with LLM(max_running_requests=4) as fcfs:
        assert [r.token_ids for r in fcfs.generate(PROMPTS, GREEDY)] == texts
        assert first_token_order(fcfs) == [0, 1, 2, 3]


def test_lpm_runs_the_longest_cached_prefix_first():
    prefix = list(range(40, 104))  # 4 blocks of 16
    with LLM(max_running_requests=1, scheduling_policy="lpm") as llm:
        llm.generate([prefix + [1]], GREEDY)  # its blocks stay in the prefix cache
        prompts = [list(range(110, 174)) + [2], prefix[:32] + [3] * 33, prefix + [4]]
        results = llm.generate(prompts, GREEDY)
        order = sorted(range(3), key=lambda i: results[i].first_token_time)
        assert order == [2, 1, 0]


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_a_priority_the_policy_does_not_read_is_refused(policy):
    with LLM(scheduling_policy=policy) as llm:
        with pytest.raises(ValueError, match="--scheduling-policy priority"):
            llm.generate(PROMPTS[:2], GREEDY, priority=[0, 1])
        assert len(llm.generate(PROMPTS[:2], GREEDY, priority=[0, 0])) == 2


def test_an_unknown_policy_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority, lpm"):
        EngineSettings(scheduling_policy="sjf")


def test_priorities_must_match_the_prompts():
    with (
        LLM(scheduling_policy="priority") as llm,
        pytest.raises(ValueError, match="2 prompts but 1 priorities"),
    ):
        llm.generate(PROMPTS[:2], GREEDY, priority=[0])
