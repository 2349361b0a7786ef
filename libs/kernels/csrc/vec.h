// Vector helpers shared by the CPU kernels (cpu_ops.cpp, cpu_pointwise.cpp): loads that widen to
// fp32, a horizontal sum, a vector exp, dot and axpy. AVX2 + FMA where the compiler targets it (the
// extension is built with -march=native on the machine that runs it), AVX-512 before it where
// that is there too (16 lanes: an int8 weight is converted and multiplied in half the
// instructions), and a plain loop after them for the tail.
#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DEEPINFER_AVX2 1
#endif
#if defined(DEEPINFER_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__)
#define DEEPINFER_AVX512 1
#endif

namespace deepinfer {

using BF16 = c10::BFloat16;


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
#ifdef DEEPINFER_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const int8_t* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
}
// out[k] = the sum of a[k]'s 16 lanes, for 16 vectors, by halving widths pairwise: ~3
// instructions a vector where 16 reduce_add_ps take 8 each.
inline __m512 reduce16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i) {  // 512 -> 256 bits: halves [a_2i, a_2i+1]
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // 256 -> 128 bits: 128-bit lane L holds a_4i+L
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {  // 128 -> 64 bits
    d[i] = _mm512_add_ps(_mm512_unpacklo_ps(c[2 * i], c[2 * i + 1]), _mm512_unpackhi_ps(c[2 * i], c[2 * i + 1]));
  }
  const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(d[0]), _mm512_castps_pd(d[1]));
  const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(d[0]), _mm512_castps_pd(d[1]));
  const __m512 e = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));  // lane 4L + m: a_4m+L
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), e);
}
#endif
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

// a * b + c, as one fused multiply-add where the CPU has one: what the compiler contracts a * b + c
// to may differ between loops, so the tails below say it (dot2 gives dot's bits). Without FMA
// (no AVX2 build) std::fma would be a slow library call, and nothing is contracted anyway.
inline float fmadd(float a, float b, float c) {
#ifdef __FMA__
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

template <typename A, typename B>
inline float dot(const A* a, const B* b, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#ifdef DEEPINFER_AVX512
  __m512 z0 = _mm512_setzero_ps(), z1 = _mm512_setzero_ps();
  for (; i + 32 <= n; i += 32) {
    z0 = _mm512_fmadd_ps(load16(a + i), load16(b + i), z0);
    z1 = _mm512_fmadd_ps(load16(a + i + 16), load16(b + i + 16), z1);
  }
  for (; i + 16 <= n; i += 16) z0 = _mm512_fmadd_ps(load16(a + i), load16(b + i), z0);
  sum = _mm512_reduce_add_ps(_mm512_add_ps(z0, z1));
#endif
#ifdef DEEPINFER_AVX2
  if (i + 8 <= n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
      acc0 = _mm256_fmadd_ps(load8(a + i), load8(b + i), acc0);
      acc1 = _mm256_fmadd_ps(load8(a + i + 8), load8(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(load8(a + i), load8(b + i), acc0);
    sum += hsum(_mm256_add_ps(acc0, acc1));
  }
#endif
  for (; i < n; ++i) sum = fmadd(static_cast<float>(a[i]), static_cast<float>(b[i]), sum);
  return sum;
}

// *out0 = dot(a, b0, n) and *out1 = dot(a, b1, n), bit for bit, in one pass that shares each load
// of a: two rows b0, b1 from far-apart places are two memory streams, which a core's prefetchers
// fetch faster together than one after the other.
template <typename A, typename B>
inline void dot2(const A* a, const B* b0, const B* b1, int64_t n, float* out0, float* out1) {
  int64_t i = 0;
  float sum0 = 0.f, sum1 = 0.f;
#ifdef DEEPINFER_AVX512
  __m512 z0 = _mm512_setzero_ps(), z1 = _mm512_setzero_ps(), y0 = _mm512_setzero_ps(), y1 = _mm512_setzero_ps();
  for (; i + 32 <= n; i += 32) {
    const __m512 lo = load16(a + i), hi = load16(a + i + 16);
    z0 = _mm512_fmadd_ps(lo, load16(b0 + i), z0);
    z1 = _mm512_fmadd_ps(hi, load16(b0 + i + 16), z1);
    y0 = _mm512_fmadd_ps(lo, load16(b1 + i), y0);
    y1 = _mm512_fmadd_ps(hi, load16(b1 + i + 16), y1);
  }
  for (; i + 16 <= n; i += 16) {
    const __m512 lo = load16(a + i);
    z0 = _mm512_fmadd_ps(lo, load16(b0 + i), z0);
    y0 = _mm512_fmadd_ps(lo, load16(b1 + i), y0);
  }
  sum0 = _mm512_reduce_add_ps(_mm512_add_ps(z0, z1));
  sum1 = _mm512_reduce_add_ps(_mm512_add_ps(y0, y1));
#endif
#ifdef DEEPINFER_AVX2
  if (i + 8 <= n) {
    __m256 z0 = _mm256_setzero_ps(), z1 = _mm256_setzero_ps(), y0 = _mm256_setzero_ps(), y1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
      const __m256 lo = load8(a + i), hi = load8(a + i + 8);
      z0 = _mm256_fmadd_ps(lo, load8(b0 + i), z0);
      z1 = _mm256_fmadd_ps(hi, load8(b0 + i + 8), z1);
      y0 = _mm256_fmadd_ps(lo, load8(b1 + i), y0);
      y1 = _mm256_fmadd_ps(hi, load8(b1 + i + 8), y1);
    }
    for (; i + 8 <= n; i += 8) {
      const __m256 lo = load8(a + i);
      z0 = _mm256_fmadd_ps(lo, load8(b0 + i), z0);
      y0 = _mm256_fmadd_ps(lo, load8(b1 + i), y0);
    }
    sum0 += hsum(_mm256_add_ps(z0, z1));
    sum1 += hsum(_mm256_add_ps(y0, y1));
  }
#endif
  for (; i < n; ++i) {
    sum0 = fmadd(static_cast<float>(a[i]), static_cast<float>(b0[i]), sum0);
    sum1 = fmadd(static_cast<float>(a[i]), static_cast<float>(b1[i]), sum1);
  }
  *out0 = sum0;
  *out1 = sum1;
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

}  // namespace deepinfer
