// SIMD helpers and dtype dispatch shared by the CPU kernels (ops.cpp, moe.cpp).
#pragma once

#include <torch/extension.h>

#include <cmath>
#include <cstdint>

namespace conveyor_cpu {

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

template <typename T>
inline T from_f(float v) { return static_cast<T>(v); }

// SIMD through GCC/Clang vector extensions: AVX-512 or AVX2 on x86, NEON on ARM, as built.
#if defined(__AVX512F__)
constexpr int64_t W = 16;
#else
constexpr int64_t W = 8;
#endif
typedef float vf __attribute__((vector_size(W * sizeof(float))));

inline vf loadv(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

inline void storev(float* p, vf v) { __builtin_memcpy(p, &v, sizeof v); }

// Horizontal sum as a tree of halvings (log2(W) dependent adds, not W).
inline float hsum(vf v) {
  typedef float hf __attribute__((vector_size(W / 2 * sizeof(float))));
  hf lo, hi;
  __builtin_memcpy(&lo, &v, sizeof lo);
  __builtin_memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  hf h = lo + hi;
  float s[W / 2];
  __builtin_memcpy(s, &h, sizeof s);
  float a = 0.f, b = 0.f;
  for (int64_t i = 0; i < W / 2; i += 2) a += s[i], b += s[i + 1];
  return a + b;
}

// exp(x) for a vector: x = n ln2 + r, |r| <= ln2/2, exp(r) by a degree-6 polynomial, 2^n
// by building the float's exponent (about 2 ulp; -inf and very negative x give 0).
inline vf expv(vf x) {
  typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));
  const vf hi = vf{} + 88.3762626647949f, lo = vf{} - 87.3365447504f;
  const vi under = x < lo;
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  const vf n = __builtin_convertvector(
      __builtin_convertvector(x * 1.44269504088896341f + (x >= 0 ? 0.5f : -0.5f), vi), vf);
  const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf p = vf{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  const vf y = p * scale;
  return under ? vf{} : y;
}

inline void exp_inplace(float* __restrict x, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) storev(x + i, expv(loadv(x + i)));
  for (; i < n; ++i) x[i] = std::exp(x[i]);
}

// y = act(g) * u over n elements for the gated activations that are act(g) = g * sigmoid(z(g))
// = g / (1 + exp(-z(g))): SiLU (z = g) and GELU's tanh approximation (z = 2 sqrt(2/pi)
// (g + 0.044715 g^3), as 0.5 (1 + tanh(z / 2)) = sigmoid(z)). act(g) is rounded to T before
// the product, as the unfused torch ops round it.
template <typename T, typename Z>
inline void gated_row(const T* __restrict g, const T* __restrict u, T* __restrict y, int64_t n,
                      float* __restrict buf, const Z& z) {
  for (int64_t i = 0; i < n; ++i) buf[i] = -z(to_f(g[i]));
  exp_inplace(buf, n);  // exp(-z(g))
  for (int64_t i = 0; i < n; ++i) {
    const float gv = to_f(g[i]);
    y[i] = from_f<T>(to_f(from_f<T>(gv / (1.f + buf[i]))) * to_f(u[i]));
  }
}

// Run the lambda with scalar_t as the tensor's float type.
#define DISPATCH_FLOATS(dtype, NAME, ...)                                      \
  switch (dtype) {                                                             \
    case at::kFloat: { using scalar_t = float; __VA_ARGS__(); break; }         \
    case at::kBFloat16: { using scalar_t = at::BFloat16; __VA_ARGS__(); break; } \
    case at::kHalf: { using scalar_t = at::Half; __VA_ARGS__(); break; }       \
    default: TORCH_CHECK(false, NAME, ": unsupported dtype ", dtype);          \
  }

}  // namespace conveyor_cpu
