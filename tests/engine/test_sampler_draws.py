"""The sampler's draws: on a CPU, top-k / top-p samples come from each row's likeliest tokens
where those hold all it keeps, with the same masks as the full sort; the frequencies match the
distribution asked for; and the exponential noise is never 0 or infinite."""

from __future__ import annotations

import torch

from conveyor.runtime.layers import sampler as sampler_module
from conveyor.runtime.layers.sampler import (
    Sampler,
    SamplingTensors,
    _exponential_noise,
    _nucleus_candidates,
    _top_k_top_p,
)


def tensors(n: int, vocab: int, *, temperature=1.0, top_p=1.0, top_k=None, generators=None):
    top_k = torch.full((n,), vocab if top_k is None else top_k, dtype=torch.long)
    top_p = torch.full((n,), top_p) if not isinstance(top_p, torch.Tensor) else top_p
    return SamplingTensors(
        temperature=torch.full((n,), temperature),
        top_p=top_p,
        top_k=top_k,
        min_p=torch.zeros(n),
        all_greedy=False,
        needs_top_k_top_p=bool((top_p < 1).any() or (top_k < vocab).any()),
        needs_min_p=False,
        generators=generators or [None] * n,
    )


def test_candidate_masks_equal_the_full_sorts_where_they_hold_the_nucleus():
    torch.manual_seed(0)
    n, vocab = 64, 5000
    logits = torch.randn(n, vocab) * torch.linspace(0.5, 8, n)[:, None]  # flat to peaked
    top_p = torch.rand(n) * 0.98 + 0.01
    top_k = torch.where(torch.rand(n) < 0.3, torch.randint(1, 400, (n,)), torch.tensor(vocab))
    values, ids, exact = _nucleus_candidates(logits, top_k, top_p, 256)
    full = _top_k_top_p(logits, top_k, top_p)
    assert exact.any() and (~exact).any()  # both kinds of row are in this batch
    for row in exact.nonzero()[:, 0].tolist():
        scattered = torch.full((vocab,), float("-inf")).scatter_(0, ids[row], values[row])
        assert torch.equal(torch.isfinite(scattered), torch.isfinite(full[row]))
    # a row flagged as not held keeps a token beyond the candidates
    for row in (~exact).nonzero()[:, 0].tolist():
        kept = torch.isfinite(full[row]).sum().item()
        assert kept > values.shape[1]


def test_top_p_frequencies_are_the_nucleus_renormalised():
    vocab = 1000
    probs = torch.full((vocab,), 0.05 / (vocab - 3))
    probs[:3] = torch.tensor([0.5, 0.3, 0.15])  # before: 0, 0.5, 0.8; the 4th's 0.95 > 0.9
    logits = probs.log().repeat(4000, 1)
    torch.manual_seed(1)
    tokens = Sampler()._sample(logits, tensors(4000, vocab, top_p=0.9))
    freq = torch.bincount(tokens, minlength=vocab).float() / len(tokens)
    assert freq[3:].sum() == 0
    expected = torch.tensor([0.5, 0.3, 0.15]) / 0.95
    assert torch.allclose(freq[:3], expected, atol=0.03)


def test_full_vocabulary_frequencies_follow_the_temperature():
    vocab = 400
    logits = torch.linspace(0, 4, vocab).repeat(6000, 1)
    torch.manual_seed(2)
    tokens = Sampler()._sample(logits, tensors(6000, vocab, temperature=2.0))
    expected = torch.softmax(logits[0] / 2.0, -1)
    freq = torch.bincount(tokens, minlength=vocab).float() / len(tokens)
    top = expected.argsort(descending=True)[:20]
    assert torch.allclose(freq[top], expected[top], atol=0.01)


def test_a_batch_mixing_held_and_unheld_rows_draws_each_inside_its_mask(monkeypatch):
    monkeypatch.setattr(sampler_module, "NUCLEUS_CANDIDATES", (8, 64))
    vocab, n = 300, 6
    logits = torch.zeros(n, vocab)
    logits[:3, :2] = 10.0  # peaked rows: the nucleus is in the 8 candidates
    logits[3, :50] = 5.0  # in the 64 after that
    top_p = torch.tensor([0.9, 0.9, 0.9, 0.9, 0.99, 1.0])  # the last two keep ~300: the sort
    seeded = [torch.Generator().manual_seed(i) for i in range(n)]
    t = tensors(n, vocab, top_p=top_p, generators=seeded)
    first = Sampler()._sample(logits, t)
    assert (first[:3] < 2).all() and first[3] < 50 and (first < vocab).all()
    again = [torch.Generator().manual_seed(i) for i in range(n)]
    assert torch.equal(
        Sampler()._sample(logits, tensors(n, vocab, top_p=top_p, generators=again)), first
    )


def test_exponential_noise_is_positive_and_finite_even_at_the_uniforms_ends(monkeypatch):
    noise = _exponential_noise(torch.empty(4, 100_000), [None] * 4)
    assert torch.isfinite(noise).all() and (noise > 0).all()
    assert abs(noise.mean().item() - 1.0) < 0.02  # Exp(1)
    zeros = torch.zeros(3)
    monkeypatch.setattr(torch.Tensor, "uniform_", lambda self, **kw: self.copy_(zeros))
    edge = _exponential_noise(torch.empty(3), [None])
    assert torch.isfinite(edge).all() and (edge > 0).all()


def test_a_seeded_row_samples_the_same_whatever_else_is_in_its_batch():
    vocab = 3000
    torch.manual_seed(3)
    row = torch.randn(vocab) * 2
    others = torch.randn(3, vocab) * 2

    def draws(companions: int, top_k_others: int, top_p_others: float, top_p: float) -> list:
        gen = torch.Generator().manual_seed(42)
        logits = torch.cat([row[None, :], others[:companions]])
        n = 1 + companions
        top_k = torch.tensor([vocab] + [top_k_others] * companions)
        top_ps = torch.tensor([top_p] + [top_p_others] * companions)
        t = tensors(n, vocab, top_p=top_ps, generators=[gen] + [None] * companions)
        t.top_k = top_k
        t.needs_top_k_top_p = bool((top_ps < 1).any() or (top_k < vocab).any())
        return [Sampler()._sample(logits, t)[0].item() for _ in range(30)]

    for top_p in (0.9, 1.0):
        alone = draws(0, vocab, 1.0, top_p)
        assert draws(3, 1000, 0.5, top_p) == alone  # a wider top-k, a nucleus elsewhere
        assert draws(3, 5, 1.0, top_p) == alone


def test_the_noise_reaches_below_floats_step_near_zero(monkeypatch):
    # U just under 1 gives noise near 0: in float32 it could not come closer than 6e-8, so a
    # token a million times less likely than the top one was drawn too rarely
    monkeypatch.setattr(torch.Tensor, "uniform_", lambda self, **kw: self.fill_(1 - 1e-12))
    noise = _exponential_noise(torch.empty(2, 5), [None, None])
    assert torch.allclose(noise, torch.full((2, 5), 1e-12), rtol=1e-3, atol=0)
