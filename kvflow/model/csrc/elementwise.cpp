// The layer's elementwise passes: RMSNorm (alone, or after the residual add), SiLU(gate) * up, and
// RoPE with the new K/V rows written into the paged cache. Vectorised in every dtype: bf16/fp16
// values are widened to float32 and rounded back to the dtype where the PyTorch formula they
// replace stores a tensor, so each pass equals its formula.
#include "kernel_utils.h"

#include <cmath>
#include <cstring>
#include <vector>

// Rows are split over threads only when a call has at least kGrain elements: below that a parallel
// region (fork, barrier) costs more than the pass itself, so small decode batches stay on the
// calling thread (at::parallel_for runs inline when end - begin < grain).
constexpr int64_t kGrain = 32768;

static int64_t row_grain(int64_t width) { return std::max<int64_t>(1, kGrain / std::max<int64_t>(1, width)); }

// out[r] = w * T(x[r] * rsqrt(mean(x[r]^2) + eps)) (transformers' LlamaRMSNorm order); with `res`,
// x[r] += res[r] first (rounded to T, stored back in x) and the norm reads the sum.
template <typename T>
static void rms_norm_kernel(T* x, const T* res, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  constexpr int64_t V = Vec::size();
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(n);
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * n;
      float* b = buf.data();
      Vec acc(0.f);
      int64_t i = 0;
      for (; i + V <= n; i += V) {
        Vec v = load_f32<T>(xr + i);
        if (res) {  // the residual stream is stored in T: the norm reads the rounded sum
          v = round_t<T>(v + load_f32<T>(res + r * n + i));
          store_t<T>(xr + i, v);
        }
        v.store(b + i);
        acc = at::vec::fmadd(v, v, acc);
      }
      float ss = at::vec::vec_reduce_all<float>([](Vec& a, Vec& c) { return a + c; }, acc);
      for (; i < n; ++i) {
        float v = static_cast<float>(xr[i]);
        if (res) { xr[i] = to_t<T>(v + static_cast<float>(res[r * n + i])); v = static_cast<float>(xr[i]); }
        b[i] = v;
        ss += v * v;
      }
      const float rstd = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
      T* o = out + r * n;
      i = 0;  // bf16/fp16: the normalised row is rounded to T before the weight multiplies
      for (; i + V <= n; i += V) store_t<T>(o + i, round_t<T>(Vec::loadu(b + i) * Vec(rstd)) * load_f32<T>(w + i));
      for (; i < n; ++i) o[i] = to_t<T>(static_cast<float>(w[i]) * static_cast<float>(to_t<T>(b[i] * rstd)));
    }
  });
}

// out[r] = silu(gu[r, :n]) * gu[r, n:] (the fused gate_up projection's output, [rows, 2n] -> [rows, n]).
template <typename T>
static void silu_mul_kernel(const T* gu, T* out, int64_t rows, int64_t n) {
  constexpr int64_t V = Vec::size();
  at::parallel_for(0, rows, row_grain(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gu + r * 2 * n;
      const T* u = g + n;
      T* o = out + r * n;
      int64_t i = 0;  // bf16/fp16: silu rounded to T, then the product (as F.silu(gate) * up)
      for (; i + V <= n; i += V) {
        const Vec x = load_f32<T>(g + i);
        store_t<T>(o + i, round_t<T>(x / (Vec(1.f) + x.neg().exp())) * load_f32<T>(u + i));
      }
      for (; i < n; ++i) {
        const float x = static_cast<float>(g[i]);
        o[i] = to_t<T>(static_cast<float>(to_t<T>(x / (1.f + std::exp(-x)))) * static_cast<float>(u[i]));
      }
    }
  });
}

// RoPE (rotate_half style) in place on the query and key heads of qkv [T, (H + 2 KVH) * D], with
// cos/sin [T, D]; then, if cache is given ([2, blocks, block_size, KVH, D], same dtype), the rotated
// K and V rows of token t are copied to flat slot slots[t] (block * block_size + offset; < 0 skips).
template <typename T>
static void rope_kernel(T* qkv, const T* cos, const T* sin, int64_t tokens, int64_t H, int64_t KVH, int64_t D,
                        T* cache, int64_t v_offset, const int64_t* slots) {
  constexpr int64_t V = Vec::size();
  const int64_t half = D / 2, width = (H + 2 * KVH) * D;
  at::parallel_for(0, tokens, row_grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* row = qkv + t * width;
      const T* c = cos + t * D;
      const T* s = sin + t * D;
      for (int64_t h = 0; h < H + KVH; ++h) {
        T* x = row + h * D;
        int64_t i = 0;
        for (; i + V <= half; i += V) {  // bf16/fp16: x * cos rounded to T, + rotate_half(x) * sin (addcmul)
          const Vec x1 = load_f32<T>(x + i), x2 = load_f32<T>(x + half + i);
          const Vec o1 = at::vec::fmadd(x2.neg(), load_f32<T>(s + i), round_t<T>(x1 * load_f32<T>(c + i)));
          const Vec o2 = at::vec::fmadd(x1, load_f32<T>(s + half + i), round_t<T>(x2 * load_f32<T>(c + half + i)));
          store_t<T>(x + i, o1);
          store_t<T>(x + half + i, o2);
        }
        for (; i < half; ++i) {  // bf16/fp16: x * cos rounded to T, then + rotate_half(x) * sin (addcmul)
          const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[half + i]);
          const float a1 = static_cast<float>(to_t<T>(x1 * static_cast<float>(c[i])));
          const float a2 = static_cast<float>(to_t<T>(x2 * static_cast<float>(c[half + i])));
          x[i] = to_t<T>(a1 - x2 * static_cast<float>(s[i]));
          x[half + i] = to_t<T>(a2 + x1 * static_cast<float>(s[half + i]));
        }
      }
      if (cache && slots[t] >= 0) {
        T* dst = cache + slots[t] * KVH * D;
        std::memcpy(dst, row + H * D, KVH * D * sizeof(T));
        std::memcpy(dst + v_offset, row + (H + KVH) * D, KVH * D * sizeof(T));
      }
    }
  });
}
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.is_contiguous() && w.numel() == x.size(1), "x [T, D], w [D]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "x and w dtypes differ");
  auto out = at::empty_like(x);
  by_dtype(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    rms_norm_kernel<T>(x.data_ptr<T>(), nullptr, w.data_ptr<T>(), out.data_ptr<T>(), x.size(0), x.size(1), eps);
  });
  return out;
}

at::Tensor add_rms_norm(at::Tensor x, at::Tensor res, at::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && res.is_contiguous() && w.is_contiguous(), "contiguous x, res, w");
  TORCH_CHECK(res.sizes() == x.sizes() && w.numel() == x.size(1), "x, res [T, D], w [D]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && x.scalar_type() == res.scalar_type(), "dtypes differ");
  auto out = at::empty_like(x);
  by_dtype(x.scalar_type(), "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    rms_norm_kernel<T>(x.data_ptr<T>(), res.data_ptr<T>(), w.data_ptr<T>(), out.data_ptr<T>(), x.size(0), x.size(1), eps);
  });
  return out;
}

at::Tensor silu_mul(at::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.is_contiguous() && gu.size(1) % 2 == 0, "gate_up [T, 2I], contiguous");
  auto out = at::empty({gu.size(0), gu.size(1) / 2}, gu.options());
  by_dtype(gu.scalar_type(), "silu_mul", [&](auto tag) {
    using T = decltype(tag);
    silu_mul_kernel<T>(gu.data_ptr<T>(), out.data_ptr<T>(), gu.size(0), gu.size(1) / 2);
  });
  return out;
}

void rope_write(at::Tensor qkv, at::Tensor cos, at::Tensor sin, int64_t H, int64_t KVH,
                std::optional<at::Tensor> cache, std::optional<at::Tensor> slots) {
  const int64_t T_ = qkv.size(0), D = cos.size(1);
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) == (H + 2 * KVH) * D && D % 2 == 0, "qkv [T, (H + 2 KVH) D]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.size(0) == T_, "cos, sin [T, D]");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(), "cos/sin dtype");
  TORCH_CHECK(cache.has_value() == slots.has_value(), "cache and slots go together");
  if (cache) {
    TORCH_CHECK(cache->dim() == 5 && cache->size(0) == 2 && cache->size(3) == KVH && cache->size(4) == D && cache->is_contiguous(),
                "cache [2, blocks, block_size, KVH, D], contiguous");
    TORCH_CHECK(cache->scalar_type() == qkv.scalar_type(), "cache dtype");
    TORCH_CHECK(slots->scalar_type() == at::kLong && slots->is_contiguous() && slots->numel() == T_, "int64 slots [T]");
  }
  by_dtype(qkv.scalar_type(), "rope_write", [&](auto tag) {
    using T = decltype(tag);
    rope_kernel<T>(qkv.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(), T_, H, KVH, D,
                   cache ? cache->data_ptr<T>() : nullptr, cache ? cache->stride(0) : 0,
                   slots ? slots->data_ptr<int64_t>() : nullptr);
  });
}
