// The decoder blocks of a step in one op: pre-norm grouped-query attention over paged KV and a
// SwiGLU MLP, int8 weights with fp32 activations (the block of Llama, Mistral and Qwen2 without
// biases). Built with the other CPU ops by libs/kernels/cpu_ext.py.
//
// A decode step at one row spends more time in the ~10 torch ops per layer around the weights
// (each a Python call, a dispatch and an allocation) than in the weights themselves. This op runs
// the same C++ functions those ops run (ops.h), in the same order, on the same tensors, so its
// result is the op-by-op forward's bit for bit; only the calls between them are gone. It takes
// steps whose every token the paged kernel attends (decodes, and short rows with context): a long
// prefill row needs SDPA, which stays on the op-by-op path.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>

#include "ops.h"

namespace {

using deepinfer::add_rms_norm;
using deepinfer::int8_linear;

// hidden: [T, E] fp32, the embeddings of the step's tokens; positions: [T] int64. Per layer l
// (every list holds one tensor per layer): the input and post-attention norms' weights [E]; the
// fused [q | k | v] projection's int8 weight [(H + 2 KVH) * D, E] and fp32 scales; o [E, H * D];
// the fused [gate | up] projection [2 F, E]; down [E, F] (int16 activations where the product
// takes them, as Int8Linear's layers do); the layer's KV pages
// [num_blocks, block_size, KVH, D]. The attention arguments are paged_attention's and write_kv's,
// and cover every token. Returns norm(last block's output + residual), [T, E].
at::Tensor decoder_blocks(const at::Tensor& hidden, const at::Tensor& positions, at::TensorList input_norm,
                          at::TensorList qkv_weight, at::TensorList qkv_scales, at::TensorList o_weight,
                          at::TensorList o_scales, at::TensorList post_norm, at::TensorList gate_up_weight,
                          at::TensorList gate_up_scales, at::TensorList down_weight, at::TensorList down_scales,
                          const at::Tensor& final_norm, double eps, const at::Tensor& cos_sin_cache,
                          at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slot_mapping,
                          const at::Tensor& block_tables, const at::Tensor& token_index, const at::Tensor& token_row,
                          const at::Tensor& token_num_keys, double scale, int64_t num_heads, int64_t num_kv_heads) {
  const size_t L = input_norm.size();
  TORCH_CHECK(L >= 1, "decoder_blocks: at least one layer");
  for (at::TensorList list : {qkv_weight, qkv_scales, o_weight, o_scales, post_norm, gate_up_weight, gate_up_scales,
                              down_weight, down_scales, k_caches, v_caches}) {
    TORCH_CHECK(list.size() == L, "decoder_blocks: one tensor per layer in every list");
  }
  TORCH_CHECK(hidden.dim() == 2 && token_index.numel() == hidden.size(0),
              "decoder_blocks: hidden is [T, E] and the kernel attends every token");
  const int64_t T = hidden.size(0), D = cos_sin_cache.size(1);
  const int64_t q_size = num_heads * D, kv_size = num_kv_heads * D;
  at::Tensor x, residual, normed;
  for (size_t l = 0; l < L; ++l) {
    if (l == 0) {
      residual = hidden;
      normed = deepinfer::rms_norm(hidden, input_norm[0], eps);
    } else {
      std::tie(normed, residual) = add_rms_norm(x, residual, input_norm[l], eps);
    }
    const at::Tensor qkv = int8_linear(normed, qkv_weight[l], qkv_scales[l], true);  // [T, q_size + 2 kv_size]
    TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "decoder_blocks: qkv width is not (H + 2 KVH) * D");
    at::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, D});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads, D});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, D});
    std::tie(q, k) = deepinfer::rotary_qk(q, k, positions, cos_sin_cache);
    deepinfer::write_kv(k, v, k_caches[l], v_caches[l], slot_mapping);
    at::Tensor attended = at::empty({T, num_heads, D}, q.options());
    deepinfer::paged_attention(attended, q, k_caches[l], v_caches[l], block_tables, token_index, token_row,
                               token_num_keys, scale);
    x = int8_linear(attended.view({T, q_size}), o_weight[l], o_scales[l], true);
    std::tie(normed, residual) = add_rms_norm(x, residual, post_norm[l], eps);
    const at::Tensor gate_up = int8_linear(normed, gate_up_weight[l], gate_up_scales[l], true);  // [T, 2 F]
    x = int8_linear(deepinfer::silu_mul(gate_up), down_weight[l], down_scales[l], true);
  }
  return std::get<0>(add_rms_norm(x, residual, final_norm, eps));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) {
  m.def(
      "decoder_blocks(Tensor hidden, Tensor positions, Tensor[] input_norm, Tensor[] qkv_weight, "
      "Tensor[] qkv_scales, Tensor[] o_weight, Tensor[] o_scales, Tensor[] post_norm, Tensor[] gate_up_weight, "
      "Tensor[] gate_up_scales, Tensor[] down_weight, Tensor[] down_scales, Tensor final_norm, float eps, "
      "Tensor cos_sin_cache, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slot_mapping, "
      "Tensor block_tables, Tensor token_index, Tensor token_row, Tensor token_num_keys, float scale, "
      "int num_heads, int num_kv_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) { m.impl("decoder_blocks", &decoder_blocks); }
