// The int8 weight-only products of the CPU extension (built by libs/kernels/cpu_ext.py):
// y[M, N] = x[M, K] @ (w[N, K] * scales[N, None])^T, w int8, x, scales and y fp32; the torch
// reference is libs/kernels/int8_linear.py.
//
// One row is bound by reading the weights; more rows by the arithmetic (each weight converted
// and multiplied for every row), so the paths differ by row count:
// - one row: dot products, two weight rows side by side (two memory streams);
// - 2-3 rows, and 4 or more without int16 activations: tiles of fp32 products;
// - 4 or more rows with int16_activations, on a CPU with AVX-512 VNNI: int16 products into int32.
//   A caller that needs x unrounded (the LM head: logits and logprobs) passes false.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "ops.h"
#include "pool.h"
#include "vec.h"

namespace {

using namespace deepinfer;

// ---------------------------------------------------------------------------------------------
// fp32 activations.
// Each chunk of work is a range of output features, RN weight rows at a time, walking the input rows
// RM at a time over them: an RM x RN tile of accumulators stays in registers (AVX2 has 16), each
// int8 -> fp32 conversion serves RM rows and each loaded input vector RN weight rows. A block of
// weight rows is read from memory once; later input tiles find it in L1. Tiles of 4 x 2 measured
// fastest from 4 rows (1.5x the 8 x 1 tiles they replaced at 8 rows), 2 x 4 at 2-3.
template <int RM, int RN>
inline void int8_tile(const float* x, int64_t K, const int8_t* w, const float* scales, float* out, int64_t N) {
  int64_t k = 0;
  float sums[RM][RN] = {};
#ifdef DEEPINFER_AVX512
  {
    __m512 acc[RM][RN];
#pragma GCC unroll 4
    for (int i = 0; i < RM; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < RN; ++j) acc[i][j] = _mm512_setzero_ps();
    for (; k + 16 <= K; k += 16) {
      __m512 xv[RM];
#pragma GCC unroll 4
      for (int i = 0; i < RM; ++i) xv[i] = _mm512_loadu_ps(x + i * K + k);
#pragma GCC unroll 4
      for (int j = 0; j < RN; ++j) {
        const __m512 wv = load16(w + j * K + k);
#pragma GCC unroll 4
        for (int i = 0; i < RM; ++i) acc[i][j] = _mm512_fmadd_ps(wv, xv[i], acc[i][j]);
      }
    }
    for (int i = 0; i < RM; ++i)
      for (int j = 0; j < RN; ++j) sums[i][j] = _mm512_reduce_add_ps(acc[i][j]);
  }
#endif
#ifdef DEEPINFER_AVX2
  __m256 acc[RM][RN];
#pragma GCC unroll 4
  for (int i = 0; i < RM; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < RN; ++j) acc[i][j] = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    __m256 xv[RM];
#pragma GCC unroll 4
    for (int i = 0; i < RM; ++i) xv[i] = _mm256_loadu_ps(x + i * K + k);
#pragma GCC unroll 4
    for (int j = 0; j < RN; ++j) {
      const __m256 wv = load8(w + j * K + k);
#pragma GCC unroll 4
      for (int i = 0; i < RM; ++i) acc[i][j] = _mm256_fmadd_ps(wv, xv[i], acc[i][j]);
    }
  }
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) sums[i][j] += hsum(acc[i][j]);
#endif
  for (; k < K; ++k)
    for (int i = 0; i < RM; ++i)
      for (int j = 0; j < RN; ++j) sums[i][j] += static_cast<float>(w[j * K + k]) * x[i * K + k];
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) out[i * N + j] = sums[i][j] * scales[j];
}

// Output features [n0, n1) of all M rows.
template <int RM, int RN>
void int8_features(const float* x, int64_t M, int64_t K, const int8_t* w, const float* scales, float* out, int64_t N,
                   int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + RN <= n1; n += RN) {
    int64_t m = 0;
    for (; m + RM <= M; m += RM) int8_tile<RM, RN>(x + m * K, K, w + n * K, scales + n, out + m * N + n, N);
    for (; m < M; ++m) int8_tile<1, RN>(x + m * K, K, w + n * K, scales + n, out + m * N + n, N);
  }
  for (; n < n1; ++n) {
    int64_t m = 0;
    for (; m + RM <= M; m += RM) int8_tile<RM, 1>(x + m * K, K, w + n * K, scales + n, out + m * N + n, N);
    for (; m < M; ++m) int8_tile<1, 1>(x + m * K, K, w + n * K, scales + n, out + m * N + n, N);
  }
}

// Weight rows per tile from 4 input rows: AVX-512's 32 registers hold a 4 x 4 tile of
// accumulators beside its inputs; AVX2's 16 hold 4 x 2.
#ifdef DEEPINFER_AVX512
constexpr int WIDE_RN = 4;
#else
constexpr int WIDE_RN = 2;
#endif
constexpr int64_t INT8_CHUNK = 64;  // output features per chunk from 4 rows (16-256 measured alike)
constexpr int64_t INT16_MIN_ROWS = 4;  // below, rounding x to int16 gained nothing (0.9-0.97x at 2-3 rows)

#if defined(DEEPINFER_AVX512) && defined(__AVX512VNNI__)
#define DEEPINFER_VNNI 1
// ---------------------------------------------------------------------------------------------
// int16 activations (AVX-512 VNNI): each row of x rounded to int16 with its own scale
// (max |x| / 32767), each weight widened to int16 (vpmovsxbw: one instruction for 32, where fp32
// takes two for 16), and 32 products a lane pair summed into int32 per instruction (vpdpwssd).
// Each int32 lane's sum is exact; lanes meet in fp32. The rounding that counts is x's, 2^-16 of
// the row's largest value, finer than bf16's 2^-9 of each value unless the row's spread passes
// 128x. Over SmolLM2's projections at 2 threads: 1.18-1.33x the fp32 tiles at 4-32 rows
// (bench/kernels.py, "int8 int16 vs fp32 act").

// An int32 lane sums I16_CHUNK_K / 16 products of |q| <= 32768 and |w| <= 128 per chunk: 256 of
// them, at most 2^30, under 2^31; chunks meet in fp32.
constexpr int64_t I16_CHUNK_K = 4096;
// A row whose largest |x| is below this (or that holds a NaN or an infinity) keeps the fp32
// product: 32767 / max would overflow fp32 near 1e-34, and fp32 gives such rows its own answer.
constexpr float I16_MIN_TOP = 1e-30f;

// x's rows as int16: q [M, Kp] (Kp: K rounded down to 32; the rest stays fp32), each row's scale,
// and which rows keep the fp32 product instead (their q is 0).
struct Int16Rows {
  std::vector<int16_t> q;
  std::vector<float> scale;
  std::vector<uint8_t> fp32_row;
  int64_t Kp;
};

Int16Rows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t Kp = K / 32 * 32;
  Int16Rows rows{std::vector<int16_t>(M * Kp), std::vector<float>(M, 1.f), std::vector<uint8_t>(M, 0), Kp};
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    __m512 amax = _mm512_setzero_ps();
    __mmask16 unordered = 0;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      const __m512 v = _mm512_loadu_ps(row + k);
      amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign, v));
      unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    float top = _mm512_reduce_max_ps(amax);
    for (; k < K; ++k) {
      top = std::max(top, std::fabs(row[k]));
      unordered |= std::isnan(row[k]) ? 1 : 0;
    }
    if (unordered || !std::isfinite(top) || top < I16_MIN_TOP) {
      rows.fp32_row[m] = 1;
      continue;
    }
    rows.scale[m] = top / 32767.f;
    const __m512 inv = _mm512_set1_ps(32767.f / top);
    int16_t* q = rows.q.data() + m * Kp;
    for (int64_t j = 0; j < Kp; j += 16) {  // round to nearest even, saturate to int16
      const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + j), inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + j), _mm512_cvtsepi32_epi16(r));
    }
  }
  return rows;
}

// sums[i * RN + j] = q_i . w_j over [0, Kp), for RM rows of q ([RM, Kp]) and RN weight rows
// ([RN, K], int8): exact in each int32 lane within a chunk; lanes and chunks meet in fp32.
template <int RM, int RN>
inline void int16_tile(const int16_t* q, int64_t Kp, const int8_t* w, int64_t K, float* sums) {
  __m512 total[RM][RN];
#pragma GCC unroll 4
  for (int i = 0; i < RM; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < RN; ++j) total[i][j] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < Kp; k0 += I16_CHUNK_K) {
    const int64_t k1 = std::min(Kp, k0 + I16_CHUNK_K);
    __m512i acc[RM][RN];
#pragma GCC unroll 4
    for (int i = 0; i < RM; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < RN; ++j) acc[i][j] = _mm512_setzero_si512();
    for (int64_t k = k0; k < k1; k += 32) {
      __m512i xv[RM];
#pragma GCC unroll 4
      for (int i = 0; i < RM; ++i) xv[i] = _mm512_loadu_si512(q + i * Kp + k);
#pragma GCC unroll 4
      for (int j = 0; j < RN; ++j) {
        const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * K + k)));
#pragma GCC unroll 4
        for (int i = 0; i < RM; ++i) acc[i][j] = _mm512_dpwssd_epi32(acc[i][j], xv[i], wv);
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < RM; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < RN; ++j) total[i][j] = _mm512_add_ps(total[i][j], _mm512_cvtepi32_ps(acc[i][j]));
  }
  // A lane's integer sum converts to fp32 with one rounding (2^-24 of it, past 2^24); an exact
  // int64 meeting of the lanes measured 1.08-1.15x the fp32 tiles against 1.18-1.33x for this.
#pragma GCC unroll 4
  for (int i = 0; i < RM; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < RN; ++j) sums[i * RN + j] = _mm512_reduce_add_ps(total[i][j]);
}

template <int RN>
inline void int16_rows_tile(int64_t rows, const int16_t* q, int64_t Kp, const int8_t* w, int64_t K, float* sums) {
  switch (rows) {
    case 4: int16_tile<4, RN>(q, Kp, w, K, sums); break;
    case 3: int16_tile<3, RN>(q, Kp, w, K, sums); break;
    case 2: int16_tile<2, RN>(q, Kp, w, K, sums); break;
    default: int16_tile<1, RN>(q, Kp, w, K, sums); break;
  }
}

// Output features [n0, n1) of all M rows from int16 rows: per chunk of features, 4 rows x RN
// features a tile; each output is (its int16 sum * the row's scale + the fp32 tail past Kp) * the
// feature's scale.
void int16_features(const Int16Rows& xq, const float* x, int64_t M, int64_t K, const int8_t* w, const float* scales,
                    float* out, int64_t N, int64_t n0, int64_t n1) {
  constexpr int RN = 4;
  const int64_t Kp = xq.Kp;
  float sums[4 * RN];
  auto finish = [&](int64_t m, int64_t rows, int64_t n, int64_t cols) {
    for (int64_t i = 0; i < rows; ++i) {
      const float* xr = x + (m + i) * K;
      for (int64_t j = 0; j < cols; ++j) {
        const int8_t* wr = w + (n + j) * K;
        float v;
        if (xq.fp32_row[m + i]) {
          v = dot(xr, wr, K);  // the one-row product's own arithmetic
        } else {
          v = sums[i * cols + j] * xq.scale[m + i];
          for (int64_t k = Kp; k < K; ++k) v = fmadd(static_cast<float>(wr[k]), xr[k], v);
        }
        out[(m + i) * N + n + j] = v * scales[n + j];
      }
    }
  };
  for (int64_t c0 = n0; c0 < n1; c0 += INT8_CHUNK) {
    const int64_t c1 = std::min(n1, c0 + INT8_CHUNK);
    for (int64_t m = 0; m < M; m += 4) {
      const int64_t rows = std::min<int64_t>(4, M - m);
      const int16_t* q = xq.q.data() + m * Kp;
      int64_t n = c0;
      for (; n + RN <= c1; n += RN) {
        int16_rows_tile<RN>(rows, q, Kp, w + n * K, K, sums);
        finish(m, rows, n, RN);
      }
      for (; n < c1; ++n) {
        int16_rows_tile<1>(rows, q, Kp, w + n * K, K, sums);
        finish(m, rows, n, 1);
      }
    }
  }
}
#endif

}  // namespace

namespace deepinfer {

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, bool int16_activations) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && scales.dim() == 1, "int8_linear: x [M, K], weight [N, K], scales [N]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && scales.scalar_type() == at::kFloat, "int8_linear: x and scales are float32");
  TORCH_CHECK(weight.scalar_type() == at::kChar, "int8_linear: weight is int8");
  TORCH_CHECK(x.size(1) == weight.size(1) && scales.size(0) == weight.size(0), "int8_linear: shapes disagree");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && scales.is_contiguous(), "int8_linear: contiguous inputs");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Each chunk's features are contiguous (pool.h cuts a few chunks per thread); a product too
  // small to pay for waking the other threads (under ~256K weights) runs on one.
  const int64_t grain = N * K < (1 << 18) ? N : 16;
#ifdef DEEPINFER_VNNI
  const bool int16 = int16_activations && M >= INT16_MIN_ROWS;
  const Int16Rows xq = int16 ? quantize_rows(xp, M, K) : Int16Rows{};
#endif
  deepinfer::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    if (M == 1) {
      // A matrix-vector product, two FMA chains a weight row: rows from the two halves of this
      // chunk's features side by side (dot2), two memory streams where one row after another is
      // one. One thread over SmolLM2's projections: 1.2-1.3x (bench/kernels.py, int8_linear).
      const int64_t half = (end - begin) / 2;
      for (int64_t n = begin; n < begin + half; ++n) {
        float a, b;
        dot2(xp, wp + n * K, wp + (n + half) * K, K, &a, &b);
        op[n] = a * sp[n];
        op[n + half] = b * sp[n + half];
      }
      for (int64_t n = begin + 2 * half; n < end; ++n) op[n] = dot(xp, wp + n * K, K) * sp[n];
    } else if (M < 4) {
      int8_features<2, 4>(xp, M, K, wp, sp, op, N, begin, end);
#ifdef DEEPINFER_VNNI
    } else if (int16) {
      int16_features(xq, xp, M, K, wp, sp, op, N, begin, end);
#endif
    } else {
      // Features a chunk at a time, every 4-row tile over each chunk: the chunk's weights (64 rows,
      // 36-98 KB here) are read from memory once and stay in L2 for the later tiles, and a tile's
      // 4 input rows stay in L1. Every row tile per 4 features (the loop before) measured 1.3-1.6x
      // slower at 8-32 rows: its 8-32 input rows do not fit in L1.
      for (int64_t n0 = begin; n0 < end; n0 += INT8_CHUNK) {
        const int64_t n1 = std::min(end, n0 + INT8_CHUNK);
        for (int64_t m = 0; m < M; m += 4) {
          const int64_t rows = std::min<int64_t>(4, M - m);
          int8_features<4, WIDE_RN>(xp + m * K, rows, K, wp, sp, op + m * N, N, n0, n1);
        }
      }
    }
  });
  return out;
}

}  // namespace deepinfer

namespace {

// Whether this build has the int16-activation path (tests choose their reference by it).
bool int8_int16_products() {
#ifdef DEEPINFER_VNNI
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scales, bool int16_activations=False) -> Tensor");
  m.def("int8_int16_products() -> bool", &int8_int16_products);
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) { m.impl("int8_linear", &deepinfer::int8_linear); }
