"""Attention over the paged KV cache, behind one small interface.

A backend writes the step's new keys and values into the cache and attends
each query to its sequence's context. ``TorchAttentionBackend`` is the
reference; the C++ CPU backend (``runtime/kernels/cpu/``) and the Triton backend
(``runtime/kernels/``) have the same signature.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.runtime.layers.attention_metadata import AttentionMetadata
from conveyor.runtime.layers.fused import LayerKernels

DecoderLayers = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata], tuple[torch.Tensor, torch.Tensor]
]
"""(x, positions, kv_caches, meta) -> (x, residual): every layer of a decoder, before its norm."""


class AttentionBackend(Protocol):
    @property
    def name(self) -> str:
        """``torch``, ``cpu`` or ``triton`` (``--attention-backend``)."""
        ...

    @property
    def layer_kernels(self) -> LayerKernels | None:
        """Fused RMSNorm, rotary and SiLU-and-mul that go with this backend (None: torch)."""
        ...

    def decoder_layers(self, model: nn.Module) -> DecoderLayers | None:
        """``model``'s layers as one call, or None where this backend has none (the Python
        loop over the layers runs)."""
        ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """q (T, Hq, D), k/v (T, Hkv, D), caches (num_blocks, block_size, Hkv, D) -> (T, Hq, D),
        written into ``out`` (T, Hq, D) where given. ``window`` > 0: a query at position ``i``
        sees only keys ``i - window + 1 .. i`` (a sliding-window layer). ``softcap`` > 0: each
        score ``s = scale * q.k`` becomes ``softcap * tanh(s / softcap)`` before the mask and
        softmax (Gemma 2's ``attn_logit_softcapping``)."""
        ...


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Scatter the step's K/V (T, Hkv, D) into the paged cache at ``slots`` (T,)."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    valid = slots >= 0
    if not bool(valid.all()):
        k, v, slots = k[valid], v[valid], slots[valid]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)


class TorchAttentionBackend:
    """Gathers each sequence's blocks and calls SDPA: the clear reference, and the fallback
    on CPU when the C++ kernels are not built."""

    name = "torch"
    layer_kernels = None

    def decoder_layers(self, model: nn.Module) -> None:
        return None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if out is None:
            out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale, window, softcap)
        if meta.num_prefills:
            self._prefill(q[nd:], out[nd:], k_cache, v_cache, meta, scale, window, softcap)
        return out

    @staticmethod
    def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
        """(num_blocks, bs, H, D) gathered along ``block_table`` -> (..., length, H, D)."""
        blocks = cache[block_table]  # (..., M, bs, H, D)
        flat = blocks.flatten(-4, -3)  # (..., M*bs, H, D)
        return flat[..., :length, :, :]

    def _decode(
        self,
        q,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        scale: float,
        window: int,
        softcap: float,
    ):
        length = meta.max_decode_context_len
        keys = self._gather(k_cache, meta.decode_block_tables, length)  # (B, L, Hkv, D)
        values = self._gather(v_cache, meta.decode_block_tables, length)
        pos = torch.arange(length, device=q.device)
        lens = meta.decode_context_lens[:, None].to(pos.dtype)
        mask = pos[None, :] < lens  # (B, L)
        if window:
            mask &= pos[None, :] >= lens - window
        out = _attention(
            q.unsqueeze(2),  # (B, Hq, 1, D)
            keys.transpose(1, 2),  # (B, Hkv, L, D)
            values.transpose(1, 2),
            mask[:, None, None, :],  # (B, 1, 1, L)
            scale,
            softcap,
        )  # (B, Hq, 1, D)
        return out.squeeze(2)

    def _prefill(
        self,
        q,
        out,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        scale: float,
        window: int,
        softcap: float,
    ):
        start = 0
        for i, (qlen, ctx) in enumerate(
            zip(meta.prefill_query_lens_host, meta.prefill_context_lens_host, strict=True)
        ):
            keys = self._gather(k_cache, meta.prefill_block_tables[i], ctx)  # (ctx, Hkv, D)
            values = self._gather(v_cache, meta.prefill_block_tables[i], ctx)
            # Query j sits at position ctx - qlen + j and sees keys up to it.
            qpos = torch.arange(ctx - qlen, ctx, device=q.device)
            kpos = torch.arange(ctx, device=q.device)
            mask = kpos[None, :] <= qpos[:, None]  # (qlen, ctx)
            if window:
                mask &= kpos[None, :] > qpos[:, None] - window
            o = _attention(
                q[start : start + qlen].transpose(0, 1),  # (Hq, qlen, D)
                keys.transpose(0, 1),  # (Hkv, ctx, D)
                values.transpose(0, 1),
                mask,
                scale,
                softcap,
            )  # (Hq, qlen, D)
            out[start : start + qlen] = o.transpose(0, 1)
            start += qlen


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """q (..., Hq, Lq, D), k/v (..., Hkv, L, D), a boolean mask broadcast to (..., Hq, Lq, L)
    -> (..., Hq, Lq, D): SDPA, or written out when scores are soft-capped (SDPA has no cap)."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    groups = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto`` picks Triton on CUDA, the C++ kernels on CPU when they are built, and the
    torch reference otherwise."""
    if name == "auto":
        if device.type == "cuda":
            name = "triton"
        else:
            from conveyor.runtime.kernels import cpu

            name = "cpu" if device.type == "cpu" and cpu.load() is not None else "torch"
            if name == "torch" and device.type == "cpu":
                logging.getLogger("conveyor.runtime").info(
                    "CPU kernels %s; attention runs on the torch reference", cpu.load_error()
                )
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu":
        from conveyor.runtime.kernels import cpu
        from conveyor.runtime.kernels.cpu.backend import CpuAttentionBackend

        if device.type != "cpu":
            raise ValueError(f"the cpu attention backend runs on CPU tensors (got {device.type})")
        if (ops := cpu.load()) is None:
            raise ValueError(f"the cpu attention backend's C++ kernels are {cpu.load_error()}")
        return CpuAttentionBackend(ops)
    if name == "triton":
        from conveyor.runtime.kernels.backend import TritonAttentionBackend, check_triton_device

        check_triton_device(device)
        return TritonAttentionBackend()
    raise ValueError(f"attention backend must be auto, torch, cpu or triton; got {name!r}")
