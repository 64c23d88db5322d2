// Paged attention of query rows: prompt chunks (paged_prefill) and, batch-invariant, decode rows
// (paged_decode_invariant), reading K and V from the paged cache (a step's own K/V were written there
// by rope_write before the call). Sequence s has q_len[s] query tokens at rows q_start[s].. of q, the
// last of its ctx[s] cached tokens; query i sees keys 0 .. ctx - q_len + i.
//
// One row's arithmetic, whatever else the call holds. A row (one query token x one query head) is
// computed by `attend_rows` alone: keys in tiles of kKT starting at absolute key 0, scores with the
// tile's keys in vector lanes, an online softmax per tile, P V into float32 accumulators; nothing
// depends on the row's chunk, its place in the chunk, the other rows of its work item or the thread.
// Keys past a row's own position are -inf (probability exactly 0), so a token's output is bitwise the
// same computed as a decode row, in a prompt chunk of any length, or recomputed: decode rows are
// one-token chunks here (paged_decode_invariant), which is what makes the model batch-invariant.
//
// Per row and key tile:
// - scores: float32 (q pre-scaled, K widened): s_j = fma chain over d of k_j[d] * q[d]; bf16 on a CPU
//   with AVX512-BF16 (`kDp`): a vdpbf16ps chain over the head dims' pairs, then * scale;
// - online softmax: m' = max(m, s), c = exp(m - m'), p_j = exp(s_j - m'), l = l c + sum_j p_j with the
//   sum taken as lane partials over the tile's key groups (group 0, + group 1, ...) and then a fixed
//   tree over the lanes (`lane_sum`); keys masked or past the context add exact zeros;
// - P V: o = o c, then o[d] += p_j v_j[d] key by key (float32 FMAs), or (kDp) vdpbf16ps over key pairs
//   with p rounded to bf16 (as SDPA's math path rounds the softmax before P V);
// - out = o * (1 / l), rounded to the dtype.
// Work items are (sequence, KV head, up to kMaxRows rows of consecutive query tokens x the G query
// heads sharing the KV head): the item transposes each key tile's K once for all its rows (keys in
// lanes) and lays out its V (float32 rows, or bf16 pairs of keys), then runs its rows in blocks.
// Items are handed out largest first from a shared counter, so causal items of unequal cost balance.
#include "kernel_utils.h"

#include <atomic>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kKT = 64;        // keys per tile; tiles start at absolute keys 0, kKT, 2 kKT, ...
constexpr int64_t kMaxRows = 64;   // rows per work item (query heads x tokens)
constexpr int64_t V = Vec::size();
constexpr int64_t kGroups = kKT / V;  // key groups (one vector each) per tile
constexpr int kAccRegs = V >= 16 ? 24 : 12;  // accumulator registers of a row block: of AVX512's 32, AVX2's 16
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
constexpr bool kDpBf16 = true;
#else
constexpr bool kDpBf16 = false;
#endif

// The sum of v's V lanes by a fixed tree: halves added until one lane is left (lane i + lane i + 8,
// then + 4, + 2, + 1; the AVX-512 shuffles do exactly the scalar loop's additions).
inline float lane_sum(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 x = v;
  x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, 0xEE));
  x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, 0x01));
  x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x0E));
  x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x01));
  return _mm512_cvtss_f32(x);
#endif
  float a[V];
  v.store(a);
  for (int64_t n = V / 2; n >= 1; n /= 2)
    for (int64_t i = 0; i < n; ++i) a[i] = a[i] + a[i + n];
  return a[0];
}


template <typename T, int C>
struct Kernel {
  static constexpr int64_t D = C * V;
  static constexpr bool DP = kDpBf16 && std::is_same_v<T, at::BFloat16> && V == 16;  // the vdpbf16ps path
  static constexpr int64_t QW = DP ? D / 2 : D;  // 32-bit words of one query row (bf16 pairs or floats)
  // DP with head dims in 32s: V pairs are interleaved with unpacklo/hi (two instructions per 32 dims),
  // which leaves accumulator lane 4L + i of 32-dim chunk c holding dim 32c + 8L + i ("lo" vector) or
  // 32c + 8L + 4 + i ("hi"); the order is undone when the output is stored
  static constexpr bool kPermuted = DP && C % 2 == 0;

  const T* q; int64_t q_row_stride; const T* kv; int64_t v_offset; const int64_t* table; int64_t max_blocks;
  const int64_t* q_start; const int64_t* q_len; const int64_t* ctx; T* out;
  int64_t S, H, KVH, BS; float scale;

  int64_t G() const { return H / KVH; }
  const T* key(int64_t s, int64_t h, int64_t t) const {  // token t's K row of sequence s, KV head h
    return kv + table[s * max_blocks + t / BS] * BS * KVH * D + (t % BS) * KVH * D + h * D;
  }

  // Per-thread buffers of one work item.
  struct Scratch {
    std::vector<uint32_t> qw;   // [rows][QW]: pre-scaled float queries, or bf16 pairs (unscaled)
    std::vector<uint32_t> kt;   // [QW][kKT]: the tile's K, keys in lanes (floats or bf16 pairs)
    std::vector<float> vt;      // [kKT][D] float V rows, or (DP) [kKT / 2][D] bf16 pairs of keys
    std::vector<float> kf;      // [V][D]: a key group's K widened to float (non-DP, T not float)
    std::vector<uint32_t> zero; // a zero row (keys past the tile's end)
    std::vector<float> o, m, l, p, mn, corr;  // [rows][D] accumulators, [rows] max and sum, [rows][kKT]
                                              // probabilities, [rows] the tile's new max and correction
    Scratch() : qw(kMaxRows * QW), kt(QW * kKT), vt(kKT * D), kf(V * D), zero(D), o(kMaxRows * D), m(kMaxRows),
                l(kMaxRows), p(kMaxRows * kKT), mn(kMaxRows), corr(kMaxRows) {}
  };

  // Lays out keys j0 .. j0 + nk of (s, h): K transposed into kt, V into vt.
  void load_tile(Scratch& sc, int64_t s, int64_t h, int64_t j0, int64_t nk) const {
    const int64_t groups = (nk + V - 1) / V;
    for (int64_t g = 0; g < groups; ++g) {
      const uint32_t* rows[V];
      for (int64_t j = 0; j < V; ++j) {
        const int64_t t = j0 + g * V + j;
        if (t >= j0 + nk) { rows[j] = sc.zero.data(); continue; }
        if constexpr (DP || std::is_same_v<T, float>) {
          rows[j] = reinterpret_cast<const uint32_t*>(key(s, h, t));
        } else {
          float* f = sc.kf.data() + j * D;
          for (int c = 0; c < C; ++c) load_f32<T>(key(s, h, t) + c * V).store(f + c * V);
          rows[j] = reinterpret_cast<const uint32_t*>(f);
        }
      }
      transpose_rows(rows, QW, sc.kt.data() + g * V, kKT);
    }
    if constexpr (DP) {
#if defined(__AVX512BF16__)
      Pair* vp = reinterpret_cast<Pair*>(sc.vt.data());
      for (int64_t t = 0; t < nk; t += 2) {  // keys (t, t + 1) -> one pair per head dim; a missing key is 0
        const T* v0 = key(s, h, j0 + t) + v_offset;
        const T* v1 = t + 1 < nk ? key(s, h, j0 + t + 1) + v_offset : reinterpret_cast<const T*>(sc.zero.data());
        if constexpr (kPermuted) {
          for (int c = 0; c < C; c += 2) {
            const __m512i x = _mm512_loadu_si512(v0 + c * V), y = _mm512_loadu_si512(v1 + c * V);
            _mm512_storeu_si512(vp + (t / 2) * D + c * V, _mm512_unpacklo_epi16(x, y));
            _mm512_storeu_si512(vp + (t / 2) * D + (c + 1) * V, _mm512_unpackhi_epi16(x, y));
          }
          continue;
        }
        for (int c = 0; c < C; ++c) {
          const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + c * V)));
          const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + c * V)));
          _mm512_storeu_si512(vp + (t / 2) * D + c * V, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
      }
#endif
    } else {
      for (int64_t t = 0; t < nk; ++t) {
        const T* vr = key(s, h, j0 + t) + v_offset;
        for (int c = 0; c < C; ++c) load_f32<T>(vr + c * V).store(sc.vt.data() + t * D + c * V);
      }
    }
  }

  // Scores of rows r0 .. r0 + RB (keys in lanes, `groups` vectors each) into p, unmasked.
  template <int RB>
  void scores(Scratch& sc, int64_t r0, int64_t groups) const {
    Vec acc[RB][kGroups];
    for (int r = 0; r < RB; ++r)
      for (int g = 0; g < kGroups; ++g) acc[r][g] = Vec(0.f);
    for (int64_t w = 0; w < QW; ++w) {
      const uint32_t* kw = sc.kt.data() + w * kKT;
      if constexpr (DP) {
#if defined(__AVX512BF16__)
        __m512bh kg[kGroups];
        for (int g = 0; g < kGroups; ++g) kg[g] = (__m512bh)_mm512_loadu_si512(kw + g * V);
        for (int r = 0; r < RB; ++r) {
          const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(sc.qw[(r0 + r) * QW + w]));
          for (int g = 0; g < kGroups; ++g)
            if (g < groups) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], qb, kg[g]);
        }
#endif
      } else {
        for (int r = 0; r < RB; ++r) {
          float qf;
          std::memcpy(&qf, &sc.qw[(r0 + r) * QW + w], sizeof(float));
          const Vec qb(qf);
          for (int g = 0; g < kGroups; ++g)
            if (g < groups) acc[r][g] = at::vec::fmadd(Vec::loadu(reinterpret_cast<const float*>(kw + g * V)), qb, acc[r][g]);
        }
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int g = 0; g < kGroups; ++g)
        if (g < groups) (DP ? acc[r][g] * Vec(scale) : acc[r][g]).store(sc.p.data() + (r0 + r) * kKT + g * V);
  }

  // P V of rows r0 .. r0 + RB over the tile's nk keys, into o (already scaled by the correction).
  template <int RB>
  void pv(Scratch& sc, int64_t r0, int64_t nk) const {
    Vec acc[RB][C];  // o * the row's correction (for the first tile o is 0 and the correction 0 too)
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = Vec::loadu(sc.o.data() + (r0 + r) * D + c * V) * Vec(sc.corr[r0 + r]);
    if constexpr (DP) {
#if defined(__AVX512BF16__)
      const Pair* vp = reinterpret_cast<const Pair*>(sc.vt.data());
      alignas(64) Pair pp[RB][kKT / 2];
      for (int r = 0; r < RB; ++r)  // the probabilities as bf16 pairs (keys 2i, 2i + 1), rounded to nearest even
        for (int64_t g = 0; g < kGroups; g += 2)
          _mm512_storeu_si512(pp[r] + g * V / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(sc.p.data() + (r0 + r) * kKT + (g + 1) * V),
                                                                              _mm512_loadu_ps(sc.p.data() + (r0 + r) * kKT + g * V)));
      for (int64_t jp = 0; jp < (nk + 1) / 2; ++jp) {
        __m512bh vj[C];
        for (int c = 0; c < C; ++c) vj[c] = (__m512bh)_mm512_loadu_si512(vp + jp * D + c * V);
        for (int r = 0; r < RB; ++r) {
          const __m512bh pr = (__m512bh)_mm512_set1_epi32(pp[r][jp]);
          for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pr, vj[c]);
        }
      }
#endif
    } else {
      for (int64_t j = 0; j < nk; ++j) {
        Vec vj[C];
        for (int c = 0; c < C; ++c) vj[c] = Vec::loadu(sc.vt.data() + j * D + c * V);
        for (int r = 0; r < RB; ++r) {
          const Vec pr(sc.p[(r0 + r) * kKT + j]);
          for (int c = 0; c < C; ++c) acc[r][c] = at::vec::fmadd(pr, vj[c], acc[r][c]);
        }
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < C; ++c) acc[r][c].store(sc.o.data() + (r0 + r) * D + c * V);
  }

  template <int RB, typename F>
  static void in_blocks(int64_t R, F f) {  // f(std::integral_constant<int, rb>, r0) over rows [0, R)
    int64_t r = 0;
    for (; r + RB <= R; r += RB) f(std::integral_constant<int, RB>{}, r);
    for (; r < R; ++r) f(std::integral_constant<int, 1>{}, r);
  }

  // One work item: rows (token it_i0 + i, head h * G + g) -> out.
  void item(Scratch& sc, int64_t s, int64_t h, int64_t i0, int64_t nq) const {
    const int64_t G_ = G(), R = nq * G_, past = ctx[s] - q_len[s];
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t g = 0; g < G_; ++g) {
        const T* src = q + (q_start[s] + i0 + i) * q_row_stride + (h * G_ + g) * D;
        uint32_t* dst = sc.qw.data() + (i * G_ + g) * QW;
        if constexpr (DP) {
          std::memcpy(dst, src, D * sizeof(T));
        } else {
          for (int64_t d = 0; d < D; ++d) {
            const float x = static_cast<float>(src[d]) * scale;
            std::memcpy(dst + d, &x, sizeof(float));
          }
        }
      }
    std::fill(sc.o.begin(), sc.o.begin() + R * D, 0.f);
    std::fill(sc.m.begin(), sc.m.begin() + R, kNegInf);
    std::fill(sc.l.begin(), sc.l.begin() + R, 0.f);
    const int64_t n_keys = past + i0 + nq;  // keys seen by the item's last token
    constexpr int kScoreRows = std::max(1, kAccRegs / static_cast<int>(kGroups));
    constexpr int kPvRows = std::max(1, kAccRegs / C);
    for (int64_t j0 = 0; j0 < n_keys; j0 += kKT) {
      const int64_t nk = std::min(kKT, n_keys - j0), groups = (nk + V - 1) / V;
      load_tile(sc, s, h, j0, nk);
      in_blocks<kScoreRows>(R, [&](auto rb, int64_t r0) { scores<decltype(rb)::value>(sc, r0, groups); });
      // the online softmax: each row's mask and new max, the rows' corrections exp(m - m') in vectors
      // of rows (the same exp, lane by lane), then each row's probabilities and sum
      for (int64_t r = 0; r < R; ++r) {
        float* p = sc.p.data() + r * kKT;
        const int64_t lim = past + i0 + r / G_;  // the row's last key
        for (int64_t j = std::max<int64_t>(0, lim + 1 - j0); j < groups * V; ++j) p[j] = kNegInf;
        Vec mx(sc.m[r]);
        for (int64_t g = 0; g < groups; ++g) mx = at::vec::maximum(mx, Vec::loadu(p + g * V));
        sc.mn[r] = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, mx);
      }
      for (int64_t r = 0; r < R; r += V)
        (Vec::loadu(sc.m.data() + r) - Vec::loadu(sc.mn.data() + r)).exp().store(sc.corr.data() + r);
      for (int64_t r = 0; r < R; ++r) {
        float* p = sc.p.data() + r * kKT;
        const float mv = sc.mn[r];
        Vec part(0.f);
        for (int64_t g = 0; g < groups; ++g) {
          const Vec e = (Vec::loadu(p + g * V) - Vec(mv)).exp();
          e.store(p + g * V);
          part = part + e;
        }
        for (int64_t j = groups * V; j < kKT; ++j) p[j] = 0.f;
        sc.l[r] = sc.l[r] * sc.corr[r] + lane_sum(part);
        sc.m[r] = mv;
      }
      in_blocks<kPvRows>(R, [&](auto rb, int64_t r0) { pv<decltype(rb)::value>(sc, r0, nk); });
    }
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t g = 0; g < G_; ++g) {
        const int64_t r = i * G_ + g;
        T* dst = out + ((q_start[s] + i0 + i) * H + h * G_ + g) * D;
        const Vec inv(1.f / sc.l[r]);
        const float* o = sc.o.data() + r * D;
        if constexpr (kPermuted) {
          alignas(64) float y[D];
          for (int c = 0; c < C; c += 2) {  // lanes back in head-dim order (see kPermuted)
            float lo[V], hi[V];
            (Vec::loadu(o + c * V) * inv).store(lo);
            (Vec::loadu(o + (c + 1) * V) * inv).store(hi);
            for (int L = 0; L < 4; ++L)
              for (int i = 0; i < 4; ++i) {
                y[c * V + 8 * L + i] = lo[4 * L + i];
                y[c * V + 8 * L + 4 + i] = hi[4 * L + i];
              }
          }
          for (int c = 0; c < C; ++c) store_t<T>(dst + c * V, Vec::loadu(y + c * V));
        } else {
          for (int c = 0; c < C; ++c) store_t<T>(dst + c * V, Vec::loadu(o + c * V) * inv);
        }
      }
  }

  void run() const {
    const int64_t QT = std::max<int64_t>(1, kMaxRows / G());  // query tokens per item
    struct Item { int64_t s, h, i0, nq, cost; };
    std::vector<Item> items;
    for (int64_t s = 0; s < S; ++s)
      for (int64_t i0 = 0; i0 < q_len[s]; i0 += QT) {
        const int64_t nq = std::min(QT, q_len[s] - i0), keys = ctx[s] - q_len[s] + i0 + nq;
        for (int64_t h = 0; h < KVH; ++h) items.push_back({s, h, i0, nq, keys * nq});
      }
    std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
    std::atomic<int64_t> next{0};
    const int64_t n_items = items.size();
    at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n_items), 1, [&](int64_t, int64_t) {
      Scratch sc;
      for (int64_t w = next++; w < n_items; w = next++) item(sc, items[w].s, items[w].h, items[w].i0, items[w].nq);
    });
  }
};

}  // namespace

// An item holds at least one token's G query heads.
int64_t prefill_max_group() { return kMaxRows; }

// q [T, H, D] (rows may be strided, e.g. a view of the qkv projection), kv [2, blocks, BS, KVH, D];
// per sequence: q_start, q_len, ctx (int64 [S]) and its block table row -> out [T, H, D] (rows of
// tokens outside the sequences are left unset).
at::Tensor paged_prefill(at::Tensor q, at::Tensor kv, at::Tensor table, at::Tensor q_start, at::Tensor q_len,
                         at::Tensor ctx, double scale) {
  NoGil no_gil;
  check_prompt_chunks("paged_prefill", q, kv, table, q_start, q_len, ctx);
  const int64_t S = q_start.size(0), H = q.size(1), D = q.size(2), KVH = kv.size(3), BS = kv.size(2);
  TORCH_CHECK(H / KVH <= prefill_max_group(), "paged_prefill: more than ", prefill_max_group(), " query heads per KV head");
  const int64_t* qs = q_start.data_ptr<int64_t>();
  const int64_t* ql = q_len.data_ptr<int64_t>();
  const int64_t* cl = ctx.data_ptr<int64_t>();
  auto out = at::empty({q.size(0), H, D}, q.options());
  by_dtype(q.scalar_type(), "paged_prefill", [&](auto tag) {
    using T = decltype(tag);
    by_head_vectors(D, "paged_prefill", [&](auto chunks) {
      Kernel<T, decltype(chunks)::value>{q.data_ptr<T>(), q.stride(0), kv.data_ptr<T>(), kv.stride(0),
          table.data_ptr<int64_t>(), table.size(1), qs, ql, cl, out.data_ptr<T>(), S, H, KVH, BS,
          static_cast<float>(scale)}.run();
    });
  });
  return out;
}

// Decode rows through the same kernel: each sequence's one query token is a prompt chunk of one
// token, so a token's attention is bitwise the same whether it was decoded, computed in a prompt
// chunk of any length or recomputed after a preemption or a failure (what `paged_decode`, with its
// own reduction order, cannot promise). q [B, H, D] contiguous, the rest as paged_decode.
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
