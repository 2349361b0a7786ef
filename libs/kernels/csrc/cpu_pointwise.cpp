// Row-wise CPU kernels around the projections of a decode step: RMSNorm (plain and after the
// residual add), the interleaved rotary rotation of q and k, and silu(gate) * up. Built with
// cpu_ops.cpp by libs/kernels/cpu_ext.py.
//
// At a few tokens a step these are not bound by arithmetic but by the number of torch ops: the
// references (libs/kernels/rms_norm.py, rotary.py, activation.py) take 5-10 ops each, each a
// dispatch, an allocation and a pass over memory, ~60-90 us a layer at one token. Each kernel
// here is one op and one pass, in fp32. Every row is computed alone, in a fixed order, so a row's
// result does not depend on the rows beside it (batch-invariant).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "ops.h"
#include "pool.h"
#include "vec.h"

namespace {

using namespace deepinfer;

// Rows per thread task: a step of a few tokens runs on one thread (waking the others costs more).
inline int64_t row_grain(int64_t row_len) { return std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(row_len, 1)); }

// x [..., H] float32 as rows: x itself where each row is dense (any row stride for [T, H]), else a
// contiguous copy. Callers pass views as they come; the copy is rare and made here, not in Python.
struct Rows {
  at::Tensor t;
  int64_t num_rows, len, stride;
};

Rows rows_of(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat, name, ": float32 [..., H]");
  const bool dense = x.stride(-1) == 1 && (x.dim() <= 2 || x.is_contiguous());
  at::Tensor t = dense ? x : x.contiguous();
  const int64_t len = t.size(-1);
  return {t, len ? t.numel() / len : 0, len, t.dim() == 2 ? t.stride(0) : len};
}

// sum(x^2) over a row.
inline float sum_squares(const float* x, int64_t n) { return dot(x, x, n); }

// out = x * rsqrt(mean(x^2) + eps) * weight, over one row of n.
inline void norm_row(const float* x, const float* weight, float eps, float* out, int64_t n) {
  const float inv = 1.f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
  int64_t i = 0;
#ifdef DEEPINFER_AVX2
  const __m256 iv = _mm256_set1_ps(inv);
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), iv), _mm256_loadu_ps(weight + i)));
  }
#endif
  for (; i < n; ++i) out[i] = x[i] * inv * weight[i];
}

// weight as a float32 [H] vector, contiguous (a copy only where it is not).
at::Tensor weight_of(const at::Tensor& weight, int64_t len, const char* name) {
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == len && weight.scalar_type() == at::kFloat, name,
              ": weight is float32 [H]");
  return weight.contiguous();
}

}  // namespace

namespace deepinfer {

// x [..., H], weight [H] -> x's shape: each row divided by its root mean square, times weight.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const Rows in = rows_of(x, "rms_norm");
  const at::Tensor w = weight_of(weight, in.len, "rms_norm");
  const int64_t H = in.len;
  at::Tensor out = at::empty(x.sizes(), x.options());
  const float* xp = in.t.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  deepinfer::parallel_for(0, in.num_rows, row_grain(H), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) norm_row(xp + t * in.stride, wp, static_cast<float>(eps), op + t * H, H);
  });
  return out;
}

// (norm(x + residual), x + residual): the pre-norm step between two sub-layers; inputs unchanged.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(residual.sizes() == x.sizes(), "add_rms_norm: x and residual differ in shape");
  const Rows a = rows_of(x, "add_rms_norm"), b = rows_of(residual, "add_rms_norm");
  const at::Tensor w = weight_of(weight, a.len, "add_rms_norm");
  const int64_t H = a.len;
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor sum = at::empty(x.sizes(), x.options());
  const float* xp = a.t.data_ptr<float>();
  const float* rp = b.t.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  deepinfer::parallel_for(0, a.num_rows, row_grain(H), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = xp + t * a.stride;
      const float* rr = rp + t * b.stride;
      float* s = sp + t * H;
      for (int64_t i = 0; i < H; ++i) s[i] = xr[i] + rr[i];
      norm_row(s, wp, static_cast<float>(eps), op + t * H, H);
    }
  });
  return {out, sum};
}

}  // namespace deepinfer

namespace {

// Rotates the pairs (x[2i], x[2i+1]) of each head of token t by the angle of positions[t]:
// cos = cache[p, i], sin = cache[p, D/2 + i]. x [T, heads, D] (any strides, D dense) -> new
// contiguous [T, heads, D].
at::Tensor rotate(const at::Tensor& x, const int64_t* positions, const float* cache) {
  const int64_t T = x.size(0), heads = x.size(1), D = x.size(2), half = D / 2;
  at::Tensor out = at::empty({T, heads, D}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  deepinfer::parallel_for(0, T, row_grain(heads * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = cache + positions[t] * D;
      const float* sin = cos + half;
      for (int64_t h = 0; h < heads; ++h) {
        const float* src = xp + t * x.stride(0) + h * x.stride(1);
        float* dst = op + (t * heads + h) * D;
        for (int64_t i = 0; i < half; ++i) {
          const float even = src[2 * i], odd = src[2 * i + 1];
          dst[2 * i] = even * cos[i] - odd * sin[i];
          dst[2 * i + 1] = even * sin[i] + odd * cos[i];
        }
      }
    }
  });
  return out;
}

}  // namespace

namespace deepinfer {

// q [T, Hq, D], k [T, Hk, D] (views into a fused qkv output as they come), positions [T] int64,
// cos_sin_cache [max_positions, D] -> (rotated q, rotated k), new and contiguous.
std::tuple<at::Tensor, at::Tensor> rotary_qk(const at::Tensor& q_in, const at::Tensor& k_in,
                                             const at::Tensor& positions_in, const at::Tensor& cos_sin_cache) {
  for (const at::Tensor* x : {&q_in, &k_in}) {
    TORCH_CHECK(x->dim() == 3 && x->scalar_type() == at::kFloat, "rotary_qk: q and k are float32 [T, heads, D]");
  }
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const at::Tensor k = k_in.stride(2) == 1 ? k_in : k_in.contiguous();
  const at::Tensor positions = positions_in.contiguous();
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(2) % 2 == 0, "rotary_qk: q and k disagree");
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.size(1) == q.size(2) &&
                  cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.is_contiguous(),
              "rotary_qk: cos_sin_cache is float32 [max_positions, D]");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == q.size(0) && positions.scalar_type() == at::kLong,
              "rotary_qk: positions are int64 [T]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t num_positions = cos_sin_cache.size(0);
  for (int64_t t = 0; t < positions.size(0); ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < num_positions, "rotary_qk: position ", pos[t], " outside the cache");
  }
  const float* cache = cos_sin_cache.data_ptr<float>();
  return {rotate(q, pos, cache), rotate(k, pos, cache)};
}

}  // namespace deepinfer

namespace {

// silu(x) = x / (1 + exp(-x)) for 8 floats; exp's argument is capped where fp32 still holds it
// (x < -88 gives x / huge = -0, silu's limit).
#ifdef DEEPINFER_AVX2
inline __m256 silu8(__m256 x) {
  const __m256 e = exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), x), _mm256_set1_ps(88.f)));
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e));
}
#endif

}  // namespace

namespace deepinfer {

// x [..., 2F] (gate then up) -> [..., F]: silu(gate) * up.
at::Tensor silu_mul(const at::Tensor& x) {
  const Rows in = rows_of(x, "silu_mul");
  TORCH_CHECK(in.len % 2 == 0, "silu_mul: an even row");
  const int64_t F = in.len / 2;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = F;
  at::Tensor out = at::empty(shape, x.options());
  const float* xp = in.t.data_ptr<float>();
  float* op = out.data_ptr<float>();
  deepinfer::parallel_for(0, in.num_rows, row_grain(F), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* gate = xp + t * in.stride;
      const float* up = gate + F;
      float* dst = op + t * F;
      int64_t i = 0;
#ifdef DEEPINFER_AVX2
      for (; i + 8 <= F; i += 8) {
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(silu8(_mm256_loadu_ps(gate + i)), _mm256_loadu_ps(up + i)));
      }
#endif
      for (; i < F; ++i) dst[i] = gate[i] / (1.f + std::exp(std::min(-gate[i], 88.f))) * up[i];
    }
  });
  return out;
}

}  // namespace deepinfer

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary_qk(Tensor q, Tensor k, Tensor positions, Tensor cos_sin_cache) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) {
  m.impl("rms_norm", &deepinfer::rms_norm);
  m.impl("add_rms_norm", &deepinfer::add_rms_norm);
  m.impl("rotary_qk", &deepinfer::rotary_qk);
  m.impl("silu_mul", &deepinfer::silu_mul);
}
