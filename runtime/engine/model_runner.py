"""The only part of the engine that touches tensors: inputs in, sampled tokens out.

It owns the model, the KV cache and the per-request random generators. Given
a scheduled batch it lays the step's tokens out flat (decodes first, then
prefill chunks; ``step_inputs.py``), runs one forward pass, and samples for
every sequence whose last known token was computed in this step.

Under tensor parallelism (``--tensor-parallel-size N``) the engine's runner is rank 0: it
spawns ranks 1..N-1 (``tensor_parallel.py``), each a runner over its own shard of the model
and of the KV cache, and hands them what changed in every step (``step_messages.py``) before
it runs its own part; the layers' all-reduces keep the ranks in step. Each rank computes its
vocabulary rows' logits; rank 0 gathers them and samples.
"""

from __future__ import annotations

import logging
import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from conveyor.runtime.engine import tensor_parallel
from conveyor.runtime.engine.cuda_graphs import DecodeCudaGraphs
from conveyor.runtime.engine.piecewise_graphs import PiecewiseCudaGraphs
from conveyor.runtime.engine.platform import (
    check_memory_for,
    memory_limit_bytes,
    physical_memory_bytes,
    resident_bytes,
)
from conveyor.runtime.engine.prompt_logprobs import add_prompt_logprobs, prompt_logprob_rows
from conveyor.runtime.engine.sampling_inputs import SamplingInputs, token_logprobs
from conveyor.runtime.engine.scheduler import ScheduledBatch
from conveyor.runtime.engine.sequence import Sequence, TokenLogprob
from conveyor.runtime.engine.settings import EngineSettings
from conveyor.runtime.engine.step_inputs import StepLayout, layout_step, step_tensors, to_device
from conveyor.runtime.engine.step_messages import StepSender
from conveyor.runtime.layers.attention import select_backend
from conveyor.runtime.layers.attention_metadata import AttentionMetadata
from conveyor.runtime.layers.fused import use_fused_layers
from conveyor.runtime.layers.linear import (
    expert_bytes,
    pack,
    pack_experts,
    pack_linear_layers,
    packing_supported,
)
from conveyor.runtime.layers.lora import Adapter, LoRASlots, read_adapter
from conveyor.runtime.layers.moe import ExpertShape, dense_width
from conveyor.runtime.layers.parallel import SINGLE, TensorParallel, check_split
from conveyor.runtime.layers.sampler import Sampler
from conveyor.runtime.model.loader import ModelFiles, build_model, config_dtype

if TYPE_CHECKING:
    from transformers import PretrainedConfig

log = logging.getLogger("conveyor.runtime")


@dataclass
class Sample:
    token_id: int
    logprob: TokenLogprob | None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


FLOAT16_UNSTABLE = ("gemma2", "gemma3_text")
"""Model types whose activations overflow float16 (as vLLM, Conveyor refuses it for them)."""


def resolve_dtype(name: str, config: PretrainedConfig, device: torch.device) -> torch.dtype:
    unstable = getattr(config, "model_type", None) in FLOAT16_UNSTABLE
    if name != "auto":
        dtype = getattr(torch, name)
        assert isinstance(dtype, torch.dtype), name  # EngineSettings checked the name
        if dtype == torch.float16 and unstable:
            raise ValueError(
                f"{config.model_type} is numerically unstable in float16 (its activations "
                "overflow it); use --dtype bfloat16 or float32"
            )
        return dtype
    if device.type == "cpu":
        return torch.float32  # CPU half-precision matmuls are slow without AMX
    dtype = config_dtype(config)
    if dtype == torch.float32 or (dtype == torch.float16 and unstable):
        return torch.bfloat16
    return dtype


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros``; on a CPU, fresh anonymous pages, which the kernel zeroes when first
    touched: ``torch.zeros`` writes every byte before the server is ready (SmolLM2's default
    1 GiB cache: 1.1 s of CPU, 4 s of a start under a quarter core). Memory is then taken as
    blocks are used, not all at start."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    pages = mmap.mmap(-1, max(1, count * dtype.itemsize))  # the tensor keeps it open
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)


class ModelRunner:
    def __init__(
        self,
        settings: EngineSettings,
        config: PretrainedConfig,
        files: ModelFiles,
        on_progress: Callable[[str], None] | None = None,
        tp: TensorParallel | None = None,
        ranks: tensor_parallel.Ranks | None = None,
    ) -> None:
        """``tp``: this rank's place, for ranks 1..N-1. The engine's runner (rank 0) leaves
        it unset and, when ``tensor_parallel_size`` > 1, drives the other ranks: ``ranks``,
        started early by the engine, or started here."""
        self.settings = settings
        self.config = config
        self.device = tensor_parallel.rank_device(
            resolve_device(settings.device), tp.rank if tp else 0
        )
        self.dtype = resolve_dtype(settings.dtype, config, self.device)
        self.backend = select_backend(settings.attention_backend, self.device)
        self.ranks: tensor_parallel.Ranks | None = ranks
        """Ranks 1..N-1, on rank 0 of a tensor-parallel replica."""
        self.steps = StepSender()
        """What the other ranks know of the running sequences (rank 0 of a replica)."""
        if tp is None and settings.tensor_parallel_size > 1:
            tp = self._start_ranks(files, on_progress or log.info)
        self.tp = tp or SINGLE
        try:
            self._build(files, on_progress)
            if self.ranks is not None:
                per_rank = [self.weight_bytes, *self.ranks.wait_ready()]
                mib = ", ".join(f"{b / (1 << 20):.1f}" for b in per_rank)
                (on_progress or log.info)(
                    f"tensor parallel: {len(per_rank)} ranks, weights per rank {mib} MiB"
                )
        except BaseException:
            self.close()
            raise

    def _start_ranks(self, files: ModelFiles, progress: Callable[[str], None]) -> TensorParallel:
        """Refuse a split the model cannot take, set the other ranks to work and meet them."""
        c, size = self.config, self.settings.tensor_parallel_size
        heads = c.num_attention_heads
        try:
            experts = ExpertShape.of(c, TensorParallel(0, size))  # the experts' widths split too
            kv_heads = getattr(c, "num_key_value_heads", None) or heads
            check_split(heads, kv_heads, dense_width(c, experts), size)
            tensor_parallel.check_devices(self.device, size)
            if self.ranks is None:
                self.ranks = tensor_parallel.Ranks.start(size)
            port = tensor_parallel.free_port()
            progress(
                f"tensor parallel over {size} ranks: this is rank 0, the others have processes of their own"
            )
            self.ranks.assign(self.settings, files.path, self.config, port)
            return self.ranks.connect(self.settings, port, self.device)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the other ranks (a tensor-parallel rank 0); idempotent."""
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None

    @property
    def weight_bytes(self) -> int:
        """Bytes of this rank's weights (its shard, under tensor parallelism)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def _build(self, files: ModelFiles, on_progress: Callable[[str], None] | None) -> None:
        settings, config = self.settings, self.config
        self.model = build_model(
            config,
            files,
            backend=self.backend,
            dtype=self.dtype,
            device=self.device,
            load_format=settings.load_format,
            seed=settings.seed,
            tp=self.tp,
            on_progress=on_progress,
            context=settings.max_model_len,
        )
        s = self.model.shape
        self.vocab_size = s.vocab_size
        self.block_size = settings.block_size
        self.kv_cache: torch.Tensor | None = None
        self.sampler = Sampler()
        self.sampling = SamplingInputs(self.vocab_size, self.device)
        """The sampler's inputs per step, and the per-request generators."""
        if settings.lora_enabled:
            self._load_loras(on_progress or log.info)
        if self.backend.layer_kernels is not None:  # Triton on GPU, C++ on CPU
            use_fused_layers(self.model, self.backend.layer_kernels)
        if self.device.type == "cpu" and self.backend.name == "cpu":
            self._pack_linear_weights()
        # CUDA graphs (Triton attention on a GPU only): decode steps whole, steps that hold a
        # prefill in pieces between the layers' attention. Under tensor parallelism every
        # rank captures the same sizes in the same order, its NCCL all-reduces inside the
        # graphs, and replays the same ones each step.
        self.cuda_graphs: DecodeCudaGraphs | None = None
        self.piecewise_graphs: PiecewiseCudaGraphs | None = None
        if (
            self.device.type == "cuda"
            and self.backend.name == "triton"
            and not settings.enforce_eager
        ):
            self.cuda_graphs = DecodeCudaGraphs(
                self.model,
                settings.max_running_requests,
                -(-s.max_position // self.block_size),
                self.device,
            )
            budget = min(settings.token_budget("cuda"), s.max_position)
            pieces = settings.piecewise_cuda_graph_max_tokens
            if pieces != 0:
                self.piecewise_graphs = PiecewiseCudaGraphs(
                    self.model, min(budget, pieces or budget), self.device, self.dtype
                )

    def _load_loras(self, progress: Callable[[str], None]) -> None:
        """The adapter slots, and ``--lora-modules`` read into them (``layers/lora.py``)."""
        st = self.settings
        lora = LoRASlots(self.model, st.lora_slots, st.max_lora_rank, st.max_cpu_loras)
        self.model.lora = lora
        for slot, module in enumerate(st.lora_modules):
            lora.put(slot, read_adapter(module.name, module.path, self.model, st.max_lora_rank))
            progress(f"LoRA adapter {module.name!r} loaded from {module.path}")

    def put_lora(self, slot: int, adapter: Adapter | None) -> None:
        """Fill ``slot`` with ``adapter`` (None: empty it), here and then on every other rank,
        which takes its share of the same tensors (the folder is not read again)."""
        lora = self.model.lora
        assert lora is not None, "LoRA is not enabled"
        lora.put(slot, adapter)
        if self.ranks is not None:
            self.ranks.send(tensor_parallel.PutLoRA.of(slot, adapter))

    def read_lora(self, name: str, path: str) -> Adapter:
        """The adapter in folder ``path``, checked against the model (any thread may call it);
        raises ``AdapterError`` for one that cannot be served."""
        assert self.model.lora is not None, "LoRA is not enabled"
        return read_adapter(name, path, self.model, self.model.lora.max_rank)

    def _pack_linear_weights(self) -> None:
        """Decode-sized matmuls on oneDNN-packed weights (``layers/linear.py``)."""
        if not packing_supported(self.dtype):
            return
        packed = pack_linear_layers(self.model)
        experts = expert_bytes(self.model)
        room = (memory_limit_bytes() or physical_memory_bytes()) - resident_bytes()
        if experts and experts > room // 2:  # the KV cache and the rest need the other half
            gib = 1 << 30
            log.info(
                "not packing the experts' weights for oneDNN: their copy (%.2f GiB) would take "
                "more than half of the %.2f GiB left; prefills run moe.cpp's tiles",
                experts / gib, room / gib,
            )  # fmt: skip
        else:
            packed += pack_experts(self.model)
        if self.model.lm_head is None:
            self.model.tied_head_packed = pack(self.model.embed_tokens.weight)
            packed += 1
        log.info("%d linear weights packed for oneDNN (used for steps of 2 rows or more)", packed)
        if self.tp.size > 1:
            return  # the layers' all-reduces run between the Python layers
        self.model.fused_layers = self.backend.decoder_layers(self.model)
        if self.model.fused_layers is not None:
            log.info("the decoder's layers run in one C++ call a step")

    # -- KV cache ------------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        s = self.model.shape
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return int(2 * s.num_layers * self.block_size * s.num_kv_heads * s.head_dim * elem)

    def num_blocks_for_memory(self, max_tokens_useful: int) -> int:
        """How many KV blocks fit: the explicit token count, or the memory budget (of the
        rank with the least room, under tensor parallelism)."""
        if self.ranks is None:
            return self._num_blocks_for_memory(max_tokens_useful)
        self.ranks.send(tensor_parallel.SizeKvCache(max_tokens_useful))
        mine = self._num_blocks_for_memory(max_tokens_useful)
        return min([mine, *(int(n) for n in self.ranks.gather())])

    def _num_blocks_for_memory(self, max_tokens_useful: int) -> int:
        st = self.settings
        if st.max_total_tokens is not None:
            return -(-st.max_total_tokens // self.block_size)
        if self.device.type == "cuda":
            budget = self._profile_cuda_kv_budget()
        else:
            budget = st.cpu_kv_cache_bytes
        blocks = budget // self.bytes_per_block
        useful = -(-max_tokens_useful // self.block_size)
        if self.device.type == "cpu":
            blocks = min(blocks, useful)  # no point pinning memory no request can use
        if blocks < 1:
            raise ValueError(
                "no memory left for the KV cache: raise --mem-fraction-static or --cpu-kv-cache-bytes, "
                "or set --max-total-tokens"
            )
        return int(blocks)

    def _profile_cuda_kv_budget(self) -> int:
        """Device memory for the KV cache: the static fraction minus weights and the peak of a
        forward pass over a full step's tokens."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        tokens = min(self.settings.token_budget("cuda"), self.model.shape.max_position)
        # This rank's alone: under tensor parallelism every rank profiles itself at once.
        self._allocate_kv_cache(-(-tokens // self.block_size) + 1, capture_graphs=False)
        fake = Sequence("warmup", [0] * tokens, tokens, params=None, arrival_time=0.0)  # type: ignore[arg-type]
        fake.block_table = list(range(-(-tokens // self.block_size)))
        batch = ScheduledBatch(seqs=[fake], num_new_tokens=[tokens], num_decodes=0)
        input_ids, positions, meta, _ = self._prepare(batch)
        with torch.inference_mode():
            self.model.compute_logits(self.model(input_ids, positions, self.kv_cache, meta)[-1:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        if self.cuda_graphs is not None:  # the graphs' pools come out of the KV cache's share
            assert self.kv_cache is not None
            peak += self.cuda_graphs.measure(self.kv_cache)
        if self.piecewise_graphs is not None:
            peak += self.piecewise_graphs.measure()
        self.kv_cache = None
        total = torch.cuda.get_device_properties(self.device).total_memory
        return int(total * self.settings.mem_fraction_static - peak)

    def allocate_kv_cache(
        self, num_blocks: int, capture_graphs: bool = True, max_model_len: int | None = None
    ) -> None:
        """The KV cache, and the graphs that hold its address; ``max_model_len``: the context
        served, once the cache has sized it (a LongRoPE model's rope depends on it)."""
        if self.ranks is not None:
            self.ranks.send(
                tensor_parallel.AllocateKvCache(num_blocks, capture_graphs, max_model_len)
            )
        if max_model_len is not None:
            self.model.fit_rope_to(max_model_len)
        self._allocate_kv_cache(num_blocks, capture_graphs)

    def _allocate_kv_cache(self, num_blocks: int, capture_graphs: bool) -> None:
        s = self.model.shape
        # (layers, K/V, blocks, block_size, kv_heads, head_dim); zeros, so padded reads are finite.
        shape = (s.num_layers, 2, num_blocks, self.block_size, s.num_kv_heads, s.head_dim)
        if self.device.type == "cpu":  # its pages are taken as blocks fill: check them now
            check_memory_for(
                "the KV cache",
                num_blocks * self.bytes_per_block,
                "lower --cpu-kv-cache-bytes or --max-total-tokens, or raise the memory limit",
            )
        self.kv_cache = zeros(shape, self.dtype, self.device)
        if self.cuda_graphs is not None and capture_graphs:  # the graphs hold the cache's address
            self.cuda_graphs.capture(self.kv_cache)
        if self.piecewise_graphs is not None and capture_graphs:
            self.piecewise_graphs.capture()

    # -- one step -------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> dict[str, Sample]:
        """Run the model over ``batch``; returns a sample per sequence that reached its end."""
        layout, sample_rows = layout_step(batch, self.block_size)
        rows = [r for _, r in sample_rows]
        prompt_rows = prompt_logprob_rows(batch)
        all_rows = rows + [row for _, row, _ in prompt_rows]
        if self.ranks is not None:
            self.ranks.send(self.steps.message(batch, layout, all_rows))
            try:
                logits = self._logits(layout, all_rows)
            except RuntimeError as exc:  # a collective whose peer died: say which
                raise self.ranks.explain(exc) or exc from exc
        else:
            logits = self._logits(layout, all_rows)
        if logits is None:
            return {}
        if prompt_rows:
            add_prompt_logprobs(prompt_rows, logits[len(rows) :])
            logits = logits[: len(rows)]
            if not rows:
                return {}
        seqs = [batch.seqs[i] for i, _ in sample_rows]
        out = self.sampler(logits, self.sampling.tensors(seqs))
        token_ids = out.token_ids.tolist()
        logprobs = token_logprobs(seqs, out)
        return {
            seq.request_id: Sample(tok, lp)
            for seq, tok, lp in zip(seqs, token_ids, logprobs, strict=True)
        }

    @torch.inference_mode()
    def run_step(self, layout: StepLayout, sample_rows: list[int]) -> None:
        """A step on rank 1..N-1: this rank's part of the forward pass and of the logits."""
        self._logits(layout, sample_rows)

    def _logits(self, layout: StepLayout, rows: list[int]) -> torch.Tensor | None:
        """The forward pass, then the logits (N, V) of the hidden states' ``rows`` on rank 0
        (None on the other ranks, which hand rank 0 their vocabulary rows' part; None when
        no row samples)."""
        hidden = self._forward(layout)
        if not rows:
            return None
        return self.model.compute_logits(hidden[self._tensor(rows, torch.int64)])

    def _forward(self, layout: StepLayout) -> torch.Tensor:
        """The forward pass over the step's tokens -> hidden states (T, hidden)."""
        input_ids, positions, meta = step_tensors(layout, self.device)
        if layout.lora:  # adapters' tokens: the layers one by one, with the LoRA deltas
            lora = self.model.lora
            assert lora is not None
            lora.step.begin(layout.lora_token_slots(), self.device)
            try:
                hidden: torch.Tensor = self.model(input_ids, positions, self.kv_cache, meta)
            finally:
                lora.step.end()
            return hidden
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(
            layout.num_decodes, len(input_ids)
        ):
            hidden = self.cuda_graphs.run(input_ids, positions, meta)
        elif self.piecewise_graphs is not None and self.piecewise_graphs.can_run(len(input_ids)):
            assert self.kv_cache is not None  # captured once the cache is allocated
            hidden = self.piecewise_graphs.run(input_ids, positions, self.kv_cache, meta)
        else:
            hidden = self.model(input_ids, positions, self.kv_cache, meta)
        return hidden

    def _prepare(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[tuple[int, int]]]:
        """The step's token ids (T,), positions (T,), attention metadata, and the rows that
        sample (see ``step_inputs.layout_step``)."""
        layout, sample_rows = layout_step(batch, self.block_size)
        return (*step_tensors(layout, self.device), sample_rows)

    def _tensor(
        self, data: list[int] | list[float] | list[list[int]], dtype: torch.dtype
    ) -> torch.Tensor:
        return to_device(data, dtype, self.device)

    def release(self, request_id: str) -> None:
        self.sampling.release(request_id)
        self.steps.release(request_id)
