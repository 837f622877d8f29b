// A Llama-family decoder's layers in one call, on ops.cpp's kernels and oneDNN's matmuls, and
// the module's Python bindings.
//
// The Python loop over the layers (runtime/model/llama.py) makes about a dozen calls per layer
// through nn.Module; on a 2-core CPU that was 3-4 ms of a 45 ms decode step of SmolLM2. This
// loop makes the same calls, in the same order, on the same tensors, so its output is the
// Python path's bit for bit; runtime/kernels/cpu/backend.py decides when a model fits it.
// It serves every layer llama.py builds: Llama's, Qwen3's per-head q/k norms, Gemma's GELU
// gate, Gemma 2/3's sandwich norms and Gemma 3's per-layer rope tables, OLMo 2/3's norms after
// each block only and q/k norms over the whole projection, and the
// mixture-of-experts MLPs of layers/moe.py (Mixtral, Qwen2-MoE's shared expert, Qwen3-MoE):
// its routing in the same ATen calls, moe.cpp's experts as the CPU backend's kernel runs them.

#include "ops.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace conveyor_cpu {

// x @ w.T + b as runtime/layers/linear.py computes it: oneDNN's matmul on the prepacked weight
// from two rows up, ATen's linear below. An empty tensor stands for "no bias".
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& packed,
                  const at::Tensor& b) {
  std::optional<at::Tensor> bias;
  if (b.defined() && b.numel() > 0) bias = b;
  if (x.size(0) >= 2) {
    static const c10::OperatorHandle op =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    torch::jit::Stack stack;
    stack.reserve(6);
    stack.emplace_back(x);
    stack.emplace_back(packed);
    stack.emplace_back(bias);
    stack.emplace_back(std::string("none"));
    stack.emplace_back(c10::List<std::optional<at::Scalar>>());
    stack.emplace_back(std::optional<std::string>(std::string()));
    op.callBoxed(&stack);
    return stack[0].toTensor();
  }
  return at::linear(x, w, bias);
}

namespace {

// Weights of one layer, in this order; each linear is (weight, packed weight, bias or empty),
// and a norm the layer does not have is an empty tensor (the q/k norms outside Qwen3, Gemma 3
// and OLMo, the feed-forward ones outside Gemma 2/3 and OLMo, the input norm in OLMo: a layer
// without one reads the residual stream itself and norms its blocks' outputs only). A q/k norm
// of a head's width norms each head, one of the projection's width all heads at once (OLMo).
// The gated MLP (gate_up, down) is the dense layer's, or a mixture-of-experts layer's shared
// expert (Qwen2-MoE; empty: none). A mixture-of-experts layer has a router and its experts'
// stacked w13 (E, 2I, H) and w2 (E, H, I), and with a shared expert that expert's sigmoid gate
// (1, H); a dense layer has empty tensors there.
enum Weight : int64_t {
  kInputNorm, kQkv, kQkvPacked, kQkvBias, kQNorm, kKNorm, kO, kOPacked, kOBias,
  kPostNorm, kPreFeedforwardNorm, kGateUp, kGateUpPacked, kGateUpBias, kDown, kDownPacked,
  kDownBias, kPostFeedforwardNorm, kRouter, kRouterPacked, kW13, kW2, kSharedGate,
  kSharedGatePacked, kWeightsPerLayer
};

bool present(const at::Tensor& w) { return w.numel() > 0; }

// The gated MLP: act(x @ gate_up) through down, as layers/moe.py's GatedMLP (LlamaMLP's).
at::Tensor gated_mlp(const at::Tensor& x, const at::Tensor* w, bool gelu) {
  const at::Tensor gate_up = linear(x, w[kGateUp], w[kGateUpPacked], w[kGateUpBias]);
  const at::Tensor h = gelu ? gelu_tanh_and_mul(gate_up) : silu_and_mul(gate_up);
  return linear(h, w[kDown], w[kDownPacked], w[kDownBias]);
}

// A mixture-of-experts MLP, as layers/moe.py's SparseMoeBlock.forward with the CPU backend's
// kernel: route() in the same ATen calls (the router, the float32 softmax, torch.topk, the
// renormalisation, the weights rounded to x's dtype), so the same experts and weights, ties
// included; moe.cpp's experts, on their packed weights (2E: w13's then w2's) from
// kPackedMinRows rows (runtime/kernels/cpu/backend.py passes none below); then the shared
// expert under its sigmoid gate.
at::Tensor sparse_moe(const at::Tensor& x, const at::Tensor* w, const at::Tensor* packed,
                      int64_t num_packed, int64_t top_k, bool renormalize, bool round_weights,
                      bool gelu) {
  const at::Tensor probs = at::softmax(linear(x, w[kRouter], w[kRouterPacked], at::Tensor()),
                                       -1, at::kFloat);  // (T, E)
  auto [weights, ids] = at::topk(probs, top_k, -1);  // (T, k) each
  if (renormalize) weights = weights / weights.sum(at::IntArrayRef{-1}, true);
  if (round_weights) weights = weights.to(x.scalar_type()).to(at::kFloat);
  const int64_t E = w[kW13].size(0);
  std::vector<at::Tensor> packed_w13, packed_w2;
  if (num_packed > 0) {
    packed_w13.assign(packed, packed + E);
    packed_w2.assign(packed + E, packed + 2 * E);
  }
  at::Tensor out = moe_experts(x.contiguous(), w[kW13], w[kW2], weights, ids, gelu,
                               std::move(packed_w13), std::move(packed_w2));
  if (present(w[kGateUp]))
    out = out + at::sigmoid(linear(x, w[kSharedGate], w[kSharedGatePacked], at::Tensor())) *
                    gated_mlp(x, w, gelu);
  return out;
}

// x (T, H, D) normed per head, as runtime/kernels/cpu/backend.py's kernel norms a 3-D input
// (Qwen3's and Gemma 3's q/k norms): a contiguous copy's rows -> (T, H, D), contiguous.
at::Tensor head_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return rms_norm(x.contiguous().view({-1, x.size(2)}), w, eps).view(x.sizes());
}

// x (T, H, D) normed per head, or over all its heads at once when w is that wide (OLMo's q/k
// norms, as llama.py's norm_across_heads norms a contiguous copy of the projection).
at::Tensor qk_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  if (w.numel() == x.size(2)) return head_rms_norm(x, w, eps);
  return rms_norm(x.contiguous().view({x.size(0), -1}), w, eps).view(x.sizes());
}

}  // namespace

// x (T, hidden), the embedded tokens, through every layer; returns (x, residual) for the
// final norm. kv_caches (layers, 2, blocks, block_size, Hkv, D); the step's metadata as
// AttentionMetadata holds it; the first num_decode_tokens rows are decodes. cos/sin: the rope
// tables, (max_position, D) float32 each, and layer_ropes each layer's index in them (-1: the
// layer turns nothing, SmolLM3's NoPE layers).
// gelu: the MLP gates with GELU's tanh approximation (Gemma), not SiLU. scale: the scores'
// (query_pre_attn_scalar ** -0.5 under Gemma 2/3), softcap: their soft cap (0: none).
// windows: per layer, the keys a query sees (0: all before it; runtime/model/config.py's
// layer_windows). The mixture-of-experts layers' routing: top_k experts a token, their
// weights renormalised, rounded to x's dtype (ExpertShape's); packed_experts: each such
// layer's 2E packed expert weights, in layer order, or none.
std::tuple<at::Tensor, at::Tensor> decoder_layers(
    at::Tensor x, at::Tensor positions, at::Tensor kv_caches,
    const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& cos,
    const std::vector<at::Tensor>& sin, const std::vector<int64_t>& layer_ropes, at::Tensor slots,
    int64_t num_decode_tokens,
    at::Tensor decode_block_tables, at::Tensor decode_context_lens, bool has_prefills,
    at::Tensor prefill_block_tables, at::Tensor prefill_query_start_loc,
    at::Tensor prefill_context_lens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    double eps, bool gelu, double scale, double softcap, const std::vector<int64_t>& windows,
    int64_t top_k, bool renormalize, bool round_weights,
    const std::vector<at::Tensor>& packed_experts) {
  const int64_t layers = kv_caches.size(0);
  TORCH_CHECK(int64_t(windows.size()) == layers, "decoder_layers needs a window per layer, got ",
              windows.size(), " for ", layers, " layers");
  TORCH_CHECK(int64_t(weights.size()) == layers * kWeightsPerLayer, "decoder_layers needs ",
              int64_t(kWeightsPerLayer), " weights per layer, got ", weights.size(), " for ",
              layers, " layers");
  TORCH_CHECK(int64_t(layer_ropes.size()) == layers && cos.size() == sin.size(),
              "decoder_layers needs a rope table per layer");
  for (const int64_t r : layer_ropes)
    TORCH_CHECK(r >= -1 && r < int64_t(cos.size()), "rope table ", r, " out of range");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous (tokens, hidden) tensor");
  const int64_t T = x.size(0), nd = num_decode_tokens;
  TORCH_CHECK(nd >= 0 && nd <= T && (has_prefills || nd == T), "decode tokens out of range");
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  int64_t sparse_layers = 0, num_experts = 0;
  for (int64_t l = 0; l < layers; ++l)
    if (present(weights[l * kWeightsPerLayer + kW13])) {
      ++sparse_layers;
      num_experts = weights[l * kWeightsPerLayer + kW13].size(0);
    }
  TORCH_CHECK(packed_experts.empty() ||
                  int64_t(packed_experts.size()) == sparse_layers * 2 * num_experts,
              "decoder_layers needs 2 packed weights per expert of every sparse layer, or none");
  const int64_t packed_per_layer = packed_experts.empty() ? 0 : 2 * num_experts;
  int64_t sparse_index = 0;
  at::Tensor residual;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * kWeightsPerLayer;
    const bool post_norms = !present(w[kInputNorm]);  // OLMo: the stream itself goes in
    if (post_norms) {
      residual = residual.defined() ? at::add(x, residual) : x;
      x = residual;
    } else if (!residual.defined()) {
      residual = x;
      x = rms_norm(x, w[kInputNorm], eps);
    } else {
      fused_add_rms_norm(x, residual, w[kInputNorm], eps);
    }
    const at::Tensor qkv = linear(x, w[kQkv], w[kQkvPacked], w[kQkvBias]);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, head_dim});
    if (present(w[kQNorm])) {
      q = qk_rms_norm(q, w[kQNorm], eps);
      k = qk_rms_norm(k, w[kKNorm], eps);
    }
    if (layer_ropes[l] >= 0)
      rotary_embedding(positions, q, k, cos[layer_ropes[l]], sin[layer_ropes[l]]);
    const at::Tensor layer_cache = kv_caches.select(0, l);
    const at::Tensor k_cache = layer_cache.select(0, 0), v_cache = layer_cache.select(0, 1);
    store_kv(k, v, k_cache, v_cache, slots);
    const at::Tensor o = at::empty(q.sizes(), q.options());
    if (nd > 0)
      paged_decode_attention(o.narrow(0, 0, nd), q.narrow(0, 0, nd), k_cache, v_cache,
                             decode_block_tables, decode_context_lens, scale, windows[l],
                             softcap);
    if (has_prefills)
      paged_prefill_attention(o.narrow(0, nd, T - nd), q.narrow(0, nd, T - nd), k_cache, v_cache,
                              prefill_block_tables, prefill_query_start_loc,
                              prefill_context_lens, scale, windows[l], softcap);
    x = linear(o.flatten(1), w[kO], w[kOPacked], w[kOBias]);
    if (post_norms) {  // OLMo: the attention's output normed, added; the MLP reads the stream
      residual = at::add(residual, rms_norm(x, w[kPostNorm], eps));
      x = residual;
    } else if (present(w[kPreFeedforwardNorm])) {  // Gemma 2/3: the attention's output normed
      x = rms_norm(x, w[kPostNorm], eps);
      fused_add_rms_norm(x, residual, w[kPreFeedforwardNorm], eps);
    } else {
      fused_add_rms_norm(x, residual, w[kPostNorm], eps);
    }
    if (present(w[kW13])) {
      TORCH_CHECK(w[kW13].size(0) == num_experts, "decoder_layers: every sparse layer needs ",
                  num_experts, " experts");
      x = sparse_moe(x, w, packed_experts.data() + sparse_index++ * packed_per_layer,
                     packed_per_layer, top_k, renormalize, round_weights, gelu);
    } else {
      x = gated_mlp(x, w, gelu);
    }
    if (present(w[kPostFeedforwardNorm])) x = rms_norm(x, w[kPostFeedforwardNorm], eps);
  }
  return {x, residual};
}

}  // namespace conveyor_cpu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using namespace conveyor_cpu;
  auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_decode_attention", &paged_decode_attention, nogil);
  m.def("paged_prefill_attention", &paged_prefill_attention, nogil);
  m.def("rotary_embedding", &rotary_embedding, nogil);
  m.def("store_kv", &store_kv, nogil);
  m.def("fused_add_rms_norm", &fused_add_rms_norm, nogil);
  m.def("rms_norm", &rms_norm, nogil);
  m.def("silu_and_mul", &silu_and_mul, nogil);
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, nogil);
  m.def("moe_experts", &moe_experts, nogil);
  m.def("decoder_layers", &decoder_layers, nogil);
  m.attr("weights_per_layer") = int64_t(kWeightsPerLayer);
}
