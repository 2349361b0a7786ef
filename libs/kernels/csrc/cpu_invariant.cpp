// A batch-invariant bf16 linear for --deterministic: y = x @ w^T with bf16 x [M, K] and w [N, K],
// each output summed in fp32 in one fixed order (returned in fp32) whatever M is, which tile it
// falls in and which thread computes it. Built with the other CPU ops by libs/kernels/cpu_ext.py;
// the torch reference is F.linear (libs/kernels/linear.py), equal to bf16 rounding.
//
// The matmul library's bf16 product is not batch-invariant on a CPU with native bf16 math: one
// row takes another path than two, and about one output in 600 rounds the other way (measured
// on SmolLM2's down projection, an AVX-512 BF16 EPYC), which flips a greedy token within a few
// dozen. Here every output element is one vector accumulator over K in steps of the vector
// width, reduced the same way, in every tile shape: rows and features only choose which
// accumulators share a load.

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "ops.h"
#include "pool.h"
#include "vec.h"

namespace {

using deepinfer::BF16;

// The fixed per-element order, the same in every tile shape: with AVX-512 BF16, lane l takes the
// pairs (2l, 2l + 1) of each 32 columns; then lanes accumulate k = l, l + W, ... (W the vector
// width) over what is left; one horizontal sum; the scalar tail in order.
template <int RM, int RN>
inline void bf16_tile(const BF16* x, int64_t K, const BF16* w, float* out, int64_t N) {
  float sums[RM][RN] = {};
  int64_t k = 0;
#if defined(DEEPINFER_AVX512)
  __m512 acc[RM][RN];
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) acc[i][j] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
  // Native bf16 pairs: lane l adds x[2l] w[2l] + x[2l + 1] w[2l + 1] per 32 columns, as one
  // instruction with no widening (2x the fp32 multiply-adds' products per instruction).
  for (; k + 32 <= K; k += 32) {
    __m512bh xv[RM];
#pragma GCC unroll 4
    for (int i = 0; i < RM; ++i) xv[i] = (__m512bh)_mm512_loadu_si512(x + i * K + k);
#pragma GCC unroll 4
    for (int j = 0; j < RN; ++j) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + j * K + k);
#pragma GCC unroll 4
      for (int i = 0; i < RM; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[i], wv);
    }
  }
#endif
  for (; k + 16 <= K; k += 16) {
    __m512 xv[RM];
#pragma GCC unroll 4
    for (int i = 0; i < RM; ++i) xv[i] = deepinfer::load16(x + i * K + k);
#pragma GCC unroll 4
    for (int j = 0; j < RN; ++j) {
      const __m512 wv = deepinfer::load16(w + j * K + k);
#pragma GCC unroll 4
      for (int i = 0; i < RM; ++i) acc[i][j] = _mm512_fmadd_ps(xv[i], wv, acc[i][j]);
    }
  }
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) sums[i][j] = _mm512_reduce_add_ps(acc[i][j]);
#elif defined(DEEPINFER_AVX2)
  __m256 acc[RM][RN];
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) acc[i][j] = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    __m256 xv[RM];
    for (int i = 0; i < RM; ++i) xv[i] = deepinfer::load8(x + i * K + k);
    for (int j = 0; j < RN; ++j) {
      const __m256 wv = deepinfer::load8(w + j * K + k);
      for (int i = 0; i < RM; ++i) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
    }
  }
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) sums[i][j] = deepinfer::hsum(acc[i][j]);
#endif
  for (; k < K; ++k)
    for (int i = 0; i < RM; ++i)
      for (int j = 0; j < RN; ++j)  // fma, not a * b + c, which the compiler may or may not fuse per loop
        sums[i][j] = std::fma(static_cast<float>(x[i * K + k]), static_cast<float>(w[j * K + k]), sums[i][j]);
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) out[i * N + j] = sums[i][j];
}

// Features [n0, n1) of all M rows, 4 rows x 4 features a tile where they fill one.
void bf16_features(const BF16* x, int64_t M, int64_t K, const BF16* w, float* out, int64_t N, int64_t n0,
                   int64_t n1) {
  for (int64_t m = 0; m < M; m += 4) {
    const BF16* xm = x + m * K;
    float* om = out + m * N;
    const bool full = m + 4 <= M;
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) {
      if (full) {
        bf16_tile<4, 4>(xm, K, w + n * K, om + n, N);
      } else {
        for (int64_t r = 0; r < M - m; ++r) bf16_tile<1, 4>(xm + r * K, K, w + n * K, om + r * N + n, N);
      }
    }
    for (; n < n1; ++n)
      for (int64_t r = 0; r < std::min<int64_t>(4, M - m); ++r) bf16_tile<1, 1>(xm + r * K, K, w + n * K, om + r * N + n, N);
  }
}

}  // namespace

namespace deepinfer {

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "bf16_linear: x [M, K], weight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bf16_linear: bfloat16 inputs");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "bf16_linear: contiguous inputs");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  const BF16* xp = x.data_ptr<BF16>();
  const BF16* wp = weight.data_ptr<BF16>();
  float* op = out.data_ptr<float>();
  // 64 features a chunk: the chunk's weights stay in L2 while every row tile passes over them.
  deepinfer::parallel_for(0, (N + 63) / 64, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) bf16_features(xp, M, K, wp, op, N, c * 64, std::min(N, (c + 1) * 64));
  });
  return out;  // fp32: the caller adds a bias, if any, before the one rounding to bf16
}

}  // namespace deepinfer

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) { m.def("bf16_linear(Tensor x, Tensor weight) -> Tensor"); }

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) { m.impl("bf16_linear", &deepinfer::bf16_linear); }
