"""What the sampler needs for a step's sequences, as tensors on the device.

Each row's temperature, top-p, top-k and min-p, its seeded generator (kept per request until
it ends), repetition/presence/frequency penalties with the row's prompt and output token
counts, the tokens it may not sample now (``min_tokens``, ``allowed_token_ids``, bad words),
its logit bias and its structured output's bitmask (``structured_output.py``); and, after
sampling, each row's logprobs as the requests asked for them.
"""

from __future__ import annotations

import torch

from conveyor.runtime.engine.sequence import Sequence, TokenLogprob
from conveyor.runtime.engine.step_inputs import to_device
from conveyor.runtime.engine.structured_output import StructuredOutputs
from conveyor.runtime.layers.sampler import SamplerOutput, SamplingTensors


class SamplingInputs:
    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self.generators: dict[str, torch.Generator] = {}
        self.eos_token_ids: tuple[int, ...] = ()  # set by the engine once derived
        self.structured_outputs: StructuredOutputs | None = None  # set by the engine

    def tensors(self, seqs: list[Sequence]) -> SamplingTensors:
        """The sampler's inputs for ``seqs``, one row each, on the device: temperature, top-p/k,
        min-p, seeded generators, penalties (with each row's prompt and output counts), the
        tokens banned (``min_tokens``, ``allowed_token_ids``, bad words), logit biases and
        the structured outputs' bitmask."""
        params = [s.params for s in seqs]
        n, vocab = len(seqs), self.vocab_size
        f32 = torch.float32
        top_k = [vocab if p.top_k in (-1, 0) else min(p.top_k, vocab) for p in params]
        t = SamplingTensors(
            temperature=self._tensor([p.temperature for p in params], f32),
            top_p=self._tensor([p.top_p for p in params], f32),
            top_k=self._tensor(top_k, torch.int64),
            min_p=self._tensor([p.min_p for p in params], f32),
            all_greedy=all(p.greedy for p in params),
            needs_top_k_top_p=any(
                p.top_p < 1.0 or k < vocab for p, k in zip(params, top_k, strict=True)
            ),
            needs_min_p=any(p.min_p > 0 for p in params),
            generators=[self.generator(s) for s in seqs],
            max_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
        )
        if any(p.needs_penalties for p in params):
            t.repetition_penalty = self._tensor([p.repetition_penalty for p in params], f32)
            t.presence_penalty = self._tensor([p.presence_penalty for p in params], f32)
            t.frequency_penalty = self._tensor([p.frequency_penalty for p in params], f32)
            prompt_mask = torch.zeros(n, vocab, dtype=torch.bool)
            counts = torch.zeros(n, vocab, dtype=torch.int64)
            for i, s in enumerate(seqs):
                prompt_mask[i, torch.tensor(s.prompt_token_ids)] = True
                out = s.output_token_ids
                if out:
                    counts[i].index_add_(
                        0, torch.tensor(out), torch.ones(len(out), dtype=torch.int64)
                    )
            t.prompt_mask = prompt_mask.to(self.device)
            t.output_counts = counts.to(self.device).to(f32)
        bans = [(i, s) for i, s in enumerate(seqs) if s.num_output_tokens < s.params.min_tokens]
        allowed = [(i, p.allowed_token_ids) for i, p in enumerate(params) if p.allowed_token_ids]
        words = [
            (i, w) for i, s in enumerate(seqs)
            if s.bad_words and (w := s.bad_words.banned(s.token_ids, s.num_output_tokens))
        ]  # fmt: skip
        if bans or allowed or words:
            banned = torch.zeros(n, vocab, dtype=torch.bool)
            for i, ids in allowed:  # every token but these
                banned[i] = True
                banned[i, torch.tensor(ids)] = False
            for i, ids in words:
                banned[i, torch.tensor([x for x in ids if x < vocab], dtype=torch.long)] = True
            for i, s in bans:
                ids = list(s.params.stop_token_ids)
                if not s.params.ignore_eos:
                    ids += list(self.eos_token_ids)
                ids = [x for x in ids if x < vocab]
                if ids:
                    banned[i, torch.tensor(ids)] = True
            t.banned = banned.to(self.device)
        biased = [(i, p.logit_bias) for i, p in enumerate(params) if p.logit_bias]
        if biased:
            bias = torch.zeros(n, vocab, dtype=f32)
            for i, b in biased:
                bias[i, torch.tensor(list(b))] = torch.tensor(list(b.values()), dtype=f32)
            t.logit_bias = bias.to(self.device)
        if self.structured_outputs is not None:
            masked = self.structured_outputs.bitmask(seqs)
            if masked is not None:
                mask, t.token_bitmask_rows = masked  # (N, ceil(V/32)), constrained rows
                t.token_bitmask = mask.to(self.device)
        return t

    def generator(self, seq: Sequence) -> torch.Generator | None:
        """A seeded request's own generator, made at its first sample and kept until it ends."""
        if seq.params.seed is None or seq.params.greedy:
            return None
        g = self.generators.get(seq.request_id)
        if g is None:
            g = torch.Generator(device=self.device).manual_seed(seq.params.seed)
            self.generators[seq.request_id] = g
        return g

    def release(self, request_id: str) -> None:
        """Forget a finished request's generator."""
        self.generators.pop(request_id, None)

    def _tensor(self, data: list[int] | list[float], dtype: torch.dtype) -> torch.Tensor:
        return to_device(data, dtype, self.device)


def token_logprobs(seqs: list[Sequence], out: SamplerOutput) -> list[TokenLogprob | None]:
    """Each sequence's sampled token's logprob and its top alternatives, as many as it
    asked for (None where it asked for none)."""
    if out.logprobs is None:
        return [None] * len(seqs)
    lps = out.logprobs.tolist()
    top_ids = out.top_ids.tolist() if out.top_ids is not None else []
    top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else []
    result: list[TokenLogprob | None] = []
    for i, s in enumerate(seqs):
        k = s.params.logprobs
        if k is None:
            result.append(None)
            continue
        top = list(zip(top_ids[i][:k], top_lps[i][:k], strict=True)) if k and top_ids else []
        result.append(TokenLogprob(token_id=int(out.token_ids[i]), logprob=lps[i], top=top))
    return result
