// CPU kernels for small-batch decode, built on first use by libs/kernels/cpu_ext.py: paged
// attention and KV writes (the int8 products are in cpu_int8.cpp).
//
// Decode at a few rows is bound by reading the weights (and, per layer, the KV) once per step;
// the torch ops it used cost either bandwidth or fixed overhead (SDPA's CPU flash kernel spends
// ~250 us planning one query over a hundred keys). These kernels do the same arithmetic as their
// torch reference (libs/kernels/paged_attention.py) in one pass over memory, accumulating in
// fp32. They know no model: shapes come from the tensors.
//
// Vector code is AVX2 + FMA where the compiler targets it (vec.h), with a plain loop beside it.

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "ops.h"
#include "pool.h"
#include "vec.h"

namespace {

using namespace deepinfer;

// ---------------------------------------------------------------------------------------------
// Attention of chosen query tokens over their rows' paged KV.
// out, q: [T, H, D]; k_cache, v_cache: [num_blocks, block_size, KVH, D]; block_tables:
// [R, max_blocks] int32; token_index, token_row, token_num_keys: [T'] int32 — which flat tokens
// to compute, the row each belongs to, and how many of the row's first keys it sees (causal:
// context + its offset + 1). Query head h reads KV head h / (H / KVH). Other tokens of out are
// left as they are.
constexpr int64_t MAX_GROUP = 64;

// One (query token, KV head) item: the `group` query heads of KV head kvh over the row's first
// n keys, read from the pages through the row's block table.
struct Item {
  const float* query;  // [group, D], scaled
  const int32_t* table;
  int64_t n, kvh;
};

// The caches [num_blocks, block_size, KVH, D] and where key / value j of a row starts.
template <typename T>
struct Pages {
  const T* k;
  const T* v;
  int64_t block_size, KVH, D;
  const T* key(const int32_t* table, int64_t j) const { return k + offset(table, j); }
  const T* value(const int32_t* table, int64_t j) const { return v + offset(table, j); }
  int64_t offset(const int32_t* table, int64_t j) const {
    return ((static_cast<int64_t>(table[j / block_size]) * block_size + j % block_size) * KVH) * D;
  }
};

// scores[g * n + j] = q_g . key_j; returns through maxes[g] the largest of each head's scores.
template <typename T>
void item_scores(const Item& it, const Pages<T>& pages, int64_t group, float* scores, float* maxes) {
  const int64_t D = pages.D, n = it.n, head = it.kvh * D;
  for (int64_t g = 0; g < group; ++g) maxes[g] = -std::numeric_limits<float>::infinity();
  int64_t j0 = 0;
#ifdef DEEPINFER_AVX512
  // Sixteen keys at a time: their dot products' lanes summed by one transposing reduction.
  if (D % 16 == 0 && D <= 256) {
    const T* keys[16];
    for (; j0 + 16 <= n; j0 += 16) {
      for (int kk = 0; kk < 16; ++kk) keys[kk] = pages.key(it.table, j0 + kk) + head;
      for (int64_t g = 0; g < group; ++g) {
        const float* q = it.query + g * D;
        __m512 acc[16];
        for (int kk = 0; kk < 16; ++kk) acc[kk] = _mm512_mul_ps(_mm512_loadu_ps(q), load16(keys[kk]));
        for (int64_t d = 16; d < D; d += 16) {
          const __m512 qv = _mm512_loadu_ps(q + d);
#pragma GCC unroll 16
          for (int kk = 0; kk < 16; ++kk) acc[kk] = _mm512_fmadd_ps(qv, load16(keys[kk] + d), acc[kk]);
        }
        const __m512 r = reduce16(acc);
        _mm512_storeu_ps(scores + g * n + j0, r);
        maxes[g] = std::max(maxes[g], _mm512_reduce_max_ps(r));
      }
    }
  }
#endif
  for (int64_t j = j0; j < n; ++j) {
    const T* key = pages.key(it.table, j) + head;
    for (int64_t g = 0; g < group; ++g) {
      const float s = dot(it.query + g * D, key, D);
      scores[g * n + j] = s;
      maxes[g] = std::max(maxes[g], s);
    }
  }
}

#ifdef DEEPINFER_AVX512
// acc[g * D:(g + 1) * D] = sum_j p[g * n + j] * value_j for query heads g0 .. g0 + HB - 1, with
// D = 16 C: each value is read once for the HB heads, whose HB * C sums stay in registers (a
// sum's order over j is the one-head loop's, so its bits are too).
template <typename T, int C, int HB>
inline void head_block_values(const Item& it, const Pages<T>& pages, const float* p, int64_t g0, float* acc) {
  const int64_t n = it.n, head = it.kvh * pages.D;
  __m512 sum[HB][C];
#pragma GCC unroll 4
  for (int h = 0; h < HB; ++h)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) sum[h][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const T* value = pages.value(it.table, j) + head;
    __m512 v[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) v[c] = load16(value + 16 * c);
#pragma GCC unroll 4
    for (int h = 0; h < HB; ++h) {
      const __m512 w = _mm512_set1_ps(p[(g0 + h) * n + j]);
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) sum[h][c] = _mm512_fmadd_ps(w, v[c], sum[h][c]);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < HB; ++h)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + (g0 + h) * 16 * C + 16 * c, sum[h][c]);
}

// Every head of the group, as many at a time as fit 16 sums: 2-4x the FMA chains of one head,
// whose 4 chains at D = 64 waited on the FMA latency, and sums a compile-time count keeps in
// registers. 1.14-1.33x less time a call (bench/kernels.py, "paged: SDPA vs kernel").
template <typename T, int C>
void group_values(const Item& it, const Pages<T>& pages, int64_t group, const float* p, float* acc) {
  constexpr int HB = C <= 4 ? 4 : (C <= 8 ? 2 : 1);
  int64_t g = 0;
  for (; g + HB <= group; g += HB) head_block_values<T, C, HB>(it, pages, p, g, acc);
  for (; g < group; ++g) head_block_values<T, C, 1>(it, pages, p, g, acc);
}
#endif

// out_g = sum_j p[g * n + j] * value_j / sums[g], for each query head g, as T.
template <typename T>
void item_values(const Item& it, const Pages<T>& pages, int64_t group, const float* p, const float* sums,
                 float* acc, T* out) {
  const int64_t D = pages.D, n = it.n, head = it.kvh * D;
#ifdef DEEPINFER_AVX512
  if (D == 64 || D == 128 || D == 256) {
    if (D == 64) group_values<T, 4>(it, pages, group, p, acc);
    if (D == 128) group_values<T, 8>(it, pages, group, p, acc);
    if (D == 256) group_values<T, 16>(it, pages, group, p, acc);
  } else if (D % 16 == 0 && D <= 256) {  // each head's sum in registers across the keys
    for (int64_t g = 0; g < group; ++g) {
      __m512 sum[16];
      const int64_t chunks = D / 16;
      for (int64_t c = 0; c < chunks; ++c) sum[c] = _mm512_setzero_ps();
      for (int64_t j = 0; j < n; ++j) {
        const T* value = pages.value(it.table, j) + head;
        const __m512 w = _mm512_set1_ps(p[g * n + j]);
        for (int64_t c = 0; c < chunks; ++c) sum[c] = _mm512_fmadd_ps(w, load16(value + 16 * c), sum[c]);
      }
      for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(acc + g * D + 16 * c, sum[c]);
    }
  } else
#endif
  {
    std::fill(acc, acc + group * D, 0.f);
    for (int64_t j = 0; j < n; ++j) {
      const T* value = pages.value(it.table, j) + head;
      for (int64_t g = 0; g < group; ++g) axpy(acc + g * D, p[g * n + j], value, D);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.f / sums[g];
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<T>(acc[g * D + d] * inv);
  }
}

template <typename T>
void paged_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_tables, const at::Tensor& token_index, const at::Tensor& token_row,
                          const at::Tensor& token_num_keys, double scale) {
  const int64_t H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(2);
  const int64_t group = H / KVH;
  TORCH_CHECK(group <= MAX_GROUP, "paged_attention: at most ", MAX_GROUP, " query heads per KV head");
  const int64_t num_tokens = token_index.size(0), max_blocks = block_tables.size(1);
  const Pages<T> pages{k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), k_cache.size(1), KVH, D};
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* tok = token_index.data_ptr<int32_t>();
  const int32_t* rows = token_row.data_ptr<int32_t>();
  const int32_t* lens = token_num_keys.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);
  // Waking the other threads costs tens of microseconds: a step of a few short rows runs on one.
  int64_t total_keys = 0;
  for (int64_t i = 0; i < num_tokens; ++i) total_keys += lens[i];
  const int64_t grain = total_keys * group * D < (1 << 16) ? num_tokens * KVH : 1;
  deepinfer::parallel_for(0, num_tokens * KVH, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(group * D), query(group * D);
    float maxes[MAX_GROUP], sums[MAX_GROUP];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / KVH, kvh = item % KVH;
      const int64_t t = tok[i], n = lens[i];
      const Item it{query.data(), tables + static_cast<int64_t>(rows[i]) * max_blocks, n, kvh};
      scores.resize(group * n);
      for (int64_t g = 0; g < group * D; ++g) query[g] = static_cast<float>(qp[(t * H + kvh * group) * D + g]) * fscale;
      item_scores(it, pages, group, scores.data(), maxes);
      for (int64_t g = 0; g < group; ++g) sums[g] = exp_shifted(scores.data() + g * n, n, maxes[g]);
      item_values(it, pages, group, scores.data(), sums, acc.data(), op + (t * H + kvh * group) * D);
    }
  });
}

}  // namespace

namespace deepinfer {

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

// k_cache[slot] = k[t], v_cache[slot] = v[t] for slot = slot_mapping[t]: a step's new keys and
// values into their pages. k, v: [T, KVH, D] (rows may be strided, as views into a fused qkv
// output are); caches: [num_blocks, block_size, KVH, D]; slot_mapping: [T] int64.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3),
              "write_kv: k, v [T, KVH, D] and caches [B, S, KVH, D] disagree");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "write_kv: contiguous caches");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "write_kv: one dtype");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0) && slot_mapping.scalar_type() == at::kLong,
              "write_kv: slot_mapping is int64 [T]");
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1), width = k.size(1) * k.size(2);
  for (int64_t t = 0; t < slots.size(0); ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "write_kv: slot out of range");
  // A token's KVH x D values are dense in the caches; in k and v they are when the head stride is D.
  const at::Tensor kd = k.stride(2) == 1 && k.stride(1) == k.size(2) ? k : k.contiguous();
  const at::Tensor vd = v.stride(2) == 1 && v.stride(1) == v.size(2) ? v : v.contiguous();
  const int64_t bytes = width * static_cast<int64_t>(k.element_size());
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* kp = static_cast<const char*>(kd.data_ptr());
  const auto* vp = static_cast<const char*>(vd.data_ptr());
  const int64_t k_row = kd.stride(0) * kd.element_size(), v_row = vd.stride(0) * vd.element_size();
  for (int64_t t = 0; t < slots.size(0); ++t) {
    std::memcpy(kc + sp[t] * bytes, kp + t * k_row, bytes);
    std::memcpy(vc + sp[t] * bytes, vp + t * v_row, bytes);
  }
}

}  // namespace deepinfer

TORCH_LIBRARY(deepinfer_cpu, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor token_index, Tensor token_row, Tensor token_num_keys, float scale) -> ()");
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) {
  m.impl("paged_attention", &deepinfer::paged_attention);
  m.impl("write_kv", &deepinfer::write_kv);
}
