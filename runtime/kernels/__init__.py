"""Triton kernels: the engine's GPU path. One concept per file.

- ``store_kv``: the step's new K/V into the paged cache, one kernel for all tokens.
- ``decode_attention``: one query per sequence against its paged context (split-KV).
- ``prefill_attention``: chunks against their cached prefix, causal inside the chunk.
- ``rotary``, ``rmsnorm`` (fused with the residual add), ``silu_and_mul``, ``gelu_and_mul``: the decoder's
  elementwise ops, handed to the layers as ``backend.TRITON_LAYER_KERNELS``.
- ``fused_moe``: a mixture-of-experts MLP's routed experts, grouped GEMMs over the
  token-expert pairs sorted by expert (CUDA-graph safe), also in ``TRITON_LAYER_KERNELS``.
- ``backend``: ``TritonAttentionBackend``, the ``AttentionBackend`` on these kernels.
- ``checks``: each kernel against the torch reference (tests and ``conveyor bench gpu``).

On CPU they run only in Triton's interpreter (``TRITON_INTERPRET=1``), for tests; the CPU
path has C++ kernels of its own (``cpu/``).
"""
