// The CPU ops as C++ functions, for kernels that compose them (cpu_block.cpp) without a trip
// through the dispatcher. Each is registered as torch.ops.deepinfer_cpu.<name> beside its
// definition; shapes, dtypes and checks are documented there.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace deepinfer {

// cpu_int8.cpp
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                       bool int16_activations);

// cpu_ops.cpp
void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& token_index, const at::Tensor& token_row,
                     const at::Tensor& token_num_keys, double scale);
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping);

// cpu_invariant.cpp
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight);

// cpu_pointwise.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> rotary_qk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
                                             const at::Tensor& cos_sin_cache);
at::Tensor silu_mul(const at::Tensor& x);

}  // namespace deepinfer
