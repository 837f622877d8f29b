"""Prompt logprobs (``SamplingParams.prompt_logprobs``, vLLM's): each prompt token's logprob
given the tokens before it, from the logits of the prompt's own rows.

The runner asks for the logits of these rows besides the sampled ones in the same step (one
``compute_logits`` on every tensor-parallel rank), and each sequence collects its prompt's
logprobs chunk by chunk; the engine hands them out on the request's first output and its last
(``LLMEngine._output``). Such a prompt is never read from the prefix cache (``Scheduler``):
a cached prefix has no logits.
"""

from __future__ import annotations

import torch

from conveyor.runtime.engine.scheduler import ScheduledBatch
from conveyor.runtime.engine.sequence import Sequence, TokenLogprob


def prompt_logprob_rows(batch: ScheduledBatch) -> list[tuple[Sequence, int, int]]:
    """(sequence, row among the step's tokens, prompt position it predicts) for each prompt
    token of this step whose logits give the next prompt token's logprob, for sequences that
    ask for prompt logprobs; positions already given (a preempted prompt computed again) are
    left out. The step's tokens lie in batch order (``layout_step``)."""
    found: list[tuple[Sequence, int, int]] = []
    row = 0
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        start = seq.num_computed_tokens
        if seq.params.prompt_logprobs is not None:
            done = max(1, len(seq.prompt_logprobs))  # position 0 has none
            for p in range(start, min(start + n, seq.num_prompt_tokens - 1)):
                if p + 1 >= done:
                    found.append((seq, row + p - start, p + 1))
        row += n
    return found


def add_prompt_logprobs(rows: list[tuple[Sequence, int, int]], logits: torch.Tensor) -> None:
    """Each row's logprob of the prompt token it predicts (and the top alternatives the
    request asks for), appended to its sequence's ``prompt_logprobs``."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (R, V)
    targets = torch.tensor([seq.token_ids[p] for seq, _, p in rows], device=logprobs.device)
    chosen_t = logprobs.gather(1, targets[:, None])  # (R, 1)
    ranks = ((logprobs > chosen_t).sum(dim=-1) + 1).tolist()
    chosen = chosen_t[:, 0].tolist()
    k = max(seq.params.prompt_logprobs or 0 for seq, _, _ in rows)
    top_ids: list[list[int]] = []
    top_lps: list[list[float]] = []
    if k:
        top = logprobs.topk(k, dim=-1)
        top_ids, top_lps = top.indices.tolist(), top.values.tolist()
    for i, (seq, _, p) in enumerate(rows):
        if not seq.prompt_logprobs:
            seq.prompt_logprobs.append(None)
        if len(seq.prompt_logprobs) != p:
            continue  # given already
        n = seq.params.prompt_logprobs or 0
        alternatives = list(zip(top_ids[i][:n], top_lps[i][:n], strict=True)) if n else []
        seq.prompt_logprobs.append(
            TokenLogprob(seq.token_ids[p], chosen[i], alternatives, rank=ranks[i])
        )
