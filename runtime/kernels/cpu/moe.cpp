// A mixture-of-experts MLP's routed experts on CPU (Mixtral, Qwen-MoE): three parallel passes
// over the token-expert pairs grouped by expert, where the torch path makes a dozen calls (and
// as many OpenMP regions) for every expert that has tokens. An expert with many tokens (a
// prefill's) runs oneDNN's GEMMs on its prepacked weights instead, as a dense layer's: each
// expert (or share of one) whole on one thread, the experts in parallel.
//
// 1. For each expert and tile of its MLP columns: the gate and up rows' dot products with the
//    expert's tokens, then act(gate) * up, into h (pairs, I).
// 2. For each expert and tile of the hidden columns: the down rows' dot products with h, times
//    the pair's routing weight, into y (pairs, H) in float32.
// 3. Each token's out = the sum of its k pairs' y.
//
// Each weight row is read once per step for all the expert's tokens (four at a time share its
// loads), so a decode step reads every picked expert's weights once: the memory-bound floor.
// Rounding is the torch path's (layers/moe.py): gate and up, the activation, the product and
// the down projection in the model's dtype, the weighted sum in float32, rounded once.

#include "ops.h"
#include "simd.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <algorithm>
#include <array>
#include <memory>
#include <type_traits>
#include <vector>

namespace conveyor_cpu {
namespace {

constexpr int64_t kColumnsPerTask = 16;
// Rows (an expert's tokens in the step) from which oneDNN's GEMM on the prepacked weights
// beats the tiles below: measured on qwen3moe-8l-512's and mixtral-8l-512's experts.
constexpr int64_t kPackedMinRows = 16;
// The fewest rows of a share of an expert's rows on that path: the experts with many rows are
// split into shares for the threads to have work to the end of a layer where few experts
// hold most rows.
constexpr int64_t kShareMinRows = 64;
// An expert whose gate and up outputs (rows x 2I values) take more bytes than this (a core's
// L2 here) runs each GEMM on every thread, not whole on one: on mixtral-8l-512's experts of
// 512 rows, two at once (one a thread) ran 0.89x as fast as one after another (one run).
constexpr int64_t kOneThreadMaxBytes = 2 << 20;
// Rows per chunk of the loops around a task's GEMMs.
constexpr int64_t kRowsPerChunk = 16;
constexpr float kTwoSqrt2OverPi = 1.5957691216057308f;  // GELU-tanh's z, as ops.cpp's

// fn(i) for i in [0, n) on torch's threads, one task at a time each (dynamic: a thread the OS
// deschedules holds back one task, not a share).
template <typename F>
void for_tasks(int64_t n, const F& fn) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i) fn(i);
}

template <typename T>
inline float round_to(float v) {
  return to_f(from_f<T>(v));
}

// A block of dot products: out[i][j] = a[i] . w[j] over n floats, for kRows rows and kCols
// weight rows, each vector load serving kCols (or kRows) FMAs; the accumulators stay in
// registers (16 + 8 loads of AVX-512's 32, 8 + 6 of AVX2's 16).
constexpr int kRows = W == 16 ? 4 : 2, kCols = 4;

inline void block_dots(const float* const* a, const float* const* w, int64_t n,
                       float out[kRows][kCols]) {
  vf acc[kRows][kCols] = {};
  int64_t d = 0;
  for (; d + W <= n; d += W) {
    vf av[kRows], wv[kCols];
    for (int i = 0; i < kRows; ++i) av[i] = loadv(a[i] + d);
    for (int j = 0; j < kCols; ++j) wv[j] = loadv(w[j] + d);
    for (int i = 0; i < kRows; ++i)
      for (int j = 0; j < kCols; ++j) acc[i][j] += av[i] * wv[j];
  }
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < kCols; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t e = d; e < n; ++e) s += a[i][e] * w[j][e];
      out[i][j] = s;
    }
}

// out[r * cols + c] = a[r] . w[c] for r < rows, c < cols (each row n floats), in blocks; a
// block past the last row or column repeats it and drops the result.
void tile_dots(const float* const* a, int64_t rows, const float* const* w, int64_t cols,
               int64_t n, float* out) {
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const float* ar[kRows];
    for (int i = 0; i < kRows; ++i) ar[i] = a[std::min(r0 + i, rows - 1)];
    for (int64_t c0 = 0; c0 < cols; c0 += kCols) {
      const float* wc[kCols];
      for (int j = 0; j < kCols; ++j) wc[j] = w[std::min(c0 + j, cols - 1)];
      float res[kRows][kCols];
      block_dots(ar, wc, n, res);
      for (int i = 0; i < kRows && r0 + i < rows; ++i)
        for (int j = 0; j < kCols && c0 + j < cols; ++j) out[(r0 + i) * cols + c0 + j] = res[i][j];
    }
  }
}

// Pointers to `count` consecutive weight rows of n values from `first`, as float32 (in place
// for float, converted into buf otherwise).
template <typename T>
void weight_rows(const T* first, int64_t count, int64_t n, std::vector<float>& buf,
                 const float** rows) {
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t j = 0; j < count; ++j) rows[j] = first + j * n;
  } else {
    buf.resize(count * n);
    for (int64_t i = 0; i < count * n; ++i) buf[i] = to_f(first[i]);
    for (int64_t j = 0; j < count; ++j) rows[j] = buf.data() + j * n;
  }
}

// The tasks of a pass: (expert, first column) for every expert that has pairs.
std::vector<std::pair<int64_t, int64_t>> tiles(const std::vector<int64_t>& count, int64_t cols) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t e = 0; e < static_cast<int64_t>(count.size()); ++e)
    if (count[e] > 0)
      for (int64_t c = 0; c < cols; c += kColumnsPerTask) out.emplace_back(e, c);
  return out;
}

template <typename T>
void moe_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
              const at::Tensor& topk_weights, const at::Tensor& topk_ids, bool gelu,
              const std::vector<at::Tensor>& packed_w13, const std::vector<at::Tensor>& packed_w2) {
  const int64_t T_ = x.size(0), H = x.size(1), E = w13.size(0), I = w13.size(1) / 2;
  const int64_t k = topk_ids.size(1), S = T_ * k;
  const T* xp = x.data_ptr<T>();
  const T* w13p = w13.data_ptr<T>();
  const T* w2p = w2.data_ptr<T>();
  const float* weights = topk_weights.data_ptr<float>();
  const int64_t* ids = topk_ids.data_ptr<int64_t>();

  // The pairs grouped by expert (a counting sort): pairs start[e] .. start[e + 1] of `pair`.
  std::vector<int64_t> count(E, 0), start(E + 1, 0), pair(S);
  for (int64_t p = 0; p < S; ++p) {
    TORCH_CHECK(ids[p] >= 0 && ids[p] < E, "moe_experts: expert id ", ids[p], " out of range");
    ++count[ids[p]];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] = start[e] + count[e];
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < S; ++p) pair[next[ids[p]]++] = p;
  }
  // Each pair's weighted output; every row is written below: no need to zero it.
  std::unique_ptr<float[]> y(new float[S * H]);

  // 0. The experts with many rows (a prefill's): oneDNN's GEMMs on their prepacked weights.
  //    Each task is one expert's rows, or a share of them, on one thread (oneDNN runs
  //    single-threaded inside the parallel region): no barrier between the GEMMs, and the
  //    gather, the activation and the weighted scatter fused around them, in buffers of the
  //    task's own.
  std::vector<int64_t> tiled = count;
  if (!packed_w13.empty()) {
    // Rows per task at most: enough tasks for two a thread (an expert that has more rows is
    // split into even shares), but no fewer rows than kShareMinRows (oneDNN's GEMMs slow down
    // below those) and none split on one thread (which would read its weights twice).
    const int64_t threads = at::get_num_threads();
    int64_t packed_rows = 0;
    for (int64_t e = 0; e < E; ++e)
      if (count[e] >= kPackedMinRows) packed_rows += count[e];
    const int64_t share_rows =
        threads <= 1 ? S : std::max(kShareMinRows, (packed_rows + 2 * threads - 1) / (2 * threads));
    std::vector<std::array<int64_t, 3>> tasks;  // (expert, first row, rows)
    for (int64_t e = 0; e < E; ++e)  // the experts too large for one thread first
      if (count[e] >= kPackedMinRows && threads > 1 &&
          count[e] * 2 * I * static_cast<int64_t>(sizeof(T)) > kOneThreadMaxBytes) {
        tiled[e] = 0;
        tasks.push_back({e, 0, count[e]});
      }
    const int64_t whole = static_cast<int64_t>(tasks.size());
    for (int64_t e = 0; e < E; ++e) {
      if (count[e] < kPackedMinRows || tiled[e] == 0) continue;
      tiled[e] = 0;
      const int64_t shares = (count[e] + share_rows - 1) / share_rows;
      for (int64_t s = 0; s < shares; ++s) {
        const int64_t r0 = count[e] * s / shares, r1 = count[e] * (s + 1) / shares;
        tasks.push_back({e, r0, r1 - r0});
      }
    }
    // The largest first, so that the last task a thread takes is a short one.
    std::stable_sort(tasks.begin() + whole, tasks.end(),
                     [](const auto& a, const auto& b) { return a[2] > b[2]; });
    const auto opts = x.options();
    const at::ThreadLocalState state;  // grad and inference mode, for the pool's threads
    const auto run = [&](int64_t task) {
      const at::ThreadLocalStateGuard guard(state);
      const auto [e, r0, n] = tasks[task];
      const int64_t* rows = pair.data() + start[e] + r0;
      // The loops around the GEMMs are parallel where the task runs alone (serial inside
      // for_tasks' region, as at::parallel_for is in any).
      std::unique_ptr<T[]> xg(new T[n * H]), act(new T[n * I]);
      at::parallel_for(0, n, kRowsPerChunk, [&](int64_t b, int64_t end) {
        for (int64_t i = b; i < end; ++i)
          std::copy_n(xp + (rows[i] / k) * H, H, xg.get() + i * H);
      });
      const at::Tensor gate_up =
          linear(at::from_blob(xg.get(), {n, H}, opts), w13[e], packed_w13[e], at::empty({0}));
      const T* gu = gate_up.data_ptr<T>();
      at::parallel_for(0, n, kRowsPerChunk, [&](int64_t b, int64_t end) {
        std::vector<float> buf(I);
        for (int64_t i = b; i < end; ++i) {
          if (gelu)
            gated_row(gu + i * 2 * I, gu + i * 2 * I + I, act.get() + i * I, I, buf.data(),
                      [](float g) { return kTwoSqrt2OverPi * (g + 0.044715f * g * g * g); });
          else
            gated_row(gu + i * 2 * I, gu + i * 2 * I + I, act.get() + i * I, I, buf.data(),
                      [](float g) { return g; });
        }
      });
      const at::Tensor down =
          linear(at::from_blob(act.get(), {n, I}, opts), w2[e], packed_w2[e], at::empty({0}));
      const T* dp = down.data_ptr<T>();
      at::parallel_for(0, n, kRowsPerChunk, [&](int64_t b, int64_t end) {
        for (int64_t i = b; i < end; ++i) {
          const int64_t p = rows[i];
          const float wp = weights[p];
          for (int64_t c = 0; c < H; ++c) y[p * H + c] = to_f(dp[i * H + c]) * wp;
        }
      });
    };
    // The large experts one after another, each of oneDNN's GEMMs on every thread; the rest
    // in parallel, unless they are fewer than the threads (a short prefill on many cores).
    const int64_t n_tasks = static_cast<int64_t>(tasks.size());
    for (int64_t task = 0; task < whole; ++task) run(task);
    if (n_tasks - whole >= threads) {
      for_tasks(n_tasks - whole, [&](int64_t i) { run(whole + i); });
    } else {
      for (int64_t task = whole; task < n_tasks; ++task) run(task);
    }
  }

  // The tiles' pairs' token rows, as float32 (converted only where some expert has them).
  const bool any_tiled = std::any_of(tiled.begin(), tiled.end(), [](int64_t n) { return n > 0; });
  std::vector<float> x_f;
  if constexpr (!std::is_same_v<T, float>) {
    if (any_tiled) {
      x_f.resize(T_ * H);
      for (int64_t i = 0; i < T_ * H; ++i) x_f[i] = to_f(xp[i]);
    }
  }
  const float* xs = std::is_same_v<T, float> ? reinterpret_cast<const float*>(xp) : x_f.data();
  std::vector<const float*> x_rows(S), h_rows(S);
  // Every row of h that is read is written: no need to zero it.
  std::unique_ptr<float[]> h(new float[any_tiled ? S * I : 0]);
  if (any_tiled)
    for (int64_t i = 0; i < S; ++i) {
      x_rows[i] = xs + (pair[i] / k) * H;
      h_rows[i] = h.get() + i * I;
    }

  // 1. h = act(x . gate) * (x . up), per expert and tile of its I columns.
  const auto up_tiles = tiles(tiled, I);
  for_tasks(static_cast<int64_t>(up_tiles.size()), [&](int64_t task) {
    const auto [e, c0] = up_tiles[task];
    const int64_t n = count[e], first = start[e], cols = std::min(kColumnsPerTask, I - c0);
    const T* gate = w13p + (e * 2 * I + c0) * H;
    const T* up = gate + I * H;
    std::vector<float> g(n * cols), u(n * cols), gbuf, ubuf;
    const float* wg[kColumnsPerTask];
    const float* wu[kColumnsPerTask];
    weight_rows(gate, cols, H, gbuf, wg);
    weight_rows(up, cols, H, ubuf, wu);
    tile_dots(x_rows.data() + first, n, wg, cols, H, g.data());
    tile_dots(x_rows.data() + first, n, wu, cols, H, u.data());
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        const float gv = round_to<T>(g[i * cols + j]);
        const float z = gelu ? kTwoSqrt2OverPi * (gv + 0.044715f * gv * gv * gv) : gv;
        const float act = round_to<T>(gv / (1.f + std::exp(-z)));
        h[(first + i) * I + c0 + j] = round_to<T>(act * round_to<T>(u[i * cols + j]));
      }
  });

  // 2. y = (h . down) * weight, per expert and tile of the H columns, at the pair's own row.
  const auto down_tiles = tiles(tiled, H);
  for_tasks(static_cast<int64_t>(down_tiles.size()), [&](int64_t task) {
    const auto [e, c0] = down_tiles[task];
    const int64_t n = count[e], first = start[e], cols = std::min(kColumnsPerTask, H - c0);
    std::vector<float> d(n * cols), buf;
    const float* wd[kColumnsPerTask];
    weight_rows(w2p + (e * H + c0) * I, cols, I, buf, wd);
    tile_dots(h_rows.data() + first, n, wd, cols, I, d.data());
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = pair[first + i];
      for (int64_t j = 0; j < cols; ++j)
        y[p * H + c0 + j] = round_to<T>(d[i * cols + j]) * weights[p];
    }
  });

  // 3. Each token's k pairs summed, rounded once.
  T* op = out.data_ptr<T>();
  at::parallel_for(0, T_, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, k * H)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t t = begin; t < end; ++t)
                       for (int64_t c = 0; c < H; ++c) {
                         float s = 0.f;
                         for (int64_t j = 0; j < k; ++j) s += y[(t * k + j) * H + c];
                         op[t * H + c] = from_f<T>(s);
                       }
                   });
}

}  // namespace

// x (T, H); w13 (E, 2I, H): each expert's gate rows, then its up rows; w2 (E, H, I);
// topk_weights (T, k) float32 and topk_ids (T, k) int64: each token's experts -> (T, H),
// sum_j topk_weights[t, j] * w2[e] @ (act(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t])), e the
// token's j-th expert; act is SiLU, or GELU's tanh approximation with `gelu`.
// packed_w13, packed_w2: each expert's weights prepacked for oneDNN (runtime/layers/linear.py),
// used for the experts with many rows; empty: the tiles serve every expert.
at::Tensor moe_experts(at::Tensor x, at::Tensor w13, at::Tensor w2, at::Tensor topk_weights,
                       at::Tensor topk_ids, bool gelu, std::vector<at::Tensor> packed_w13,
                       std::vector<at::Tensor> packed_w2) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "moe_experts: x must be contiguous (T, H)");
  TORCH_CHECK(w13.dim() == 3 && w13.is_contiguous() && w13.size(2) == x.size(1) &&
                  w13.size(1) % 2 == 0 && w13.scalar_type() == x.scalar_type(),
              "moe_experts: w13 must be a contiguous (E, 2I, H) tensor of x's dtype");
  TORCH_CHECK(w2.dim() == 3 && w2.is_contiguous() && w2.size(0) == w13.size(0) &&
                  w2.size(1) == x.size(1) && w2.size(2) == w13.size(1) / 2 &&
                  w2.scalar_type() == x.scalar_type(),
              "moe_experts: w2 must be a contiguous (E, H, I) tensor of x's dtype");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0) && topk_ids.is_contiguous() &&
                  topk_ids.scalar_type() == at::kLong,
              "moe_experts: topk_ids must be contiguous int64 (T, k)");
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes() && topk_weights.is_contiguous() &&
                  topk_weights.scalar_type() == at::kFloat,
              "moe_experts: topk_weights must be contiguous float32 (T, k)");
  TORCH_CHECK(packed_w13.size() == packed_w2.size() &&
                  (packed_w13.empty() || static_cast<int64_t>(packed_w13.size()) == w13.size(0)),
              "moe_experts: one packed w13 and w2 per expert, or none");
  auto out = at::empty_like(x);
  if (x.size(0) == 0) return out;
  DISPATCH_FLOATS(x.scalar_type(), "moe_experts", [&] {
    moe_impl<scalar_t>(out, x, w13, w2, topk_weights, topk_ids, gelu, packed_w13, packed_w2);
  });
  return out;
}

}  // namespace conveyor_cpu
