// Conveyor's CPU kernels: the decoder's hot loops in one pass each, for x86 and ARM CPUs.
//
// - paged_decode_attention: one query per sequence against its context, read in place from
//   the paged KV cache (no gather of K/V into a contiguous copy), parallel over
//   (sequence, KV head); the query heads that share a KV head read each key once.
// - paged_prefill_attention: chunks against their cached prefix, causal inside the chunk,
//   also in place, parallel over (sequence, KV head, 64 query tokens), keys in tiles.
//   Both take a sliding window: window > 0 lets a query at position i see keys
//   i - window + 1 .. i only (Mistral's, and Qwen2's sliding layers); 0 sees every key.
//   And a soft cap: softcap > 0 turns each score s into softcap * tanh(s / softcap) before
//   the softmax (Gemma 2's attn_logit_softcapping); 0 leaves the scores as they are.
// - rotary_embedding: rotate q and k in place (rotate-half layout); store_kv: k, v into
//   the cache at their slots.
// - fused_add_rms_norm / rms_norm, silu_and_mul, gelu_tanh_and_mul: elementwise work fused
//   into one pass.
//
// decoder.cpp runs a decoder's layers on these in one call and holds the Python bindings;
// ops.h declares the entry points it uses.
//
// Every op computes in float32 and reads/writes float32, bfloat16 or float16 tensors.
// Inner loops are written for the compiler to vectorise (-O3, `omp simd` reductions); the
// parallel loops use ATen's OpenMP pool, so they follow torch.set_num_threads. Each entry
// point releases the GIL, so the server's event loop runs while a kernel does.

#include "ops.h"
#include "simd.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace conveyor_cpu {

// Largest and sum of n floats, with vector accumulators.
inline float max_of(const float* __restrict x, int64_t n) {
  vf m = vf{} - std::numeric_limits<float>::infinity();
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const vf v = loadv(x + i);
    m = v > m ? v : m;
  }
  float r = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < W; ++j) r = std::max(r, m[j]);
  for (; i < n; ++i) r = std::max(r, x[i]);
  return r;
}

inline float sum_of(const float* __restrict x, int64_t n) {
  vf a = {};
  int64_t i = 0;
  for (; i + W <= n; i += W) a += loadv(x + i);
  float r = hsum(a);
  for (; i < n; ++i) r += x[i];
  return r;
}

// Rows per task so that a task has at least ~1M elements: the elementwise ops of a decode
// step or a prefill chunk of SmolLM2's width (0.2 ms on one core for 2,048 x 576) run on
// one thread. Splitting them saves a tenth of a millisecond on idle cores and costs
// milliseconds when a core is busy (the server's event loop, a client on the same machine):
// the split waits for its slowest thread.
inline int64_t row_grain(int64_t width) { return std::max<int64_t>(1, (1 << 20) / std::max<int64_t>(1, width)); }

// q . r over D floats, two vector accumulators.
inline float dot(const float* __restrict q, const float* __restrict r, int64_t D) {
  int64_t d = 0;
  vf a0 = {}, a1 = {};
  for (; d + 2 * W <= D; d += 2 * W) {
    a0 += loadv(q + d) * loadv(r + d);
    a1 += loadv(q + d + W) * loadv(r + d + W);
  }
  for (; d + W <= D; d += W) a0 += loadv(q + d) * loadv(r + d);
  float s = hsum(a0 + a1);
  for (; d < D; ++d) s += q[d] * r[d];
  return s;
}

// tanh(x) for a vector: an odd polynomial below |x| = 0.625 (Cephes' tanhf, about an ulp),
// where 1 - 2 / (exp(2|x|) + 1) would lose the small result to cancellation, that formula
// above (+-1 where exp saturates).
inline vf tanhv(vf x) {
  const vf a = x < 0 ? -x : x;
  const vf z = x * x;
  vf p = vf{} - 5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const vf small = p * z * x + x;
  const vf big = 1.f - 2.f / (expv(2.f * a) + 1.f);
  return a < 0.625f ? small : (x < 0 ? -big : big);
}

// s = cap * tanh(s / cap) over n floats: the soft cap of attention scores.
inline void soft_cap(float* __restrict s, int64_t n, float cap) {
  int64_t i = 0;
  for (; i + W <= n; i += W) storev(s + i, cap * tanhv(loadv(s + i) / cap));
  for (; i < n; ++i) s[i] = cap * std::tanh(s[i] / cap);
}

// s = softmax(s) over n floats.
inline void softmax(float* __restrict s, int64_t n) {
  const float m = max_of(s, n);
  for (int64_t t = 0; t < n; ++t) s[t] -= m;
  exp_inplace(s, n);
  const float inv = 1.f / sum_of(s, n);
  for (int64_t t = 0; t < n; ++t) s[t] *= inv;
}

// y_g[0:D] = sum_t p_g[t] * (rows[t] + off)[0:D] for NG query heads g at once (p_g at
// p + g * stride, y_g at y + g * D): each value row is read once for all of them, and the
// NG x 4 accumulators stay in registers.
template <int NG>
inline void weighted_sum_group(const float* __restrict p, int64_t stride,
                               const float* const* rows, int64_t off, int64_t n, int64_t D,
                               float* __restrict y) {
  int64_t d0 = 0;
  for (; d0 + 4 * W <= D; d0 += 4 * W) {
    vf a[NG][4] = {};
    for (int64_t t = 0; t < n; ++t) {
      const float* r = rows[t] + off + d0;
      const vf r0 = loadv(r), r1 = loadv(r + W), r2 = loadv(r + 2 * W), r3 = loadv(r + 3 * W);
      for (int g = 0; g < NG; ++g) {
        const vf pv = vf{} + p[g * stride + t];
        a[g][0] += pv * r0, a[g][1] += pv * r1, a[g][2] += pv * r2, a[g][3] += pv * r3;
      }
    }
    for (int g = 0; g < NG; ++g)
      for (int j = 0; j < 4; ++j) storev(y + g * D + d0 + j * W, a[g][j]);
  }
  for (; d0 + W <= D; d0 += W) {
    vf a[NG] = {};
    for (int64_t t = 0; t < n; ++t) {
      const vf r = loadv(rows[t] + off + d0);
      for (int g = 0; g < NG; ++g) a[g] += (vf{} + p[g * stride + t]) * r;
    }
    for (int g = 0; g < NG; ++g) storev(y + g * D + d0, a[g]);
  }
  for (; d0 < D; ++d0) {
    for (int g = 0; g < NG; ++g) {
      float a = 0.f;
      for (int64_t t = 0; t < n; ++t) a += p[g * stride + t] * rows[t][off + d0];
      y[g * D + d0] = a;
    }
  }
}

// The G query heads of one KV head, in groups of at most four.
inline void weighted_sum(const float* p, int64_t stride, const float* const* rows, int64_t off,
                         int64_t n, int64_t D, int64_t G, float* y) {
  for (int64_t g = 0; g < G;) {
    const float* pg = p + g * stride;
    float* yg = y + g * D;
    switch (std::min<int64_t>(G - g, 4)) {
      case 4: weighted_sum_group<4>(pg, stride, rows, off, n, D, yg); g += 4; break;
      case 3: weighted_sum_group<3>(pg, stride, rows, off, n, D, yg); g += 3; break;
      case 2: weighted_sum_group<2>(pg, stride, rows, off, n, D, yg); g += 2; break;
      default: weighted_sum_group<1>(pg, stride, rows, off, n, D, yg); g += 1; break;
    }
  }
}

void check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4,
              "caches must be (num_blocks, block_size, kv_heads, head_dim)");
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3) &&
                  k_cache.stride(1) == k_cache.size(2) * k_cache.size(3),
              "each block of the cache must be contiguous");
  TORCH_CHECK(v_cache.strides() == k_cache.strides(), "K and V caches must share a layout");
}

// Tokens of look-ahead for the key prefetch: enough to cover a memory access at a few
// hundred cycles of scoring per token.
constexpr int64_t kPrefetchTokens = 4;

inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 3);
}

// Per-thread scratch of one attention task.
struct Scratch {
  std::vector<float> q, acc, scores, k_f, v_f, kt;
  std::vector<const float*> k_rows, v_rows;
};

// Pointers to the token rows [first, len) of the cache, block by block through `table`, each
// at KV head h0: in place for float32; heads [h0, h1) converted into `buf` for half types.
// Head h of token first + t is then at rows[t] + (h - h0) * D.
template <typename T>
void context_rows(const T* cache, const int32_t* table, int64_t first, int64_t len,
                  int64_t block_size, int64_t token_stride, int64_t block_stride, int64_t h0,
                  int64_t h1, int64_t D, std::vector<const float*>& rows,
                  std::vector<float>& buf) {
  const int64_t n = len - first;
  rows.resize(n);
  const int64_t width = (h1 - h0) * D;
  if constexpr (!std::is_same_v<T, float>) buf.resize(n * width);
  for (int64_t b = first / block_size, j0 = first % block_size, t = 0; t < n; ++b, j0 = 0) {
    const T* block = cache + int64_t(table[b]) * block_stride + h0 * D;
    for (int64_t j = j0; j < block_size && t < n; ++j, ++t) {
      const T* r = block + j * token_stride;
      if constexpr (std::is_same_v<T, float>) {
        rows[t] = r;
      } else {
        for (int64_t d = 0; d < width; ++d) buf[t * width + d] = to_f(r[d]);
        rows[t] = buf.data() + t * width;
      }
    }
  }
}

// Attention of the query heads of KV heads [h0, h1) (sc.q: (h1 - h0) * G x D, pre-scaled)
// over the tokens [first, end) of one sequence's context, scores soft-capped at `softcap`
// when it is > 0; writes the same shape to sc.acc. Token rows are read whole and in order
// (all the task's heads at once).
template <typename T>
void attend(int64_t h0, int64_t h1, int64_t G, int64_t D, const T* k_cache, const T* v_cache,
            const int32_t* table, int64_t block_size, int64_t token_stride,
            int64_t block_stride, int64_t first, int64_t end, float softcap, Scratch& sc) {
  const int64_t nh = h1 - h0, rows_q = nh * G, len = end - first;
  context_rows(k_cache, table, first, end, block_size, token_stride, block_stride, h0, h1, D,
               sc.k_rows, sc.k_f);
  context_rows(v_cache, table, first, end, block_size, token_stride, block_stride, h0, h1, D,
               sc.v_rows, sc.v_f);
  sc.scores.resize(rows_q * len);
  sc.acc.resize(rows_q * D);
  float* scores = sc.scores.data();
  const float* q = sc.q.data();
  // The context's blocks lie anywhere in the cache, so the hardware prefetcher starts cold at
  // each one: ask for keys a few tokens ahead, and for each token's values while its keys are
  // scored, so the weighted sums below read them from cache.
  const int64_t row_bytes = nh * D * int64_t(sizeof(float));
  for (int64_t t = 0; t < len; ++t) {
    if (t + kPrefetchTokens < len) prefetch_bytes(sc.k_rows[t + kPrefetchTokens], row_bytes);
    prefetch_bytes(sc.v_rows[t], row_bytes);
    const float* r = sc.k_rows[t];
    for (int64_t i = 0; i < rows_q; ++i) scores[i * len + t] = dot(q + i * D, r + (i / G) * D, D);
  }
  if (softcap > 0.f) soft_cap(scores, rows_q * len, softcap);  // every score is a key seen
  for (int64_t i = 0; i < rows_q; ++i) softmax(scores + i * len, len);
  for (int64_t h = 0; h < nh; ++h)
    weighted_sum(scores + h * G * len, len, sc.v_rows.data(), h * D, len, D, G,
                 sc.acc.data() + h * G * D);
}

// Tasks 0..n-1 over ATen's threads (the same OpenMP pool), handed out one at a time: a
// thread the OS deschedules holds back at most the task it is in, where a static split
// would make the whole step wait for that thread's share.
template <typename F>
void parallel_tasks(int64_t n, const F& fn) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region()) {
    Scratch sc;
    for (int64_t i = 0; i < n; ++i) fn(i, sc);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    Scratch sc;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) fn(i, sc);
  }
}

// Tasks per sequence: every KV head at once (whole rows, in order) when the sequences alone
// keep the threads busy; one KV head each otherwise.
inline int64_t heads_per_task(int64_t sequences, int64_t kv_heads) {
  return sequences >= 4 * at::get_num_threads() ? kv_heads : 1;
}

// The paged caches of one layer as the kernels read them.
template <typename T>
struct PagedCache {
  const T* k;
  const T* v;
  int64_t block_size, token_stride, block_stride, kv_heads, head_dim;

  PagedCache(const at::Tensor& k_cache, const at::Tensor& v_cache)
      : k(k_cache.data_ptr<T>()), v(v_cache.data_ptr<T>()), block_size(k_cache.size(1)),
        token_stride(k_cache.stride(1)), block_stride(k_cache.stride(0)),
        kv_heads(k_cache.size(2)), head_dim(k_cache.size(3)) {}

  // One query row (G query heads per KV head, for KV heads [h0, h0 + n)) against the tokens
  // [first, len) of the context behind `table`, written to `out_row`.
  void attend_row(const T* q_row, T* out_row, int64_t h0, int64_t n, int64_t G,
                  const int32_t* table, int64_t first, int64_t len, double scale,
                  double softcap, Scratch& sc) const {
    const int64_t width = n * G * head_dim;
    sc.q.resize(width);
    for (int64_t j = 0; j < width; ++j) sc.q[j] = to_f(q_row[j]) * float(scale);
    attend(h0, h0 + n, G, head_dim, k, v, table, block_size, token_stride, block_stride, first,
           len, float(softcap), sc);
    for (int64_t j = 0; j < width; ++j) out_row[j] = from_f<T>(sc.acc[j]);
  }
};

template <typename T>
void decode_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                 const at::Tensor& v_cache, const at::Tensor& block_tables,
                 const at::Tensor& context_lens, double scale, int64_t window,
                 double softcap) {
  const PagedCache<T> cache(k_cache, v_cache);
  const int64_t B = q.size(0), Hkv = cache.kv_heads, G = q.size(1) / Hkv, D = cache.head_dim;
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int64_t per = heads_per_task(B, Hkv), tasks_per_seq = Hkv / per;
  parallel_tasks(B * tasks_per_seq, [&](int64_t i, Scratch& sc) {
    const int64_t b = i / tasks_per_seq, h0 = (i % tasks_per_seq) * per;
    if (lens[b] <= 0) return;
    const int64_t first = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
    cache.attend_row(qp + b * q.stride(0) + h0 * G * D, op + b * out.stride(0) + h0 * G * D,
                     h0, per, G, tables + b * block_tables.stride(0), first, lens[b], scale,
                     softcap, sc);
  });
}

// Query tokens per prefill task, and per pass over the task's keys.
constexpr int64_t kPrefillTaskQueries = 64;
constexpr int64_t kPrefillPassQueries = 8;

// Scores of `rows` query rows (q: rows x D, pre-scaled) against key tiles kt (per W keys, D
// vectors of W keys: the keys transposed), for the first `n` keys (a multiple of W):
// scores[i * stride + t]. Four rows at a time share each load of a key vector; no
// horizontal sums.
inline void tile_scores(const float* __restrict q, int64_t rows, int64_t D,
                        const float* __restrict kt, int64_t n, float* __restrict scores,
                        int64_t stride) {
  for (int64_t t0 = 0; t0 < n; t0 += W) {
    const float* tile = kt + t0 * D;  // D vectors of W keys
    int64_t i = 0;
    for (; i + 4 <= rows; i += 4) {
      const float *q0 = q + i * D, *q1 = q0 + D, *q2 = q1 + D, *q3 = q2 + D;
      vf a0 = {}, a1 = {}, a2 = {}, a3 = {};
      for (int64_t d = 0; d < D; ++d) {
        const vf k = loadv(tile + d * W);
        a0 += q0[d] * k, a1 += q1[d] * k, a2 += q2[d] * k, a3 += q3[d] * k;
      }
      storev(scores + i * stride + t0, a0);
      storev(scores + (i + 1) * stride + t0, a1);
      storev(scores + (i + 2) * stride + t0, a2);
      storev(scores + (i + 3) * stride + t0, a3);
    }
    for (; i < rows; ++i) {
      const float* qi = q + i * D;
      vf a = {};
      for (int64_t d = 0; d < D; ++d) a += qi[d] * loadv(tile + d * W);
      storev(scores + i * stride + t0, a);
    }
  }
}

// Chunks of queries against their cached prefix and themselves (causal). One task per
// (sequence, KV head, 64 query tokens): the task's keys are transposed once into tiles of W
// keys, so a query row's scores come W at a time from plain multiply-adds; the values are
// then read once per query token for its G query heads. With a window, the task reads keys
// from its first query's window on, and each query's softmax covers its own window (and its
// soft cap only those scores: the rest of a pass's rows are keys the query does not see).
template <typename T>
void prefill_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                  const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                  double scale, int64_t window, double softcap) {
  const float cap = float(softcap);
  const PagedCache<T> cache(k_cache, v_cache);
  const int64_t Hkv = cache.kv_heads, G = q.size(1) / Hkv, D = cache.head_dim;
  const int64_t S = context_lens.size(0);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* ctx = context_lens.data_ptr<int32_t>();
  const int64_t qstride = q.stride(0), ostride = out.stride(0);
  // Tasks: per sequence, ceil(chunk / 64) query blocks x Hkv heads.
  std::vector<int64_t> task_start(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t qlen = starts[s + 1] - starts[s];
    task_start[s + 1] = task_start[s] + (qlen + kPrefillTaskQueries - 1) / kPrefillTaskQueries * Hkv;
  }
  parallel_tasks(task_start[S], [&](int64_t i, Scratch& sc) {
    const int64_t s =
        std::upper_bound(task_start.begin(), task_start.end(), i) - task_start.begin() - 1;
    const int64_t local = i - task_start[s], h = local % Hkv;
    const int64_t qlen = starts[s + 1] - starts[s], prefix = ctx[s] - qlen;
    const int64_t j0 = local / Hkv * kPrefillTaskQueries;
    const int64_t j1 = std::min(qlen, j0 + kPrefillTaskQueries);
    // Query j sees keys [lo(j), prefix + j + 1); the task reads them from its first query's
    // lo on (k0), and key k0 + t is at row t.
    auto lo = [&](int64_t j) {
      return window > 0 ? std::max<int64_t>(0, prefix + j + 1 - window) : int64_t(0);
    };
    const int64_t k0 = lo(j0), keys = prefix + j1 - k0, padded = (keys + W - 1) / W * W;
    const int32_t* table = tables + s * block_tables.stride(0);
    context_rows(cache.k, table, k0, k0 + keys, cache.block_size, cache.token_stride,
                 cache.block_stride, h, h + 1, D, sc.k_rows, sc.k_f);
    context_rows(cache.v, table, k0, k0 + keys, cache.block_size, cache.token_stride,
                 cache.block_stride, h, h + 1, D, sc.v_rows, sc.v_f);
    // Keys transposed in tiles of W (zeros past the last key).
    sc.kt.assign(padded * D, 0.f);
    for (int64_t t = 0; t < keys; ++t) {
      const float* r = sc.k_rows[t];
      float* tile = sc.kt.data() + (t / W) * W * D + t % W;
      for (int64_t d = 0; d < D; ++d) tile[d * W] = r[d];
    }
    for (int64_t a = j0; a < j1; a += kPrefillPassQueries) {
      const int64_t b = std::min(j1, a + kPrefillPassQueries), rows = (b - a) * G;
      const int64_t n = (prefix + b - k0 + W - 1) / W * W;  // keys the pass's last query sees, padded
      sc.q.resize(rows * D);
      for (int64_t j = a; j < b; ++j) {
        const T* src = qp + (starts[s] + j) * qstride + h * G * D;
        float* dst = sc.q.data() + (j - a) * G * D;
        for (int64_t e = 0; e < G * D; ++e) dst[e] = to_f(src[e]) * float(scale);
      }
      sc.scores.resize(rows * n);
      tile_scores(sc.q.data(), rows, D, sc.kt.data(), n, sc.scores.data(), n);
      sc.acc.resize(G * D);
      for (int64_t j = a; j < b; ++j) {
        const int64_t first = lo(j) - k0, len = prefix + j + 1 - k0 - first;  // rows of its keys
        float* p = sc.scores.data() + (j - a) * G * n + first;
        if (cap > 0.f)
          for (int64_t g = 0; g < G; ++g) soft_cap(p + g * n, len, cap);
        for (int64_t g = 0; g < G; ++g) softmax(p + g * n, len);
        weighted_sum(p, n, sc.v_rows.data() + first, 0, len, D, G, sc.acc.data());
        T* dst = op + (starts[s] + j) * ostride + h * G * D;
        for (int64_t e = 0; e < G * D; ++e) dst[e] = from_f<T>(sc.acc[e]);
      }
    }
  });
}

void check_qo(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be (tokens, heads, head_dim) with contiguous heads");
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1 && out.stride(1) == out.size(2),
              "out must be shaped like q");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "q, out and the caches must share a dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "q and the cache have different head dims");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
}

// A negative, infinite or NaN cap is a caller's mistake, not "no cap" (0 is).
void check_softcap(double softcap) {
  TORCH_CHECK(softcap >= 0.0 && std::isfinite(softcap),
              "softcap must be 0 (no cap) or a positive finite number, got ", softcap);
}

void paged_decode_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor block_tables, at::Tensor context_lens, double scale,
                            int64_t window, double softcap) {
  check_cache(k_cache, v_cache);
  check_qo(out, q, k_cache);
  check_softcap(softcap);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "block tables and context lengths must be int32");
  TORCH_CHECK(block_tables.is_contiguous() && context_lens.is_contiguous());
  DISPATCH_FLOATS(q.scalar_type(), "paged_decode_attention", [&] {
    decode_impl<scalar_t>(out, q, k_cache, v_cache, block_tables, context_lens, scale, window,
                          softcap);
  });
}

void paged_prefill_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache,
                             at::Tensor v_cache, at::Tensor block_tables,
                             at::Tensor query_start_loc, at::Tensor context_lens, double scale,
                             int64_t window, double softcap) {
  check_cache(k_cache, v_cache);
  check_qo(out, q, k_cache);
  check_softcap(softcap);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "block tables, query offsets and context lengths must be int32");
  TORCH_CHECK(block_tables.is_contiguous() && context_lens.is_contiguous() &&
              query_start_loc.is_contiguous());
  DISPATCH_FLOATS(q.scalar_type(), "paged_prefill_attention", [&] {
    prefill_impl<scalar_t>(out, q, k_cache, v_cache, block_tables, query_start_loc,
                           context_lens, scale, window, softcap);
  });
}

// q (T, Hq, D), k (T, Hkv, D) views of the qkv projection, rotated in place at `positions`
// (rotate-half layout); cos/sin are the (max_position, D) float32 tables.
void rotary_embedding(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos,
                      at::Tensor sin) {
  const int64_t T = q.size(0), Hq = q.size(1), Hkv = k.size(1), D = q.size(2), half = D / 2;
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && q.stride(1) == D && k.stride(1) == D,
              "q and k must have contiguous heads");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == D,
              "cos/sin must be contiguous float32 (positions, head_dim)");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "positions must be contiguous int64");
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), "q and k must share a dtype");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t P = cos.size(0);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "position ", pos[t], " is outside the rotary table");
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  DISPATCH_FLOATS(q.scalar_type(), "rotary_embedding", [&] {
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    const int64_t qs = q.stride(0), ks = k.stride(0);
    auto rotate = [&](scalar_t* x, const float* cr, const float* sr) {
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = to_f(x[i]), x2 = to_f(x[i + half]);
        x[i] = from_f<scalar_t>(x1 * cr[i] - x2 * sr[i]);
        x[i + half] = from_f<scalar_t>(x2 * cr[i + half] + x1 * sr[i + half]);
      }
    };
    at::parallel_for(0, T, row_grain((Hq + Hkv) * D), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* cr = c + pos[t] * D;
        const float* sr = s + pos[t] * D;
        for (int64_t h = 0; h < Hq; ++h) rotate(qp + t * qs + h * D, cr, sr);
        for (int64_t h = 0; h < Hkv; ++h) rotate(kp + t * ks + h * D, cr, sr);
      }
    });
  });
}

// k, v (T, Hkv, D) into the paged caches at `slots` (int64; -1 = padding, not written).
void store_kv(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
              at::Tensor slots) {
  check_cache(k_cache, v_cache);
  const int64_t T = k.size(0), Hkv = k.size(1), D = k.size(2);
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == D && v.stride(1) == D,
              "k and v must have contiguous heads");
  TORCH_CHECK(Hkv == k_cache.size(2) && D == k_cache.size(3), "k does not fit the cache");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k.scalar_type(),
              "k, v and the caches must share a dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.size(0) == T,
              "slots must be contiguous int64, one per token");
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t slots_total = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sl[t] < slots_total, "slot ", sl[t], " is outside the KV cache");
  const int64_t token_stride = k_cache.stride(1), row = Hkv * D;
  DISPATCH_FLOATS(k.scalar_type(), "store_kv", [&] {
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const int64_t ks = k.stride(0), vs = v.stride(0);
    for (int64_t t = 0; t < T; ++t) {
      if (sl[t] < 0) continue;
      std::copy(kp + t * ks, kp + t * ks + row, kc + sl[t] * token_stride);
      std::copy(vp + t * vs, vp + t * vs + row, vc + sl[t] * token_stride);
    }
  });
}

// out = weight * to_dtype(x * rsqrt(mean(x^2) + eps)), row by row, as the torch reference.
template <typename T>
inline void norm_row(const T* x, const T* w, T* out, int64_t N, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < N; ++i) ss += to_f(x[i]) * to_f(x[i]);
  const float r = 1.f / std::sqrt(ss / float(N) + eps);
  for (int64_t i = 0; i < N; ++i) out[i] = from_f<T>(to_f(w[i]) * to_f(from_f<T>(to_f(x[i]) * r)));
}

void check_rows(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous (tokens, hidden) tensor");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous() &&
              w.scalar_type() == x.scalar_type(), "weight must be (hidden,) in x's dtype");
}

// residual += x; x = norm(residual), both in place.
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check_rows(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() &&
              residual.scalar_type() == x.scalar_type(), "residual must be shaped like x");
  const int64_t T = x.size(0), N = x.size(1);
  DISPATCH_FLOATS(x.scalar_type(), "fused_add_rms_norm", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    at::parallel_for(0, T, row_grain(N), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        scalar_t* xr = xp + t * N;
        scalar_t* rr = rp + t * N;
        for (int64_t i = 0; i < N; ++i) rr[i] = from_f<scalar_t>(to_f(xr[i]) + to_f(rr[i]));
        norm_row(rr, wp, xr, N, float(eps));
      }
    });
  });
}

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, weight);
  auto out = at::empty_like(x);
  const int64_t T = x.size(0), N = x.size(1);
  DISPATCH_FLOATS(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, row_grain(N), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) norm_row(xp + t * N, wp, op + t * N, N, float(eps));
    });
  });
  return out;
}

// gate_up (T, 2I) -> act(gate) * up (T, I), act as gated_row's `z` says.
template <typename Z>
at::Tensor gated_and_mul(const at::Tensor& gate_up, const char* name, const Z& z) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0, name,
              ": gate_up must be a contiguous (tokens, 2 * intermediate) tensor");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = at::empty({T, I}, gate_up.options());
  DISPATCH_FLOATS(gate_up.scalar_type(), name, [&] {
    const scalar_t* x = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, row_grain(2 * I), [&](int64_t begin, int64_t end) {
      std::vector<float> buf(I);
      for (int64_t t = begin; t < end; ++t)
        gated_row(x + t * 2 * I, x + t * 2 * I + I, o + t * I, I, buf.data(), z);
    });
  });
  return out;
}

// gate_up (T, 2I) -> silu(gate) * up (T, I), silu(g) = g / (1 + exp(-g)).
at::Tensor silu_and_mul(at::Tensor gate_up) {
  return gated_and_mul(gate_up, "silu_and_mul", [](float g) { return g; });
}

// gate_up (T, 2I) -> gelu_tanh(gate) * up (T, I), torch's gelu(approximate="tanh"):
// 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), computed as g / (1 + exp(-2 * that tanh's
// argument)), which has no cancellation where tanh is near -1.
at::Tensor gelu_tanh_and_mul(at::Tensor gate_up) {
  constexpr float kTwoSqrt2OverPi = 1.5957691216057308f;  // 2 * sqrt(2 / pi)
  return gated_and_mul(gate_up, "gelu_tanh_and_mul",
                       [](float g) { return kTwoSqrt2OverPi * (g + 0.044715f * g * g * g); });
}

}  // namespace conveyor_cpu
