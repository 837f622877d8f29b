"""Batched sampling: penalties, logit bias, grammar masks, temperature, top-k, top-p, min-p, seeds, logprobs.

One set of tensor ops for the whole batch; the only per-request loop draws
the random noise of requests that brought their own seed (each has its own
generator, so its output does not depend on what else is in the batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingTensors:
    """Per-row parameters of the sequences that sample this step; N rows."""

    temperature: torch.Tensor  # (N,) float32; 0 = greedy
    top_p: torch.Tensor  # (N,) float32
    top_k: torch.Tensor  # (N,) int64; vocab size = disabled
    min_p: torch.Tensor  # (N,) float32
    all_greedy: bool
    needs_top_k_top_p: bool
    needs_min_p: bool
    generators: list[torch.Generator | None]
    repetition_penalty: torch.Tensor | None = None  # (N,)
    presence_penalty: torch.Tensor | None = None  # (N,)
    frequency_penalty: torch.Tensor | None = None  # (N,)
    prompt_mask: torch.Tensor | None = None  # (N, V) bool: token occurs in the prompt
    output_counts: torch.Tensor | None = None  # (N, V) int: occurrences in the output
    banned: torch.Tensor | None = None  # (N, V) bool: EOS/stop ids before min_tokens, every
    # token but a request's allowed_token_ids, the last tokens of its bad_words due now
    logit_bias: torch.Tensor | None = None  # (N, V) float32: added to the logits
    token_bitmask: torch.Tensor | None = None  # (N, ceil(V/32)) int32: bit set = token allowed
    token_bitmask_rows: list[int] = field(default_factory=list)  # the rows it constrains
    max_logprobs: int = -1  # most top alternatives any row asked for; -1 = none asked


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # (N,)
    logprobs: torch.Tensor | None = None  # (N,) logprob of the sampled token
    top_ids: torch.Tensor | None = None  # (N, K)
    top_logprobs: torch.Tensor | None = None  # (N, K)


class Sampler:
    def __call__(self, logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
        """``logits`` (N, V) float32 -> one token per row."""
        raw_logprobs = torch.log_softmax(logits, dim=-1) if t.max_logprobs >= 0 else None
        logits = self._apply_penalties(logits, t)
        if t.logit_bias is not None:
            logits = logits + t.logit_bias
        if t.token_bitmask is not None:
            logits = apply_token_bitmask(logits, t.token_bitmask, t.token_bitmask_rows)
        if t.banned is not None:
            logits = logits.masked_fill(t.banned, float("-inf"))
        greedy = logits.argmax(dim=-1)
        if t.all_greedy:
            tokens = greedy
        else:
            tokens = torch.where(t.temperature == 0, greedy, self._sample(logits, t))
        out = SamplerOutput(tokens)
        if raw_logprobs is not None:
            out.logprobs = raw_logprobs.gather(1, tokens[:, None]).squeeze(1)
            if t.max_logprobs > 0:
                out.top_logprobs, out.top_ids = raw_logprobs.topk(t.max_logprobs, dim=-1)
        return out

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        if t.output_counts is None:
            return logits
        counts = t.output_counts
        seen = counts > 0
        if t.repetition_penalty is not None:
            p = t.repetition_penalty[:, None]  # (N, 1)
            mask = seen if t.prompt_mask is None else seen | t.prompt_mask  # (N, V)
            penalised = torch.where(logits > 0, logits / p, logits * p)
            logits = torch.where(mask, penalised, logits)
        if t.frequency_penalty is not None:
            logits = logits - t.frequency_penalty[:, None] * counts
        if t.presence_penalty is not None:
            logits = logits - t.presence_penalty[:, None] * seen
        return logits

    @staticmethod
    def _sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        temperature = torch.where(t.temperature == 0, torch.ones_like(t.temperature), t.temperature)
        logits = logits / temperature[:, None]
        min_p = t.min_p if t.needs_min_p else None
        if not t.needs_top_k_top_p:
            return _draw(logits, min_p, t.generators)
        if logits.device.type != "cpu":  # a GPU sorts a batch's vocabularies in microseconds
            return _draw(_top_k_top_p(logits, t.top_k, t.top_p), min_p, t.generators)
        # On a CPU a sort of 32 rows of 49k logits took 50 ms a step: draw from each row's
        # likeliest tokens instead, where they hold all it keeps (its top-k, or its nucleus's
        # mass); rows whose nucleus is wider try more of them, and the rest the full sort.
        n, vocab = logits.shape
        tokens = torch.empty(n, dtype=torch.long, device=logits.device)
        masks = (t.top_p < 1) | (t.top_k < vocab)
        all_rows = torch.arange(n, device=logits.device)
        if not bool(masks.all()):  # rows that mask nothing: the whole vocabulary
            free = all_rows[~masks]
            tokens[free] = _draw(logits[free], *_rows_of(free, min_p, t.generators))
        rows = all_rows[masks]
        for k in NUCLEUS_CANDIDATES:
            if not len(rows):
                return tokens
            part = logits if len(rows) == n else logits[rows]
            values, ids, held = _nucleus_candidates(part, t.top_k[rows], t.top_p[rows], k)
            done = rows[held]
            if len(done):
                if len(done) < len(rows):
                    values, ids = values[held], ids[held]
                picked = _draw(values, *_rows_of(done, min_p, t.generators), ids, vocab)
                tokens[done] = ids.gather(1, picked[:, None])[:, 0]
            rows = rows[~held]
        if len(rows):  # what is left: the whole vocabulary, sorted
            masked = _top_k_top_p(logits[rows], t.top_k[rows], t.top_p[rows])
            tokens[rows] = _draw(masked, *_rows_of(rows, min_p, t.generators))
        return tokens


def _rows_of(
    rows: torch.Tensor, min_p: torch.Tensor | None, generators: list[torch.Generator | None]
) -> tuple[torch.Tensor | None, list[torch.Generator | None]]:
    """``_draw``'s per-row arguments for some rows of the batch."""
    return None if min_p is None else min_p[rows], [generators[i] for i in rows.tolist()]


NUCLEUS_CANDIDATES = (256, 4096)
"""How many of each row's likeliest tokens a CPU draws top-k / top-p samples from, tried in
turn (a top-k beyond them asks for more); 256 and 4,096 of 49k take 2 and 9 ms for 32 rows,
a full sort 50."""


def _nucleus_candidates(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, candidates: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's K likeliest tokens (``candidates``, or its top-k if larger): their logits,
    -inf outside the row's top-k and nucleus (as ``_top_k_top_p`` masks them), their ids, and
    whether they hold every token the row keeps (its top-k within them, or its nucleus's mass
    reached within them)."""
    vocab = logits.shape[-1]
    asked_k = int(torch.where(top_k < vocab, top_k, 0).max())
    k = min(vocab, max(candidates, asked_k))
    values, ids = logits.topk(k, dim=-1)  # (N, K), likeliest first
    probs = (values - logits.logsumexp(dim=-1, keepdim=True)).exp()  # of the whole vocabulary
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
    ranks = torch.arange(k, device=logits.device)[None, :]
    nucleus = top_p < 1  # a top-p of 1 keeps every token (rounding must not drop its tail)
    outside = (ranks >= top_k[:, None]) | (nucleus[:, None] & (before > top_p[:, None]))
    exact = (top_k <= k) | (nucleus & (probs.sum(dim=-1) > top_p)) | (k == vocab)
    return values.masked_fill(outside, float("-inf")), ids, exact


def _draw(
    logits: torch.Tensor,
    min_p: torch.Tensor | None,
    generators: list[torch.Generator | None],
    ids: torch.Tensor | None = None,
    vocab: int = 0,
) -> torch.Tensor:
    """One column per row, drawn from softmax(logits) with min-p applied: the exponential race,
    argmax(p / E) with E ~ Exp(1) (the Gumbel trick). ``ids``: the token each column is, where
    the columns are candidates out of a ``vocab``-token vocabulary."""
    probs = torch.softmax(logits, dim=-1)
    if min_p is not None:
        top = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < min_p[:, None] * top, 0.0)
    return (probs / _exponential_noise(probs, generators, ids, vocab)).argmax(dim=-1)


def _exponential_noise(
    like: torch.Tensor,
    generators: list[torch.Generator | None],
    ids: torch.Tensor | None = None,
    vocab: int = 0,
) -> torch.Tensor:
    """Exp(1) noise shaped like ``like``, each row from its request's generator where it has one.

    -log U for U uniform in float64, kept off 0: 3x faster on a CPU than ``exponential_``,
    never 0 or infinite (which would pick a token, or never pick it, whatever its
    probability), and fine enough near 0 that a token a million times less likely than the
    top one is drawn as often as it should be (float32's 2^-24 steps drew it 3% too rarely).
    A seeded row draws the whole vocabulary's noise in token order and takes its candidates'
    (``ids``), so what it samples does not depend on the rest of its batch."""
    noise = torch.empty(like.shape, dtype=torch.float64, device=like.device)
    if all(g is None for g in generators):
        noise.uniform_()
    else:
        for i, g in enumerate(generators):
            if g is None:
                noise[i].uniform_()
            elif ids is None:
                noise[i].uniform_(generator=g)
            else:
                whole = torch.empty(vocab, dtype=torch.float64, device=like.device)
                noise[i] = whole.uniform_(generator=g)[ids[i]]
    return noise.clamp_(min=torch.finfo(torch.float64).tiny).log_().neg_().to(like.dtype)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus with -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (N, V)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    outside = ranks >= top_k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
    outside |= before > top_p[:, None]  # the top token always stays (its before is 0)
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]
) -> torch.Tensor:
    """-inf, in place, wherever ``bitmask`` (N, ceil(V/32)) has a clear bit, in ``rows`` only.

    On the CPU xgrammar's C++ kernel does it (3x faster than tensor ops on a 150k vocabulary);
    elsewhere tensor ops on the constrained rows, so no kernel has to be built for the device.
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        import xgrammar

        xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
        return logits
    idx = torch.tensor(rows, device=logits.device)
    allowed = _unpack_bits(bitmask[idx], logits.shape[-1])  # (M, V)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
    return logits


def _unpack_bits(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """(M, W) int32 words -> (M, vocab) bool, bit ``j`` of word ``w`` being token ``32 w + j``
    (little-endian words: byte ``k`` holds tokens ``32 w + 8 k`` onwards)."""
    byte_values = torch.arange(256, device=bitmask.device)
    table = (
        (byte_values[:, None] >> torch.arange(8, device=bitmask.device)) & 1
    ).bool()  # (256, 8)
    as_bytes = bitmask.contiguous().view(torch.uint8).long()  # (M, 4W)
    return table[as_bytes].flatten(1)[:, :vocab]  # (M, V)
