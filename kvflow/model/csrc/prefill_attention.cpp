// Prefill attention over the paged cache.
// Causal attention for the query tokens of prefill chunks, reading K and V from the paged cache (the
// chunk's own K/V were written there by rope_write before the call). Sequence s has q_len[s] query
// tokens at rows q_start[s].. of q, the last of its ctx[s] cached tokens; query i sees keys
// 0 .. ctx - q_len + i. A flash-attention loop in float32:
// - a first pass widens each (sequence, KV head)'s K and V rows to float32 once (every query tile of
//   the sequence reuses them);
// - work items are (sequence, KV head, query tile): up to kRowVecs vectors of rows, a row being one
//   query token x one of the G query heads that share the KV head (GQA: K/V are read once for all G);
// - queries are held transposed ([D][rows]), so a score tile is register-blocked as JB keys x the
//   rows' vectors (one broadcast K value per FMA row), and the online softmax runs down columns with
//   the rows in vector lanes; P V accumulates in register tiles of kAccRegs / (D / vector width) rows x D.
// Items are handed out largest first from a shared counter, so causal tiles of unequal cost balance.
// bf16 on a CPU with AVX512-BF16 runs both products as bf16 dot products instead (`kDpBf16` below),
// half the instructions of the widening loop.
// Register budget for accumulator tiles: 24 of AVX512's 32 vector registers, 12 of AVX2's 16.
#include "kernel_utils.h"

#include <atomic>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

constexpr int64_t kRowVecs = 4, kKT = 64;
constexpr int kAccRegs = Vec::size() >= 16 ? 24 : 12;

// s[j][0..NRV vectors) = sum_d k[j][d] * qt[d][..] for j < JB (k rows of D floats, qt [D][ld]).
template <int NRV, int JB>
static inline void score_tile(const float* qt, int64_t ld, const float* const* k, int64_t D, float* s, int64_t lds) {
  constexpr int64_t V = Vec::size();
  Vec acc[JB][NRV];
#pragma GCC unroll 32
  for (int j = 0; j < JB; ++j)
#pragma GCC unroll 8
    for (int c = 0; c < NRV; ++c) acc[j][c] = Vec(0.f);
  for (int64_t d = 0; d < D; ++d) {
    Vec qd[NRV];
#pragma GCC unroll 8
    for (int c = 0; c < NRV; ++c) qd[c] = Vec::loadu(qt + d * ld + c * V);
#pragma GCC unroll 32
    for (int j = 0; j < JB; ++j) {
      const Vec kj(k[j][d]);
#pragma GCC unroll 8
      for (int c = 0; c < NRV; ++c) acc[j][c] = at::vec::fmadd(kj, qd[c], acc[j][c]);
    }
  }
#pragma GCC unroll 32
  for (int j = 0; j < JB; ++j)
#pragma GCC unroll 8
    for (int c = 0; c < NRV; ++c) acc[j][c].store(s + j * lds + c * V);
}

// o[r][0..C vectors) += sum_j p[j][r] * v[j][..] for r < RB (p [keys][ldp], v rows of C vectors).
template <int C, int RB>
static inline void pv_tile(const float* p, int64_t ldp, const float* const* v, int64_t nk, float* o, int64_t ldo) {
  constexpr int64_t V = Vec::size();
  Vec acc[RB][C];
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[r][c] = Vec::loadu(o + r * ldo + c * V);
  for (int64_t j = 0; j < nk; ++j) {
    Vec vj[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) vj[c] = Vec::loadu(v[j] + c * V);
#pragma GCC unroll 16
    for (int r = 0; r < RB; ++r) {
      const Vec pr(p[j * ldp + r]);
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) acc[r][c] = at::vec::fmadd(pr, vj[c], acc[r][c]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[r][c].store(o + r * ldo + c * V);
}

template <int NRV>
static void score_tiles(const float* qt, int64_t ld, const float* const* k, int64_t nk, int64_t D, float* s) {
  constexpr int JB = kAccRegs / NRV;  // JB keys x NRV row vectors of accumulators
  int64_t j = 0;
  for (; j + JB <= nk; j += JB) score_tile<NRV, JB>(qt, ld, k + j, D, s + j * ld, ld);
  for (; j < nk; ++j) score_tile<NRV, 1>(qt, ld, k + j, D, s + j * ld, ld);
}

template <int C>
static void pv_tiles(const float* p, int64_t ldp, const float* const* v, int64_t nk, int64_t R, float* o) {
  constexpr int64_t D = C * Vec::size();
  constexpr int RB = std::max(1, kAccRegs / C);  // RB rows x C vectors of accumulators
  int64_t r = 0;
  for (; r + RB <= R; r += RB) pv_tile<C, RB>(p + r, ldp, v, nk, o + r * D, D);
  for (; r < R; ++r) pv_tile<C, 1>(p + r, ldp, v, nk, o + r * D, D);
}

#if defined(__AVX512BF16__)
// bf16 with AVX512-BF16: the two products as vdpbf16ps (32 bf16 pairs into 16 float32 lanes), half
// the instructions of widening + FMA and no widening pass for K. Pairs run along the dot product:
// head dims (d, d+1) for the scores, keys (j, j+1) for P V. Queries are packed [D / 2][rows] as
// int32 pairs, V as [keys / 2][D] pairs, P as [keys / 2][rows] pairs (rounded to bf16, as SDPA's
// math path rounds the softmax to the input dtype before P V); K is read in place from the cache.
constexpr bool kDpBf16 = true;

// s[j][0..NRV vectors) = sum over d of k[j][d] q[..][d] (unscaled), qp [D / 2][ld] pairs.
template <int NRV, int JB>
static inline void score_tile_dp(const Pair* qp, int64_t ld, const at::BFloat16* const* k, int64_t D, float* s, int64_t lds) {
  __m512 acc[JB][NRV];
#pragma GCC unroll 32
  for (int j = 0; j < JB; ++j)
#pragma GCC unroll 8
    for (int c = 0; c < NRV; ++c) acc[j][c] = _mm512_setzero_ps();
  for (int64_t d2 = 0; d2 < D / 2; ++d2) {
    __m512bh qd[NRV];
#pragma GCC unroll 8
    for (int c = 0; c < NRV; ++c) qd[c] = (__m512bh)_mm512_loadu_si512(qp + d2 * ld + c * 16);
#pragma GCC unroll 32
    for (int j = 0; j < JB; ++j) {
      Pair kj;
      std::memcpy(&kj, k[j] + 2 * d2, sizeof(Pair));
      const __m512bh kb = (__m512bh)_mm512_set1_epi32(kj);
#pragma GCC unroll 8
      for (int c = 0; c < NRV; ++c) acc[j][c] = _mm512_dpbf16_ps(acc[j][c], qd[c], kb);
    }
  }
#pragma GCC unroll 32
  for (int j = 0; j < JB; ++j)
#pragma GCC unroll 8
    for (int c = 0; c < NRV; ++c) _mm512_storeu_ps(s + j * lds + c * 16, acc[j][c]);
}

template <int NRV>
static void score_tiles_dp(const Pair* qp, int64_t ld, const at::BFloat16* const* k, int64_t nk, int64_t D, float* s) {
  constexpr int JB = kAccRegs / NRV;
  int64_t j = 0;
  for (; j + JB <= nk; j += JB) score_tile_dp<NRV, JB>(qp, ld, k + j, D, s + j * ld, ld);
  for (; j < nk; ++j) score_tile_dp<NRV, 1>(qp, ld, k + j, D, s + j * ld, ld);
}

// o[r][0..C vectors) += sum over key pairs of p[jp][r] . v[jp][..] for r < RB (pp [pairs][ldp], vp [pairs][D]).
template <int C, int RB>
static inline void pv_tile_dp(const Pair* pp, int64_t ldp, const Pair* vp, int64_t pairs, float* o, int64_t ldo) {
  constexpr int64_t D = C * 16;
  __m512 acc[RB][C];
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_loadu_ps(o + r * ldo + c * 16);
  for (int64_t jp = 0; jp < pairs; ++jp) {
    __m512bh vj[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) vj[c] = (__m512bh)_mm512_loadu_si512(vp + jp * D + c * 16);
#pragma GCC unroll 16
    for (int r = 0; r < RB; ++r) {
      const __m512bh pr = (__m512bh)_mm512_set1_epi32(pp[jp * ldp + r]);
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pr, vj[c]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + r * ldo + c * 16, acc[r][c]);
}

template <int C>
static void pv_tiles_dp(const Pair* pp, int64_t ldp, const Pair* vp, int64_t pairs, int64_t R, float* o) {
  constexpr int64_t D = C * 16;
  constexpr int RB = std::max(1, kAccRegs / C);
  int64_t r = 0;
  for (; r + RB <= R; r += RB) pv_tile_dp<C, RB>(pp + r, ldp, vp, pairs, o + r * D, D);
  for (; r < R; ++r) pv_tile_dp<C, 1>(pp + r, ldp, vp, pairs, o + r * D, D);
}
#else
constexpr bool kDpBf16 = false;
#endif

template <typename T, int C>
static void prefill_kernel(const T* q, int64_t q_row_stride, const T* kv, int64_t v_offset, const int64_t* table,
                           int64_t max_blocks, const int64_t* q_start, const int64_t* q_len, const int64_t* ctx, T* out,
                           int64_t S, int64_t H, int64_t KVH, int64_t BS, float scale) {
  constexpr int64_t V = Vec::size(), D = C * V;
  constexpr bool DP = kDpBf16 && std::is_same_v<T, at::BFloat16> && V == 16;  // the vdpbf16ps path
  const int64_t G = H / KVH, tok_stride = KVH * D, blk_stride = BS * KVH * D;
  const int64_t QT = std::max<int64_t>(1, kRowVecs * V / G);  // query tokens per tile
  auto row = [&](int64_t s, int64_t h, int64_t t) {  // token t's K row of sequence s, KV head h, in the cache
    return kv + table[s * max_blocks + t / BS] * blk_stride + (t % BS) * tok_stride + h * D;
  };
  // First pass, per (sequence, KV head), 32-bit words at base[s * KVH + h]: float32 K then V rows
  // ([2][keys][D]), or for DP V's key pairs ([keys / 2][D] bf16 pairs; K is read in place).
  // Where every sequence's chunk is one query tile (decode rows: one token each), no tile would reuse
  // the copy: `in_place` skips the pass, and each key tile's words are made as the tile is reached
  // (the same values, so the same results).
  bool in_place = true;
  for (int64_t s = 0; s < S; ++s) in_place = in_place && q_len[s] <= QT;
  std::vector<int64_t> base(S * KVH + 1, 0);
  for (int64_t s = 0; s < S && !in_place; ++s)
    for (int64_t h = 0; h < KVH; ++h)
      base[s * KVH + h + 1] = base[s * KVH + h] + (DP ? (ctx[s] + 1) / 2 * D : 2 * ctx[s] * D);
  std::unique_ptr<float[]> kvf(new float[base.back()]);  // every word is written below
  // V rows of keys t, t + 1 of (s, h) as bf16 pairs (the missing key past the context is 0) -> C vectors at vp
  auto v_pairs = [&](int64_t s, int64_t h, int64_t t, Pair* vp) {
#if defined(__AVX512BF16__)
    if constexpr (DP) {
      const T* v0 = row(s, h, t) + v_offset;
      const T* v1 = t + 1 < ctx[s] ? row(s, h, t + 1) + v_offset : nullptr;
      for (int c = 0; c < C; ++c) {
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + c * V)));
        const __m512i hi = v1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + c * V)))
                              : _mm512_setzero_si512();  // an odd count's last pair: the missing key is 0
        _mm512_storeu_si512(vp + c * V, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    }
#endif
    (void)s; (void)h; (void)t; (void)vp;
  };
  at::parallel_for(0, in_place ? 0 : S * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t s = w / KVH, h = w % KVH, n = ctx[s];
      float* kf = kvf.get() + base[w];
      if constexpr (DP) {
        Pair* vp = reinterpret_cast<Pair*>(kf);
        for (int64_t t = 0; t < n; t += 2) v_pairs(s, h, t, vp + (t / 2) * D);
      } else {
        float* vf = kf + n * D;
        for (int64_t t = 0; t < n; ++t) {
          const T* kr = row(s, h, t);
          for (int c = 0; c < C; ++c) {
            load_f32<T>(kr + c * V).store(kf + t * D + c * V);
            load_f32<T>(kr + v_offset + c * V).store(vf + t * D + c * V);
          }
        }
      }
    }
  });
  struct Item { int64_t s, h, i0, cost; };
  std::vector<Item> items;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t i0 = 0; i0 < q_len[s]; i0 += QT) {
      const int64_t keys = ctx[s] - q_len[s] + std::min(q_len[s], i0 + QT);
      for (int64_t h = 0; h < KVH; ++h) items.push_back({s, h, i0, keys * std::min(QT, q_len[s] - i0)});
    }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t n_items = items.size(), LD = kRowVecs * V;
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n_items), 1, [&](int64_t, int64_t) {
    // qt: queries [D][LD] floats, or for DP [D / 2][LD] pairs; sc: scores [kKT][LD]; pp (DP): P's key pairs
    std::vector<float> qt(D * LD), sc(kKT * LD), o(LD * D), m(LD), l(LD), lim(LD), pp(DP ? kKT / 2 * LD : 0);
    std::vector<const float*> kp(DP ? 0 : kKT), vp(DP ? 0 : kKT);  // K/V rows of a key tile: float32 copies,
    std::vector<const T*> kr(DP ? kKT : 0);                         // or (DP) K rows in the cache
    // in_place: the key tile's float32 K and V rows ([2][kKT][D]), or (DP) its V pairs ([kKT / 2][D])
    std::vector<float> tile(in_place ? (DP ? kKT / 2 * D : 2 * kKT * D) : 0);
    for (int64_t w = next++; w < n_items; w = next++) {
      const Item it = items[w];
      const int64_t nq = std::min(QT, q_len[it.s] - it.i0), R = nq * G, NRV = (R + V - 1) / V, past = ctx[it.s] - q_len[it.s];
      const float* kf = kvf.get() + base[it.s * KVH + it.h];  // the first pass's words (DP: V's key pairs)
      // queries transposed: qt[d][r], r = i * G + g (query token it.i0 + i, head it.h * G + g),
      // pre-scaled floats; for DP unscaled bf16 pairs qt[d / 2][r] (the scale multiplies the scores)
      if (R % V)  // rows padding the last vector: zero queries (their outputs are not stored)
        for (int64_t d = 0; d < D; ++d) std::fill(qt.data() + d * LD + R, qt.data() + d * LD + NRV * V, 0.f);
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const T* src = q + (q_start[it.s] + it.i0 + i) * q_row_stride + (it.h * G + g) * D;
          if constexpr (DP) {
            int32_t* qp = reinterpret_cast<int32_t*>(qt.data());
            for (int64_t d = 0; d < D; d += 2) std::memcpy(qp + (d / 2) * LD + i * G + g, src + d, sizeof(int32_t));
          } else {
            for (int64_t d = 0; d < D; ++d) qt[d * LD + i * G + g] = static_cast<float>(src[d]) * scale;
          }
        }
      for (int64_t r = 0; r < LD; ++r) lim[r] = static_cast<float>(past + it.i0 + std::min(r / G, nq - 1));
      std::fill(o.begin(), o.begin() + R * D, 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t n_keys = past + it.i0 + nq;  // keys seen by the tile's last query token
      for (int64_t j0 = 0; j0 < n_keys; j0 += kKT) {
        const int64_t nk = std::min(kKT, n_keys - j0);
        if constexpr (DP) {
#if defined(__AVX512BF16__)
          for (int64_t j = 0; j < nk; ++j) kr[j] = row(it.s, it.h, j0 + j);
          const Pair* qp = reinterpret_cast<const Pair*>(qt.data());
          switch (NRV) {
            case 1: score_tiles_dp<1>(qp, LD, kr.data(), nk, D, sc.data()); break;
            case 2: score_tiles_dp<2>(qp, LD, kr.data(), nk, D, sc.data()); break;
            case 3: score_tiles_dp<3>(qp, LD, kr.data(), nk, D, sc.data()); break;
            default: score_tiles_dp<4>(qp, LD, kr.data(), nk, D, sc.data()); break;
          }
#endif
        } else if (in_place) {
          for (int64_t j = 0; j < nk; ++j) {
            const T* kr_ = row(it.s, it.h, j0 + j);
            float* kt = tile.data() + j * D;
            float* vt = tile.data() + (kKT + j) * D;
            for (int c = 0; c < C; ++c) {
              load_f32<T>(kr_ + c * V).store(kt + c * V);
              load_f32<T>(kr_ + v_offset + c * V).store(vt + c * V);
            }
            kp[j] = kt;
            vp[j] = vt;
          }
        } else {
          const float* vf = kf + ctx[it.s] * D;
          for (int64_t j = 0; j < nk; ++j) { kp[j] = kf + (j0 + j) * D; vp[j] = vf + (j0 + j) * D; }
        }
        if constexpr (!DP) {
          switch (NRV) {
            case 1: score_tiles<1>(qt.data(), LD, kp.data(), nk, D, sc.data()); break;
            case 2: score_tiles<2>(qt.data(), LD, kp.data(), nk, D, sc.data()); break;
            case 3: score_tiles<3>(qt.data(), LD, kp.data(), nk, D, sc.data()); break;
            default: score_tiles<4>(qt.data(), LD, kp.data(), nk, D, sc.data()); break;
          }
        }
        // causal mask where a tile reaches past the first row's position; online softmax per row
        const bool masked = j0 + nk - 1 > past + it.i0;
        for (int64_t c = 0; c < NRV; ++c) {
          const Vec lim_c = Vec::loadu(lim.data() + c * V);
          Vec mx = Vec::loadu(m.data() + c * V);
          for (int64_t j = 0; j < nk; ++j) {
            Vec sj = Vec::loadu(sc.data() + j * LD + c * V);
            if (DP) sj = sj * Vec(scale);
            if (masked) sj = Vec::blendv(Vec(-std::numeric_limits<float>::infinity()), sj, Vec(static_cast<float>(j0 + j)) <= lim_c);
            if (DP || masked) sj.store(sc.data() + j * LD + c * V);
            mx = at::vec::maximum(mx, sj);
          }
          const Vec corr = (Vec::loadu(m.data() + c * V) - mx).exp();
          Vec sum(0.f);
          for (int64_t j = 0; j < nk; ++j) {
            const Vec p = (Vec::loadu(sc.data() + j * LD + c * V) - mx).exp();
            p.store(sc.data() + j * LD + c * V);
            sum = sum + p;
          }
          (Vec::loadu(l.data() + c * V) * corr + sum).store(l.data() + c * V);
          mx.store(m.data() + c * V);
          if (j0 > 0) {
            float cf[V];
            corr.store(cf);
            for (int64_t rr = 0; rr < V && c * V + rr < R; ++rr) {
              float* orow = o.data() + (c * V + rr) * D;
              for (int cc = 0; cc < C; ++cc) (Vec::loadu(orow + cc * V) * Vec(cf[rr])).store(orow + cc * V);
            }
          }
        }
        if constexpr (DP) {
#if defined(__AVX512BF16__)
          Pair* ppp = reinterpret_cast<Pair*>(pp.data());
          const int64_t pairs = (nk + 1) / 2;
          for (int64_t jp = 0; jp < pairs; ++jp)
            for (int64_t c = 0; c < NRV; ++c) {
              const __m512 p0 = _mm512_loadu_ps(sc.data() + 2 * jp * LD + c * V);
              const __m512 p1 = 2 * jp + 1 < nk ? _mm512_loadu_ps(sc.data() + (2 * jp + 1) * LD + c * V) : _mm512_setzero_ps();
              _mm512_storeu_si512(ppp + jp * LD + c * V, bf16_pairs(p0, p1));
            }
          const Pair* vpairs = reinterpret_cast<const Pair*>(kf) + (j0 / 2) * D;
          if (in_place) {
            Pair* vt = reinterpret_cast<Pair*>(tile.data());
            for (int64_t jp = 0; jp < pairs; ++jp) v_pairs(it.s, it.h, j0 + 2 * jp, vt + jp * D);
            vpairs = vt;
          }
          pv_tiles_dp<C>(ppp, LD, vpairs, pairs, R, o.data());
#endif
        } else {
          pv_tiles<C>(sc.data(), LD, vp.data(), nk, R, o.data());
        }
      }
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = i * G + g;
          T* dst = out + ((q_start[it.s] + it.i0 + i) * H + it.h * G + g) * D;
          const Vec inv(1.f / l[r]);
          for (int c = 0; c < C; ++c) store_t<T>(dst + c * V, Vec::loadu(o.data() + r * D + c * V) * inv);
        }
    }
  });
}

// A query tile holds at least one token's G heads: up to kRowVecs vectors of rows.
int64_t prefill_max_group() { return kRowVecs * Vec::size(); }

// q [T, H, D] (rows may be strided, e.g. a view of the qkv projection), kv [2, blocks, BS, KVH, D];
// per sequence: q_start, q_len, ctx (int64 [S]) and its block table row -> out [T, H, D] (rows of
// tokens outside the sequences are left unset).
at::Tensor paged_prefill(at::Tensor q, at::Tensor kv, at::Tensor table, at::Tensor q_start, at::Tensor q_len,
                            at::Tensor ctx, double scale) {
  NoGil no_gil;
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 5 && kv.size(0) == 2, "q [T, H, D], kv [2, blocks, block_size, kv_heads, D]");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q heads contiguous within a row");
  TORCH_CHECK(kv.is_contiguous() && table.is_contiguous() && q_start.is_contiguous() && q_len.is_contiguous() && ctx.is_contiguous(),
              "contiguous kv and tables");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type(), "q and kv dtypes differ");
  TORCH_CHECK(table.scalar_type() == at::kLong && q_start.scalar_type() == at::kLong && q_len.scalar_type() == at::kLong &&
              ctx.scalar_type() == at::kLong, "int64 tables");
  const int64_t S = q_start.size(0), H = q.size(1), D = q.size(2), KVH = kv.size(3), BS = kv.size(2);
  TORCH_CHECK(kv.size(4) == D && H % KVH == 0 && table.size(0) == S && q_len.size(0) == S && ctx.size(0) == S, "shape mismatch");
  TORCH_CHECK(H / KVH <= prefill_max_group(), "paged_prefill: more than ", prefill_max_group(), " query heads per KV head");
  const int64_t* qs = q_start.data_ptr<int64_t>();
  const int64_t* ql = q_len.data_ptr<int64_t>();
  const int64_t* cl = ctx.data_ptr<int64_t>();
  const int64_t* tb = table.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(ql[s] >= 1 && qs[s] >= 0 && qs[s] + ql[s] <= q.size(0) && cl[s] >= ql[s], "paged_prefill: sequence ", s,
                " has rows ", qs[s], "+", ql[s], " of ", q.size(0), " and context ", cl[s]);
    TORCH_CHECK((cl[s] + BS - 1) / BS <= table.size(1), "paged_prefill: sequence ", s, " has too few blocks");
    for (int64_t b = 0; b < (cl[s] + BS - 1) / BS; ++b)
      TORCH_CHECK(tb[s * table.size(1) + b] >= 0 && tb[s * table.size(1) + b] < kv.size(1), "paged_prefill: block id out of range");
  }
  auto out = at::empty({q.size(0), H, D}, q.options());
  by_dtype(q.scalar_type(), "paged_prefill", [&](auto tag) {
    using T = decltype(tag);
    by_head_vectors(D, "paged_prefill", [&](auto chunks) {
      prefill_kernel<T, decltype(chunks)::value>(q.data_ptr<T>(), q.stride(0), kv.data_ptr<T>(), kv.stride(0),
          table.data_ptr<int64_t>(), table.size(1), q_start.data_ptr<int64_t>(), q_len.data_ptr<int64_t>(),
          ctx.data_ptr<int64_t>(), out.data_ptr<T>(), S, H, KVH, BS, static_cast<float>(scale));
    });
  });
  return out;
}

// Decode rows through the prefill kernel: each sequence's one query token is a prompt chunk of one
// token, so a token's attention is bitwise the same whether it was decoded, computed in a prompt
// chunk of any length or recomputed after a preemption or a failure (what `paged_decode` cannot
// promise: its reduction order is its own). q [B, H, D] contiguous, the rest as paged_decode.
at::Tensor paged_decode_invariant(at::Tensor q, at::Tensor kv, at::Tensor table, at::Tensor ctx, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q [B, H, D], contiguous");
  const int64_t B = q.size(0);
  auto opts = ctx.options().dtype(at::kLong);
  at::Tensor start = at::empty({B}, opts), len = at::empty({B}, opts);
  for (int64_t b = 0; b < B; ++b) {
    start.data_ptr<int64_t>()[b] = b;
    len.data_ptr<int64_t>()[b] = 1;
  }
  return paged_prefill(q, kv, table, start, len, ctx, scale);
}
