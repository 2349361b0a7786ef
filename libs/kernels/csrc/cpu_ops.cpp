// CPU kernels for small-batch decode, built on first use by libs/kernels/cpu_ext.py.
//
// Decode at a few rows is bound by reading the weights (and, per layer, the KV) once per step;
// the torch ops it used cost either bandwidth (an fp32 GEMV reads 4 bytes a weight, and MKL's
// reaches about a third of this machine's read bandwidth) or fixed overhead (SDPA's CPU flash
// kernel spends ~250 us planning one query over a hundred keys). These kernels do the same
// arithmetic as their torch references (libs/kernels/int8_linear.py, paged_attention.py) in one
// pass over memory, accumulating in fp32. They know no model: shapes come from the tensors.
//
// Vector code is AVX2 + FMA where the compiler targets it (the extension is built with
// -march=native on the machine that runs it), with a plain loop beside it for other CPUs.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DEEPINFER_AVX2 1
#endif

namespace {

#ifdef DEEPINFER_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  // bf16 is the high half of an fp32: widen to 32 bits and shift into place.
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const int8_t* p) {
  __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// exp(x) for 8 floats, x <= 0 (softmax after subtracting the max): Cody-Waite range reduction
// x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for exp(r), then 2^n through the exponent
// bits. Relative error ~2e-7; inputs below -87 give exp(-87) ~ 1.6e-38 (nothing next to the max's 1).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.f), x);  // (max_ps returns its second operand for a NaN: kept)
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2n));
}
#endif

// s[0:n] = exp(s[0:n] - max); returns their sum.
inline float exp_shifted(float* s, int64_t n, float max) {
  int64_t i = 0;
  float sum = 0.f;
#ifdef DEEPINFER_AVX2
  __m256 acc = _mm256_setzero_ps();
  const __m256 m = _mm256_set1_ps(max);
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), m));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum(acc);
#endif
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - max);
    sum += s[i];
  }
  return sum;
}

template <typename A, typename B>
inline float dot(const A* a, const B* b, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#ifdef DEEPINFER_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(load8(a + i), load8(b + i), acc0);
    acc1 = _mm256_fmadd_ps(load8(a + i + 8), load8(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(load8(a + i), load8(b + i), acc0);
  sum = hsum(_mm256_add_ps(acc0, acc1));
#endif
  for (; i < n; ++i) sum += static_cast<float>(a[i]) * static_cast<float>(b[i]);
  return sum;
}

// acc[0:n] += w * x[0:n]
template <typename T>
inline void axpy(float* acc, float w, const T* x, int64_t n) {
  int64_t i = 0;
#ifdef DEEPINFER_AVX2
  __m256 wv = _mm256_set1_ps(w);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(wv, load8(x + i), _mm256_loadu_ps(acc + i)));
#endif
  for (; i < n; ++i) acc[i] += w * static_cast<float>(x[i]);
}

// ---------------------------------------------------------------------------------------------
// y[M, N] = x[M, K] @ (w[N, K] * scales[N, None])^T, w int8, x and scales fp32.
// Each thread takes a range of output features. Input rows go in tiles of up to TILE_M: per 8
// weights, one int8 -> fp32 conversion serves every row of the tile, whose accumulators stay in
// registers, and a weight row is read from memory once (later tiles find it in L1).
constexpr int64_t TILE_M = 8;

template <int64_t TM>
inline void int8_dot_tile(const float* x, int64_t K, const int8_t* w, float scale, float* out, int64_t N) {
  int64_t k = 0;
  float sums[TM] = {};
#ifdef DEEPINFER_AVX2
  __m256 acc[TM];
#pragma GCC unroll 8
  for (int64_t m = 0; m < TM; ++m) acc[m] = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    const __m256 wv = load8(w + k);
#pragma GCC unroll 8
    for (int64_t m = 0; m < TM; ++m) acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), acc[m]);
  }
#pragma GCC unroll 8
  for (int64_t m = 0; m < TM; ++m) sums[m] = hsum(acc[m]);
#endif
  for (; k < K; ++k) {
    for (int64_t m = 0; m < TM; ++m) sums[m] += static_cast<float>(w[k]) * x[m * K + k];
  }
  for (int64_t m = 0; m < TM; ++m) out[m * N] = sums[m] * scale;
}

template <int64_t TM>
inline void int8_rows(const float* x, int64_t K, const int8_t* w, float scale, float* out, int64_t N, int64_t M) {
  // M rows from x (and out): full tiles of TM, then the rest one size down.
  int64_t m = 0;
  for (; m + TM <= M; m += TM) int8_dot_tile<TM>(x + m * K, K, w, scale, out + m * N, N);
  if constexpr (TM > 1) {
    if (m < M) int8_rows<TM / 2>(x + m * K, K, w, scale, out + m * N, N, M - m);
  }
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
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
  // Each thread's slice of features stays contiguous; a product too small to pay for waking the
  // other threads (under ~256K weights) runs on one.
  const int64_t grain = N * K < (1 << 18) ? N : 16;
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    if (M == 1) {  // a matrix-vector product: two FMA chains over 16 weights a step measured fastest
      for (int64_t n = begin; n < end; ++n) op[n] = dot(xp, wp + n * K, K) * sp[n];
      return;
    }
    for (int64_t n = begin; n < end; ++n) int8_rows<TILE_M>(xp, K, wp + n * K, sp[n], op + n, N, M);
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// Attention of chosen query tokens over their rows' paged KV.
// out, q: [T, H, D]; k_cache, v_cache: [num_blocks, block_size, KVH, D]; block_tables:
// [R, max_blocks] int32; token_index, token_row, token_num_keys: [T'] int32 — which flat tokens
// to compute, the row each belongs to, and how many of the row's first keys it sees (causal:
// context + its offset + 1). Query head h reads KV head h / (H / KVH). Other tokens of out are
// left as they are.
constexpr int64_t MAX_GROUP = 64;

template <typename T>
void paged_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_tables, const at::Tensor& token_index, const at::Tensor& token_row,
                          const at::Tensor& token_num_keys, double scale) {
  const int64_t H = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t group = H / KVH;
  TORCH_CHECK(group <= MAX_GROUP, "paged_attention: at most ", MAX_GROUP, " query heads per KV head");
  const int64_t num_tokens = token_index.size(0), max_blocks = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* tok = token_index.data_ptr<int32_t>();
  const int32_t* rows = token_row.data_ptr<int32_t>();
  const int32_t* lens = token_num_keys.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);
  // Waking the other threads costs tens of microseconds: a step of a few short rows runs on one.
  int64_t total_keys = 0;
  for (int64_t i = 0; i < num_tokens; ++i) total_keys += lens[i];
  const int64_t grain = total_keys * group * D < (1 << 20) ? num_tokens * KVH : 1;
  at::parallel_for(0, num_tokens * KVH, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(group * D), query(group * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / KVH, kvh = item % KVH;
      const int64_t t = tok[i], n = lens[i];
      const int32_t* table = tables + static_cast<int64_t>(rows[i]) * max_blocks;
      scores.resize(group * n);
      for (int64_t g = 0; g < group * D; ++g) query[g] = static_cast<float>(qp[(t * H + kvh * group) * D + g]) * fscale;
      // Keys block by block: a block's rows are consecutive slots of one page.
      float maxes[MAX_GROUP], sums[MAX_GROUP];
      std::fill(maxes, maxes + group, -std::numeric_limits<float>::infinity());
      for (int64_t j0 = 0; j0 < n; j0 += block_size) {
        const T* key = kp + (static_cast<int64_t>(table[j0 / block_size]) * block_size * KVH + kvh) * D;
        for (int64_t j = j0; j < std::min(n, j0 + block_size); ++j, key += KVH * D) {
          for (int64_t g = 0; g < group; ++g) {
            const float s = dot(query.data() + g * D, key, D);
            scores[g * n + j] = s;
            maxes[g] = std::max(maxes[g], s);
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) sums[g] = exp_shifted(scores.data() + g * n, n, maxes[g]);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j0 = 0; j0 < n; j0 += block_size) {
        const T* value = vp + (static_cast<int64_t>(table[j0 / block_size]) * block_size * KVH + kvh) * D;
        for (int64_t j = j0; j < std::min(n, j0 + block_size); ++j, value += KVH * D) {
          for (int64_t g = 0; g < group; ++g) axpy(acc.data() + g * D, scores[g * n + j], value, D);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* dst = op + (t * H + kvh * group + g) * D;
        const float inv = 1.f / sums[g];
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[g * D + d] * inv);
      }
    }
  });
}

void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& token_index, const at::Tensor& token_row,
                     const at::Tensor& token_num_keys, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && out.sizes() == q.sizes(), "paged_attention: q [T, H, D], caches [B, S, KVH, D]");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention: contiguous tensors");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.size(3) == q.size(2) && k_cache.size(2) > 0 &&
                  q.size(1) % k_cache.size(2) == 0,
              "paged_attention: head shapes disagree");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
                  q.scalar_type() == out.scalar_type(),
              "paged_attention: one dtype");
  for (const at::Tensor* t : {&block_tables, &token_index, &token_row, &token_num_keys}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "paged_attention: int32 contiguous index tensors");
  }
  TORCH_CHECK(token_index.size(0) == token_row.size(0) && token_row.size(0) == token_num_keys.size(0),
              "paged_attention: one entry per token");
  // Out-of-range indices would read or write outside the tensors: checked once here, not per key.
  const int64_t num_rows = block_tables.size(0), max_keys = block_tables.size(1) * k_cache.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  for (int64_t i = 0; i < block_tables.numel(); ++i) {
    TORCH_CHECK(tables[i] >= 0 && tables[i] < k_cache.size(0), "paged_attention: block id out of range");
  }
  for (int64_t i = 0; i < token_index.size(0); ++i) {
    const int32_t t = token_index.data_ptr<int32_t>()[i], r = token_row.data_ptr<int32_t>()[i];
    const int32_t n = token_num_keys.data_ptr<int32_t>()[i];
    TORCH_CHECK(t >= 0 && t < q.size(0) && r >= 0 && r < num_rows && n >= 1 && n <= max_keys,
                "paged_attention: token, row or key count out of range");
  }
  if (q.scalar_type() == at::kFloat) {
    paged_attention_impl<float>(out, q, k_cache, v_cache, block_tables, token_index, token_row, token_num_keys, scale);
  } else if (q.scalar_type() == at::kBFloat16) {
    paged_attention_impl<c10::BFloat16>(out, q, k_cache, v_cache, block_tables, token_index, token_row, token_num_keys,
                                        scale);
  } else {
    TORCH_CHECK(false, "paged_attention: float32 or bfloat16");
  }
}

}  // namespace

TORCH_LIBRARY(deepinfer_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scales) -> Tensor");
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor token_index, Tensor token_row, Tensor token_num_keys, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("paged_attention", &paged_attention);
}
