// Decode attention: one query token per sequence (B sequences, H query heads sharing KVH KV heads)
// over the sequence's first ctx[b] cached tokens, walking its block table block by block: every K
// and V byte is read once, straight from the paged cache, with no gathered copy. Scores and output
// accumulate in float32.
#include "kernel_utils.h"

#include <vector>

// Work items are heads [h0, h1) of one sequence: all KV heads of a sequence when there are at
// least as many sequences as threads (each token's K and V rows are then read contiguously, once),
// else one KV head each (batch 1 still uses every thread). Pass 1 reads K block by block into
// (head, group) x n float scores, a vectorised softmax per row, pass 2 reads V block by block into
// float accumulators (head, group) x D. q is pre-scaled into float once per item.
template <typename T, int C>
static void decode_kernel(const T* q, const T* kv, const int64_t* table, const int64_t* ctx, T* out, int64_t B,
                          int64_t H, int64_t KVH, int64_t BS, int64_t max_blocks, int64_t v_offset, float scale) {
  constexpr int64_t D = C * Vec::size();
  const int64_t G = H / KVH, tok_stride = KVH * D, blk_stride = BS * KVH * D;
  const int64_t per_item = B >= at::get_num_threads() ? KVH : 1;  // KV heads per work item
  at::parallel_for(0, B * (KVH / per_item), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, inv;
    std::vector<Vec> qv, acc;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / (KVH / per_item), h0 = (w % (KVH / per_item)) * per_item, n = ctx[b];
      const int64_t rows = per_item * G;  // query heads h0 * G .. h0 * G + rows
      const int64_t* blocks = table + b * max_blocks;
      const T* qb = q + (b * H + h0 * G) * D;
      qv.resize(rows * C);
      for (int64_t i = 0; i < rows * C; ++i) qv[i] = load_f32<T>(qb + i * Vec::size()) * Vec(scale);
      scores.resize(rows * n);
      inv.resize(rows);
      for (int64_t t0 = 0; t0 < n; t0 += BS) {
        const T* kb = kv + blocks[t0 / BS] * blk_stride + h0 * D;
        const int64_t len = std::min(n - t0, BS);
        for (int64_t t = 0; t < len; ++t) {
          for (int64_t hh = 0; hh < per_item; ++hh) {
            const T* k = kb + t * tok_stride + hh * D;
            Vec kc[C];
            for (int c = 0; c < C; ++c) kc[c] = load_f32<T>(k + c * Vec::size());
            for (int64_t g = 0; g < G; ++g) {
              const Vec* qg = qv.data() + (hh * G + g) * C;
              Vec dot = qg[0] * kc[0];
              for (int c = 1; c < C; ++c) dot = at::vec::fmadd(qg[c], kc[c], dot);
              scores[(hh * G + g) * n + t0 + t] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, dot);
            }
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* s = scores.data() + r * n;
        const float mx = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, s, n);
        at::vec::map([mx](Vec x) { return (x - Vec(mx)).exp(); }, s, s, n);
        inv[r] = 1.f / at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, s, n);
      }
      acc.assign(rows * C, Vec(0.f));
      for (int64_t t0 = 0; t0 < n; t0 += BS) {
        const T* vb = kv + v_offset + blocks[t0 / BS] * blk_stride + h0 * D;
        const int64_t len = std::min(n - t0, BS);
        for (int64_t t = 0; t < len; ++t) {
          for (int64_t hh = 0; hh < per_item; ++hh) {
            const T* v = vb + t * tok_stride + hh * D;
            Vec vc[C];
            for (int c = 0; c < C; ++c) vc[c] = load_f32<T>(v + c * Vec::size());
            for (int64_t g = 0; g < G; ++g) {
              const Vec pt(scores[(hh * G + g) * n + t0 + t]);
              Vec* a = acc.data() + (hh * G + g) * C;
              for (int c = 0; c < C; ++c) a[c] = at::vec::fmadd(pt, vc[c], a[c]);
            }
          }
        }
      }
      T* ob = out + (b * H + h0 * G) * D;
      for (int64_t r = 0; r < rows; ++r)
        for (int c = 0; c < C; ++c) {
          float tmp[Vec::size()];
          (acc[r * C + c] * Vec(inv[r])).store(tmp);
          for (int64_t i = 0; i < Vec::size(); ++i) ob[r * D + c * Vec::size() + i] = static_cast<T>(tmp[i]);
        }
    }
  });
}

#if defined(__AVX512BF16__)
// ---- the decode kernel's bf16 dot-product path (head_dim a multiple of 32), same work items as
// `decode_kernel`:
// - scores: 16 keys at a time, each K row used as stored (D / 32 vdpbf16ps per query head and key),
//   the 16 keys' partial lanes summed by one transposing tree (`sum16`: 45 instructions for 16
//   scores, where a horizontal sum per score takes ~9);
// - P V: the V rows of two keys interleaved into pairs (unpacklo / unpackhi, so accumulator lanes
//   hold a permutation of the head dims, undone at the end) times the two keys' probabilities,
//   rounded to bf16 as in the prefill path; softmax and accumulation stay float32;
// - memory: these loops read a 16-key group's rows once per (KV head, query head), an order the
//   hardware prefetcher follows poorly (from memory this was slower than the widening kernel, though
//   faster in cache). So each group is first read in address order, one load per cache line (the
//   loops then hit L1), while the next group is prefetched into L2 (`stage`): the kernel then reads
//   the cache at close to the rate of a loop that only loads the same bytes.

// lane j of the result = the sum of the 16 lanes of v[j], j < 16.
static inline __m512 sum16(const __m512* v) {
  __m512 c[4];
  for (int k = 0; k < 4; ++k) {
    const __m512* w = v + 4 * k;
    const __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(w[0], w[1]), _mm512_unpackhi_ps(w[0], w[1]));
    const __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(w[2], w[3]), _mm512_unpackhi_ps(w[2], w[3]));
    c[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))));
  }  // c[k], 128-bit lane L: v[4k .. 4k + 3], each summed over its lane L
  const __m512 f01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x44), _mm512_shuffle_f32x4(c[0], c[1], 0xEE));
  const __m512 f23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x44), _mm512_shuffle_f32x4(c[2], c[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(f01, f23, 0x88), _mm512_shuffle_f32x4(f01, f23, 0xDD));
}

template <int C2>  // C2 = D / 32: bf16 vectors per head row
static void decode_kernel_dp(const at::BFloat16* q, const at::BFloat16* kv, const int64_t* table, const int64_t* ctx,
                             at::BFloat16* out, int64_t B, int64_t H, int64_t KVH, int64_t BS, int64_t max_blocks,
                             int64_t v_offset, float scale) {
  constexpr int64_t D = C2 * 32;
  constexpr int64_t GB = std::max(1, 12 / (2 * C2));  // query heads whose P V accumulators are in registers at once
  const int64_t G = H / KVH, tok_stride = KVH * D, blk_stride = BS * KVH * D;
  const int64_t per_item = B >= at::get_num_threads() ? KVH : 1;
  const int64_t row_bytes = per_item * D * static_cast<int64_t>(sizeof(at::BFloat16));
  at::parallel_for(0, B * (KVH / per_item), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, inv, accs;
    std::vector<Pair> probs;
    std::vector<const at::BFloat16*> krow;  // each key's K row (its V row is v_offset further)
    std::vector<at::BFloat16> zeros(KVH * D);  // the rows past the context (any KV head's offset stays inside)
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / (KVH / per_item), h0 = (w % (KVH / per_item)) * per_item, n = ctx[b];
      const int64_t rows = per_item * G, n16 = (n + 15) / 16 * 16, np = (n + 1) / 2;
      const int64_t* blocks = table + b * max_blocks;
      const at::BFloat16* qb = q + (b * H + h0 * G) * D;
      krow.resize(n16);
      for (int64_t t0 = 0, bi = 0; t0 < n; t0 += BS, ++bi) {
        const at::BFloat16* base = kv + blocks[bi] * blk_stride + h0 * D;
        for (int64_t t = 0; t < std::min(BS, n - t0); ++t) krow[t0 + t] = base + t * tok_stride;
      }
      for (int64_t t = n; t < n16; ++t) krow[t] = zeros.data();
      // keys t0 .. t0 + 15 read in address order, one load per line; keys t0 + 16 .. t0 + 31 prefetched into L2
      auto stage = [&](int64_t t0, int64_t off) {
        __m512i sink = _mm512_setzero_si512();
        for (int64_t t = t0; t < std::min(n, t0 + 16); ++t) {
          const char* r = reinterpret_cast<const char*>(krow[t] + off);
          for (int64_t x = 0; x < row_bytes; x += 64) sink = _mm512_or_si512(sink, _mm512_loadu_si512(r + x));
        }
        asm volatile("" : : "v"(sink));
        for (int64_t t = t0 + 16; t < std::min(n, t0 + 32); ++t) {
          const char* r = reinterpret_cast<const char*>(krow[t] + off);
          for (int64_t x = 0; x < row_bytes; x += 64) _mm_prefetch(r + x, _MM_HINT_T1);
        }
      };
      scores.resize(rows * n16);
      inv.resize(rows);
      for (int64_t t0 = 0; t0 < n; t0 += 16) {
        stage(t0, 0);
        const at::BFloat16* const* k = krow.data() + t0;
        for (int64_t hh = 0; hh < per_item; ++hh)
          for (int64_t g = 0; g < G; ++g) {
            const at::BFloat16* qr = qb + (hh * G + g) * D;
            __m512bh qv[C2];
            for (int c = 0; c < C2; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qr + 32 * c);
            __m512 acc[16];
#pragma GCC unroll 16
            for (int j = 0; j < 16; ++j) {
              const at::BFloat16* kr = k[j] + hh * D;
              acc[j] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(kr));
#pragma GCC unroll 8
              for (int c = 1; c < C2; ++c) acc[j] = _mm512_dpbf16_ps(acc[j], qv[c], (__m512bh)_mm512_loadu_si512(kr + 32 * c));
            }
            _mm512_storeu_ps(scores.data() + (hh * G + g) * n16 + t0, _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
          }
      }
      // softmax per row, then the probabilities as bf16 pairs (key 2i in the low half, 2i + 1 in the high)
      probs.resize(rows * np);
      const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
      const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
      for (int64_t r = 0; r < rows; ++r) {
        float* s = scores.data() + r * n16;
        const float mx = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, s, n);
        at::vec::map([mx](Vec x) { return (x - Vec(mx)).exp(); }, s, s, n);
        inv[r] = 1.f / at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, s, n);
        if (n % 2) s[n] = 0.f;  // the partner of an odd last key (n16 > n)
        int64_t i = 0;
        for (; i + 16 <= np; i += 16) {
          const __m512i lo = _mm512_loadu_si512(s + 2 * i), hi = _mm512_loadu_si512(s + 2 * i + 16);
          _mm512_storeu_si512(probs.data() + r * np + i,
                              bf16_pairs(_mm512_castsi512_ps(_mm512_permutex2var_epi32(lo, even, hi)),
                                         _mm512_castsi512_ps(_mm512_permutex2var_epi32(lo, odd, hi))));
        }
        for (; i < np; ++i) {
          const at::BFloat16 e = static_cast<at::BFloat16>(s[2 * i]), o = static_cast<at::BFloat16>(s[2 * i + 1]);
          probs[r * np + i] = static_cast<Pair>(static_cast<uint32_t>(e.x) | (static_cast<uint32_t>(o.x) << 16));
        }
      }
      // P V, 8 key pairs (one staged group) at a time; per KV head, GB query heads' accumulators in
      // registers, kept in `accs` between groups: [row][c][unpacklo / unpackhi][16]
      accs.assign(rows * C2 * 2 * 16, 0.f);
      for (int64_t p0 = 0; p0 < np; p0 += 8) {
        stage(2 * p0, v_offset);
        const int64_t p1 = std::min(np, p0 + 8);
        for (int64_t hh = 0; hh < per_item; ++hh)
          for (int64_t g0 = 0; g0 < G; g0 += GB) {
            const int64_t gn = std::min(GB, G - g0);
            float* ab = accs.data() + (hh * G + g0) * C2 * 32;
            __m512 acc[GB][C2][2];
            for (int64_t g = 0; g < gn; ++g)
              for (int c = 0; c < C2; ++c)
                for (int h = 0; h < 2; ++h) acc[g][c][h] = _mm512_loadu_ps(ab + ((g * C2 + c) * 2 + h) * 16);
            for (int64_t tp = p0; tp < p1; ++tp) {
              const at::BFloat16* va = krow[2 * tp] + v_offset + hh * D;
              const at::BFloat16* vb = 2 * tp + 1 < n ? krow[2 * tp + 1] + v_offset + hh * D : zeros.data();
              __m512bh lo[C2], hi[C2];
              for (int c = 0; c < C2; ++c) {
                const __m512i x = _mm512_loadu_si512(va + 32 * c), y = _mm512_loadu_si512(vb + 32 * c);
                lo[c] = (__m512bh)_mm512_unpacklo_epi16(x, y);
                hi[c] = (__m512bh)_mm512_unpackhi_epi16(x, y);
              }
              for (int64_t g = 0; g < gn; ++g) {
                const __m512bh pr = (__m512bh)_mm512_set1_epi32(probs[(hh * G + g0 + g) * np + tp]);
                for (int c = 0; c < C2; ++c) {
                  acc[g][c][0] = _mm512_dpbf16_ps(acc[g][c][0], pr, lo[c]);
                  acc[g][c][1] = _mm512_dpbf16_ps(acc[g][c][1], pr, hi[c]);
                }
              }
            }
            for (int64_t g = 0; g < gn; ++g)
              for (int c = 0; c < C2; ++c)
                for (int h = 0; h < 2; ++h) _mm512_storeu_ps(ab + ((g * C2 + c) * 2 + h) * 16, acc[g][c][h]);
          }
      }
      for (int64_t r = 0; r < rows; ++r) {
        at::BFloat16* o = out + (b * H + h0 * G + r) * D;
        for (int c = 0; c < C2; ++c) {
          const float* lo = accs.data() + (r * C2 + c) * 32;
          const float* hi = lo + 16;
          // lane 4L + i of unpacklo is head dim 32c + 8L + i, of unpackhi 32c + 8L + 4 + i (L: 128-bit lane)
          for (int L = 0; L < 4; ++L)
            for (int i = 0; i < 4; ++i) {
              o[32 * c + 8 * L + i] = static_cast<at::BFloat16>(lo[4 * L + i] * inv[r]);
              o[32 * c + 8 * L + 4 + i] = static_cast<at::BFloat16>(hi[4 * L + i] * inv[r]);
            }
        }
      }
    }
  });
}
#endif

int64_t vec_size() { return Vec::size(); }

at::Tensor paged_decode(at::Tensor q, at::Tensor kv, at::Tensor table, at::Tensor ctx, double scale) {
  NoGil no_gil;
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 5 && kv.size(0) == 2, "q [B, H, D], kv [2, blocks, block_size, kv_heads, D]");
  TORCH_CHECK(q.is_contiguous() && kv.is_contiguous() && table.is_contiguous() && ctx.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type(), "q and kv dtypes differ");
  TORCH_CHECK(table.scalar_type() == at::kLong && ctx.scalar_type() == at::kLong, "int64 block table and lengths");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = kv.size(3), BS = kv.size(2);
  TORCH_CHECK(kv.size(4) == D && H % KVH == 0 && table.size(0) == B && ctx.size(0) == B, "shape mismatch");
  auto out = at::empty_like(q);
  by_dtype(q.scalar_type(), "paged_decode", [&](auto tag) {
    using T = decltype(tag);
    by_head_vectors(D, "paged_decode", [&](auto chunks) {
      constexpr int C = decltype(chunks)::value;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, at::BFloat16> && Vec::size() == 16 && C % 2 == 0) {  // head_dim % 32 == 0
        decode_kernel_dp<C / 2>(q.data_ptr<T>(), kv.data_ptr<T>(), table.data_ptr<int64_t>(), ctx.data_ptr<int64_t>(),
            out.data_ptr<T>(), B, H, KVH, BS, table.size(1), kv.stride(0), static_cast<float>(scale));
        return;
      }
#endif
      decode_kernel<T, C>(q.data_ptr<T>(), kv.data_ptr<T>(), table.data_ptr<int64_t>(),
          ctx.data_ptr<int64_t>(), out.data_ptr<T>(), B, H, KVH, BS, table.size(1), kv.stride(0), static_cast<float>(scale));
    });
  });
  return out;
}
