"""The engine: one ``step()`` is schedule, run the model, postprocess.

Not thread-safe: one thread owns an engine. The HTTP server runs it on its own
thread behind a narrow client (submit, stream outputs, abort); the offline
``LLM`` calls it directly. A tensor-parallel engine owns processes (its other ranks):
``close()`` stops them.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from conveyor.runtime.engine.bad_words import BadWords
from conveyor.runtime.engine.block_manager import BlockManager
from conveyor.runtime.engine.lora_table import LoRATable
from conveyor.runtime.engine.model_runner import ModelRunner, Sample
from conveyor.runtime.engine.outputs import EngineStats, RequestOutput
from conveyor.runtime.engine.platform import configure_threads
from conveyor.runtime.engine.sampling_defaults import (
    GENERATION_CONFIG_CHOICES,
    sampling_defaults,
)
from conveyor.runtime.engine.scheduler import ScheduledBatch, Scheduler
from conveyor.runtime.engine.sequence import FinishReason, Sequence
from conveyor.runtime.engine.settings import EngineSettings
from conveyor.runtime.engine.state import EngineState
from conveyor.runtime.engine.structured_output import StructuredOutputs
from conveyor.runtime.engine.tensor_parallel import RankFailure, Ranks
from conveyor.runtime.model.loader import load_config, load_tokenizer, open_model
from conveyor.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    import xgrammar

NORMALIZER_MARGIN = 4
"""A tokenizer's normalizer may fold characters before matching tokens (NFC composes up to
three into one); a prompt refused unread must not fit under any tokenisation."""

TRUNCATION_SLACK = 64
"""Tokens more than ``truncate_prompt_tokens`` keeps that a truncated text prompt is read for."""

log = logging.getLogger("conveyor.runtime")


class LLMEngine:
    def __init__(self, settings: EngineSettings, on_progress: Callable[[str], None] | None = None):
        started = time.monotonic()
        progress = on_progress or log.info
        self.settings = settings
        threads = configure_threads(settings.num_threads, settings.tensor_parallel_size)
        # The other tensor-parallel ranks' processes start first: they import torch while
        # this one reads the config and tokenizer (the runner stops them if anything fails).
        size = settings.tensor_parallel_size
        ranks = Ranks.start(size) if size > 1 else None
        try:
            progress(f"resolving model {settings.model!r}")
            files = open_model(settings.model)
            self.model_path = files.path
            self.model_name = settings.model
            self.hf_config = load_config(files)
            self.tokenizer = load_tokenizer(
                open_model(settings.tokenizer) if settings.tokenizer else files
            )
            self.default_sampling = sampling_defaults(
                settings.generation_config, files.generation_config
            )
            """Sampling parameters a request leaves out take these (``sampling_defaults.py``)."""
        except BaseException:
            if ranks is not None:
                ranks.close()
            raise
        self.runner = ModelRunner(
            settings, self.hf_config, files, on_progress=progress, ranks=ranks
        )
        try:
            self.state = EngineState.derive(
                settings,
                self.hf_config,
                self.tokenizer,
                files.generation_config,
                self.runner,
                threads,
            )
            self.runner.allocate_kv_cache(
                self.state.num_blocks, max_model_len=self.state.max_model_len
            )
        except BaseException:
            self.runner.close()
            raise
        self.runner.sampling.eos_token_ids = self.state.eos_token_ids
        if self.default_sampling:
            progress(
                f"default sampling parameters from generation_config.json: {self.default_sampling}"
                " (a request's own values win; --generation-config vllm ignores the file)"
            )
        self.structured_outputs = StructuredOutputs(
            self.tokenizer, self.runner.vocab_size, self.state.eos_token_ids
        )
        self.runner.sampling.structured_outputs = self.structured_outputs
        self.block_manager = BlockManager(
            self.state.num_blocks, settings.block_size, settings.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_running=settings.max_running_requests,
            token_budget=settings.token_budget(self.runner.device.type),
            mode=settings.scheduler,
            policy=settings.scheduling_policy,
            watermark_blocks=max(1, self.state.num_blocks // 100)
            if self.state.num_blocks > 100
            else 0,
        )
        self._seqs: dict[str, Sequence] = {}
        self.loras = LoRATable(self.runner, lambda: {s.lora_slot for s in self._seqs.values()})
        """The LoRA adapters requests may name (``--enable-lora``)."""
        self._aborted: list[Sequence] = []
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.steps = 0
        progress(self.kv_cache_summary())
        tp = settings.tensor_parallel_size
        progress(
            f"engine ready in {time.monotonic() - started:.1f}s ({self.runner.device}, {threads} "
            + (f"threads x {tp} tensor-parallel ranks)" if tp > 1 else "threads)")
        )

    def close(self) -> None:
        """Stop the engine's other processes (tensor-parallel ranks); idempotent."""
        self.runner.close()

    def on_rank_failure(self, callback: Callable[[RankFailure], None]) -> None:
        """Call ``callback`` (from another thread) if a tensor-parallel rank dies while idle;
        a rank that dies during a step fails that step."""
        if self.runner.ranks is not None:
            self.runner.ranks.on_failure = callback

    @property
    def max_model_len(self) -> int:
        return self.state.max_model_len

    @property
    def generation_config_given(self) -> bool:
        """``--generation-config`` named a folder: its max_new_tokens caps every request's
        max_tokens, not only those that give none (as vLLM)."""
        return self.settings.generation_config not in GENERATION_CONFIG_CHOICES

    def kv_cache_summary(self) -> str:
        st = self.state
        mib = st.num_blocks * self.runner.bytes_per_block / (1 << 20)
        return (
            f"KV cache: {st.num_blocks} blocks x {self.settings.block_size} tokens = "
            f"{st.num_blocks * self.settings.block_size} tokens, {mib:.1f} MiB "
            f"({str(self.runner.dtype).removeprefix('torch.')}); max model len {st.max_model_len}"
        )

    # -- requests ------------------------------------------------------------------------

    def encode_prompt(
        self,
        prompt: str | list[int],
        add_special_tokens: bool = True,
        *,
        max_tokens: int | None = None,
        keep_last: int | None = None,
    ) -> list[int]:
        """Token ids of ``prompt``; ValueError for text that is not valid Unicode and, given
        ``max_tokens``, for text too long to be that many tokens however it tokenises, found
        without tokenising it (megabytes of text would hold a tokenizer thread for seconds).
        ``keep_last``: only the last this many tokens will be used (``truncate_prompt_tokens``),
        so only the text's end is read, enough of it for ``TRUNCATION_SLACK`` more tokens
        however it tokenises (where it is cut, the tokens may differ from the whole text's)."""
        if isinstance(prompt, str):
            _require_unicode(prompt)
            if keep_last is not None:
                chars = (keep_last + TRUNCATION_SLACK) * self.max_chars_per_token
                prompt = prompt[-chars:]
            elif max_tokens is not None and len(prompt) > max_tokens * self.max_chars_per_token:
                raise ValueError(
                    f"prompt is {len(prompt)} characters, more than this model's context length "
                    f"of {max_tokens} tokens can hold; shorten the prompt"
                )
            return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        return list(prompt)

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """More characters of text than any one token stands for: its longest vocabulary entry
        (a byte-level entry has a character per byte, a SentencePiece one a character per
        character), times ``NORMALIZER_MARGIN``."""
        longest = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        return longest * NORMALIZER_MARGIN

    def check_request(
        self, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> None:
        """Refuse what can never run, before it enters the batch. Reads constants only."""
        self.check_priority(priority)
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.runner.vocab_size
        for t in prompt_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {t!r}")
        for t in params.logit_bias:
            if isinstance(t, int) and t >= vocab:
                raise ValueError(f"logit_bias keys must be token ids in [0, {vocab}), got {t}")
        for t in params.allowed_token_ids or ():
            if t >= vocab:
                raise ValueError(f"allowed_token_ids must be token ids in [0, {vocab}), got {t}")
        if params.allowed_token_ids and params.min_tokens > 0:
            ending = set(params.stop_token_ids)
            if not params.ignore_eos:
                ending |= set(self.runner.sampling.eos_token_ids)
            if ending.issuperset(params.allowed_token_ids):
                raise ValueError(
                    "allowed_token_ids holds only tokens that end the output, which min_tokens "
                    "forbids until it is reached; allow another token or drop min_tokens"
                )
        limit = self.state.max_model_len
        if len(prompt_token_ids) >= limit:
            raise ValueError(
                f"prompt is {len(prompt_token_ids)} tokens, but this model's context length is {limit} "
                f"tokens including at least one generated token; shorten the prompt to at most "
                f"{limit - 1} tokens"
            )
        params.validate()

    def check_priority(self, priority: int) -> None:
        """A request's ``priority`` means something only under the priority policy; elsewhere
        anything but 0 is refused rather than ignored, as vLLM does."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        policy = self.settings.scheduling_policy
        if priority != 0 and policy != "priority":
            raise ValueError(
                f"priority {priority} needs a server started with --scheduling-policy priority "
                f"(this one orders requests by {policy}); leave priority out or send 0"
            )

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        grammar: xgrammar.CompiledGrammar | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        bad_words: BadWords | None = None,
        lora: str | None = None,
    ) -> None:
        """``grammar``: ``params.structured_output`` compiled by ``structured_outputs.compile``
        off this thread; compiled here if not given. ``priority``: lower runs sooner, under
        ``--scheduling-policy priority``. ``cache_salt``: the prompt's blocks are shared in
        the prefix cache only with requests that bring the same salt. ``bad_words``:
        ``params.bad_words`` as tokens, made off this thread; made here if not given.
        ``lora``: the name of a loaded LoRA adapter to run it with (None: the base model)."""
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        lora_slot, lora_key = self.loras.slot(lora)
        token_ids = self.encode_prompt(prompt)
        self.check_request(token_ids, params, priority)
        if params.structured_output is not None:
            grammar = grammar or self.structured_outputs.compile(params.structured_output)
            self.structured_outputs.add(request_id, params.structured_output, grammar)
        seq = Sequence(
            request_id=request_id,
            token_ids=token_ids,
            num_prompt_tokens=len(token_ids),
            params=params,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority,
            cache_salt=cache_salt,
            bad_words=bad_words
            or (BadWords.of(self.tokenizer, params.bad_words) if params.bad_words else None),
            lora_slot=lora_slot,
            lora_key=lora_key,
        )
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    # -- LoRA adapters (``lora_table.py``) --------------------------------------------------

    def check_lora(self, name: str) -> None:
        """Raises ``AdapterError`` unless requests may name the LoRA adapter ``name``."""
        self.loras.slot(name)

    def abort_request(self, request_id: str) -> None:
        seq = self._seqs.get(request_id)
        if seq is None or seq.is_finished:
            return
        self._finish(seq, FinishReason.ABORT)
        self._aborted.append(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    # -- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        samples = self.runner.execute(batch) if not batch.is_empty else {}
        return self.postprocess(batch, samples)

    def postprocess(self, batch: ScheduledBatch, samples: dict[str, Sample]) -> list[RequestOutput]:
        now = time.monotonic()
        self.steps += 1
        self.scheduler.update_after_step(batch)
        outputs = [self._output(seq, []) for seq in self._aborted]
        self._aborted.clear()
        for seq in batch.seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            sample = samples.get(seq.request_id)
            if sample is None:
                continue
            self._append(seq, sample, now)
            outputs.append(self._output(seq, [sample.token_id]))
        return outputs

    def _append(self, seq: Sequence, sample: Sample, now: float) -> None:
        seq.token_ids.append(sample.token_id)
        self.generation_tokens += 1
        if sample.logprob is not None:
            seq.logprobs.append(sample.logprob)
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.prompt_tokens += seq.num_prompt_tokens
        seq.last_token_time = now
        p, tok, n_out = seq.params, sample.token_id, seq.num_output_tokens
        if not self.structured_outputs.accept(seq.request_id, tok):  # a bug, not bad input
            log.error("request %s: its grammar refused sampled token %d", seq.request_id, tok)
            return self._finish(seq, FinishReason.ABORT)
        if n_out >= p.min_tokens:
            if not p.ignore_eos and tok in self.state.eos_token_ids:
                return self._finish(seq, FinishReason.STOP)
            if tok in p.stop_token_ids:
                seq.stop_reason = tok
                return self._finish(seq, FinishReason.STOP)
        if n_out >= p.max_tokens or len(seq.token_ids) >= self.state.max_model_len:
            self._finish(seq, FinishReason.LENGTH)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.scheduler.finish(seq, reason)
        seq.finish_time = time.monotonic()
        self.runner.release(seq.request_id)
        self.structured_outputs.release(seq.request_id)
        del self._seqs[seq.request_id]
        self.loras.retire()

    def _output(self, seq: Sequence, new_tokens: list[int]) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            new_token_ids=new_tokens,
            output_token_ids=seq.output_token_ids,
            new_logprobs=seq.logprobs[-len(new_tokens) :] if new_tokens and seq.logprobs else [],
            prompt_logprobs=(
                (list(seq.prompt_logprobs) or [None])  # a one-token prompt: only its None
                if seq.params.prompt_logprobs is not None
                and (seq.is_finished or (new_tokens and seq.num_output_tokens == len(new_tokens)))
                else None
            ),  # on the first token's output, and the last
            finished=seq.is_finished,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            stop_reason=seq.stop_reason,
            num_cached_tokens=seq.num_cached_tokens,
            num_preemptions=seq.num_preemptions,
            arrival_time=seq.arrival_time,
            first_scheduled_time=seq.first_scheduled_time,
            first_token_time=seq.first_token_time,
            finish_time=seq.finish_time,
        )

    # -- observability -------------------------------------------------------------------

    def stats(self) -> EngineStats:
        c = self.scheduler.counters
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.block_manager.usage,
            num_total_blocks=self.block_manager.num_blocks,
            max_running_requests=self.scheduler.max_running,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            prefix_cache_queries=c.prefix_cache_queries,
            prefix_cache_hits=c.prefix_cache_hits,
            preemptions=c.preemptions,
            steps=self.steps,
            **self.loras.stats(self.scheduler.running, self.scheduler.waiting),
        )


def _require_unicode(text: str) -> None:
    """JSON can carry lone UTF-16 surrogates (``"\\ud800"``) that no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start : exc.end]
        raise ValueError(
            f"prompt holds a lone UTF-16 surrogate {bad!r} at character {exc.start}, which is "
            "not valid Unicode; send surrogate pairs whole (or the character itself)"
        ) from None
