// The extension's entry points, bound to Python in bindings.cpp (kvflow/model/cpu_kernels.py
// documents each one's contract). Every one checks its arguments and raises (TORCH_CHECK) on
// shapes, dtypes or layouts it does not handle.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

// elementwise.cpp: the layer's fused elementwise passes, in float32, bf16 or fp16.
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps);
at::Tensor add_rms_norm(at::Tensor x, at::Tensor res, at::Tensor w, double eps);
at::Tensor silu_mul(at::Tensor gu);
void rope_write(at::Tensor qkv, at::Tensor cos, at::Tensor sin, int64_t H, int64_t KVH,
                std::optional<at::Tensor> cache, std::optional<at::Tensor> slots);

// skinny_linear.cpp: a projection of a few rows, each weight row read once.
at::Tensor skinny_linear(at::Tensor x, at::Tensor w);

// decode_attention.cpp: one query token per sequence over its paged KV.
at::Tensor paged_decode(at::Tensor q, at::Tensor kv, at::Tensor table, at::Tensor ctx, double scale);
int64_t vec_size();  // float32 lanes of a vector: head dims are a multiple of it

// prefill_attention.cpp: causal attention of prompt chunks over the paged KV.
at::Tensor paged_prefill(at::Tensor q, at::Tensor kv, at::Tensor table, at::Tensor q_start, at::Tensor q_len,
                         at::Tensor ctx, double scale);
int64_t prefill_max_group();  // the most query heads per KV head paged_prefill takes
// decode rows as one-token prompt chunks: bitwise what paged_prefill computes for the same token
at::Tensor paged_decode_invariant(at::Tensor q, at::Tensor kv, at::Tensor table, at::Tensor ctx, double scale);

// prefill_amx.cpp: the same contract as paged_prefill on AMX tiles, bf16, not batch-invariant (fast path);
// into `out` where given (its rows outside the sequences kept).
at::Tensor paged_prefill_amx(at::Tensor q, at::Tensor kv, at::Tensor table, at::Tensor q_start, at::Tensor q_len,
                             at::Tensor ctx, double scale, std::optional<at::Tensor> out);
bool prefill_amx_usable();  // built with AMX, and the OS lets this process use it

// decode_layers.cpp: a decode step's whole layer loop.
std::vector<at::Tensor> decode_layers(at::Tensor x, std::vector<at::Tensor> in_norm, std::vector<at::Tensor> post_norm,
    std::vector<at::Tensor> w, std::vector<at::Tensor> packed, int64_t path, std::vector<at::Tensor> kv,
    at::Tensor cos, at::Tensor sin, at::Tensor slots, at::Tensor table, at::Tensor ctx,
    double eps, double scale, int64_t H, int64_t KVH, bool invariant);

// invariant_linear.cpp: a projection whose every output element is one fixed chain over k, for any
// number of rows (the weight packed by kvflow/model/linear.py for the ISA invariant_linear_isa names).
at::Tensor invariant_linear(at::Tensor x, at::Tensor packed, int64_t N);
std::string invariant_linear_isa(std::string dtype);  // "amx-bf16", "avx512-bf16" or "fma"
