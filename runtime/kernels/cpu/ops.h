// The entry points of ops.cpp, for decoder.cpp's layer loop and its Python bindings.
#pragma once

#include <torch/extension.h>

#include <vector>

namespace conveyor_cpu {

void paged_decode_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor block_tables, at::Tensor context_lens, double scale,
                            int64_t window, double softcap);
void paged_prefill_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache,
                             at::Tensor v_cache, at::Tensor block_tables,
                             at::Tensor query_start_loc, at::Tensor context_lens, double scale,
                             int64_t window, double softcap);
void rotary_embedding(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos,
                      at::Tensor sin);
void store_kv(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
              at::Tensor slots);
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor silu_and_mul(at::Tensor gate_up);
at::Tensor gelu_tanh_and_mul(at::Tensor gate_up);
// moe.cpp
at::Tensor moe_experts(at::Tensor x, at::Tensor w13, at::Tensor w2, at::Tensor topk_weights,
                       at::Tensor topk_ids, bool gelu, std::vector<at::Tensor> packed_w13,
                       std::vector<at::Tensor> packed_w2);
// decoder.cpp
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& packed,
                  const at::Tensor& b);

}  // namespace conveyor_cpu
