"""ggml's block formats dequantized with torch: the common ones vectorised over all blocks.

The gguf package's reference dequantizers are numpy and single-threaded; loading
SmolLM2-135M (Q4_1 and Q8_0) took 2.8 s through them. Q8_0, Q4_0 and Q4_1 (the types of most
small GGUFs) and the float types are done here as a few whole-tensor torch operations, which use
every core; the other types go to the gguf package. A test checks each fast path against it.

Block layouts (little-endian, ``d`` and ``m`` float16, 32 weights a block):
  Q8_0: d, 32 x int8 q            -> d * q
  Q4_0: d, 16 bytes of nibbles    -> d * (q - 8), low nibbles are weights 0-15, high 16-31
  Q4_1: d, m, 16 bytes of nibbles -> d * q + m
"""

from __future__ import annotations

import numpy as np
import torch

FAST_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")


def dequantize(data: np.ndarray, qtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor's raw GGUF data -> float32 of ``shape`` (outermost dimension first)."""
    name = qtype.name
    if name not in FAST_TYPES:
        from gguf import quants

        return torch.from_numpy(np.array(quants.dequantize(data, qtype), dtype=np.float32)).view(
            shape
        )
    # A copy: the data is a view of a read-only memory map, which torch will not wrap.
    raw = torch.from_numpy(np.array(data)).view(torch.uint8).flatten()
    if name == "F32":
        return raw.view(torch.float32).view(shape)  # the copy above is the tensor's own
    if name == "F16":
        return raw.view(torch.float16).float().view(shape)
    if name == "BF16":
        return raw.view(torch.bfloat16).float().view(shape)
    # Below, each result is written into one new float32 tensor (in-place multiply and add,
    # the same operations in the same order as ``q * d + m``: the same bits, fewer passes).
    if name == "Q8_0":
        blocks = raw.view(-1, 34)  # (n_blocks, 2 + 32)
        q = blocks[:, 2:].contiguous().view(torch.int8).float()  # (n_blocks, 32)
        return q.mul_(_half(blocks[:, 0:2])).view(shape)
    size = 18 if name == "Q4_0" else 20
    blocks = raw.view(-1, size)
    nibbles = blocks[:, size - 16 :]  # (n_blocks, 16)
    q = torch.empty(blocks.shape[0], 32, dtype=torch.float32)  # (n_blocks, 32)
    q[:, :16] = nibbles & 0x0F
    q[:, 16:] = nibbles >> 4
    if name == "Q4_0":
        return q.sub_(8.0).mul_(_half(blocks[:, 0:2])).view(shape)
    return q.mul_(_half(blocks[:, 0:2])).add_(_half(blocks[:, 2:4])).view(shape)


def _half(two_bytes: torch.Tensor) -> torch.Tensor:
    """(n, 2) uint8 -> (n, 1) float32, read as little-endian float16."""
    return two_bytes.contiguous().view(torch.float16).float()
