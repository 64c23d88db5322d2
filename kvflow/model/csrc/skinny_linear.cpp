// A projection of a few rows (decoding a few sequences):
// y [N, out] = x [N, in] @ W [out, in]^T for small N (decode of a few sequences): the step is then
// bound by reading W, so each weight row is loaded from memory once and multiplied with up to 4 rows
// of x held in L1 (further rows reuse the weight row from L1). Rows of W are split over threads.
// bf16/fp16 values are widened to float32 as they are loaded and FMA'd into float32 accumulators,
// // rounded once at the end (as oneDNN's GEMM does). (AVX512-BF16's dot product was measured and was
// slower here: the loop is bound by reading W, and the widening loop reads it faster.)
#include "kernel_utils.h"

template <typename T, int NT>
static inline void skinny_tile(const T* x, const T* w, T* y, int64_t out, int64_t in) {
  constexpr int64_t V = Vec::size();
  const int64_t vend = in - in % V;
  Vec acc[NT];
  for (int n = 0; n < NT; ++n) acc[n] = Vec(0.f);
  for (int64_t k = 0; k < vend; k += V) {
    const Vec wv = load_f32<T>(w + k);
    for (int n = 0; n < NT; ++n) acc[n] = at::vec::fmadd(load_f32<T>(x + n * in + k), wv, acc[n]);
  }
  for (int n = 0; n < NT; ++n) {
    float s = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc[n]);
    for (int64_t k = vend; k < in; ++k) s += static_cast<float>(x[n * in + k]) * static_cast<float>(w[k]);
    y[n * out] = to_t<T>(s);
  }
}

at::Tensor skinny_linear(at::Tensor x, at::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [N, in], w [out, in]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "contiguous x and w");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "skinny_linear: x and w dtypes differ");
  const int64_t N = x.size(0), out = w.size(0), in = w.size(1);
  auto y = at::empty({N, out}, x.options());
  by_dtype(x.scalar_type(), "skinny_linear", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const T* wp = w.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    // ~64 KB of weights per task: enough to amortise a thread's start, small enough to balance
    const int64_t grain = std::max<int64_t>(1, 65536 / static_cast<int64_t>(sizeof(T)) / std::max<int64_t>(1, in));
    at::parallel_for(0, out, grain, [&](int64_t begin, int64_t end) {
      for (int64_t o = begin; o < end; ++o) {
        const T* wr = wp + o * in;
        int64_t n = 0;
        for (; n + 4 <= N; n += 4) skinny_tile<T, 4>(xp + n * in, wr, yp + n * out + o, out, in);
        switch (N - n) {
          case 1: skinny_tile<T, 1>(xp + n * in, wr, yp + n * out + o, out, in); break;
          case 2: skinny_tile<T, 2>(xp + n * in, wr, yp + n * out + o, out, in); break;
          case 3: skinny_tile<T, 3>(xp + n * in, wr, yp + n * out + o, out, in); break;
          default: break;
        }
      }
    });
  });
  return y;
}

