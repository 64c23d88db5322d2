// Fast-path attention of prompt chunks on AMX tiles (bf16), K and V read in place from the paged cache:
// the same contract as paged_prefill (prefill_attention.cpp), but NOT batch-invariant: a row's
// blocking depends on where it sits in its chunk, so the model takes it only when not deterministic.
//
// Flash attention per work item (sequence, KV head, up to kQT query tokens): the item's rows are the
// G query heads sharing the KV head x its tokens, as A tiles of 16 consecutive tokens of one head.
// Keys go in blocks of kKB = 32 from absolute key 0; per block the item packs K into AMX's B layout
// (for each k step of 32 head dims: 16 pairs of dims x 16 keys, a 32-bit transpose) and V into B
// tiles of 16 key pairs x 16 head dims (two key rows interleaved), once for all its row tiles. Per
// row tile and key block: S = Q K^T by TDPBF16PS into two 16 x 16 float32 tiles; the online softmax
// in float32 with AVX-512 (the causal mask only where the block crosses the tile's diagonal, blocks
// past the tile's last row skipped; a vectorised exp2); P rounded to bf16 as one A tile (16 rows x
// 32 keys); O += P V by TDPBF16PS over O kept in float32 in the item's scratch (tiles loaded, updated,
// stored; rows rescaled with AVX-512 only where their max moved). out = O / l, rounded to bf16.
// Row tiles are software-pipelined: the next tile's scores are issued before this tile's softmax, on
// tile registers P V does not use, so AMX products overlap AVX-512 work (measured ~10% faster than
// scores, softmax, P V in turn; three phases over all row tiles of a block were ~20% slower).
// Items are handed out from a shared counter, those of one (sequence, KV head) in a row, largest first.
#include "kernel_utils.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
#define KVFLOW_AMX_ATTENTION 1
#endif

namespace {

constexpr int64_t kMaxG = 16;  // query heads per KV head

#ifdef KVFLOW_AMX_ATTENTION
constexpr int64_t kMaxTiles = kMaxG * 2;  // row tiles of an item
constexpr int64_t kQT = 32;  // query tokens per work item (two row tiles per query head; 64 measured no better)
constexpr int64_t kKB = 32;  // keys per block (two 16-key score tiles; one P tile of 32 keys)

struct alignas(64) TileConfig {  // 8 tiles of 16 rows x 64 bytes
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() { for (int t = 0; t < 8; ++t) { rows[t] = 16; colsb[t] = 64; } }
};

// 2^y lane by lane for y <= 0 (lanes outside `keep`: exactly 0): 2^round(y) (scalef) times a degree-4
// polynomial of 2^f, f = y - round(y) in [-0.5, 0.5] (relative error < 5e-5: P is rounded to bf16,
// 4e-3, anyway). Clamp: y may be -inf (a running max not yet set), which would make f NaN.
template <bool Clamp = false>
inline __m512 exp2_neg(__m512 y, __mmask16 keep) {
  if constexpr (Clamp) y = _mm512_max_ps(y, _mm512_set1_ps(-100.f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(9.6181291076284772e-3f);  // ln2^k / k!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022650695910071f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69314718055994531f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

// The 16 vectors' maxima, lane r holding v[r]'s: halves of pairs of vectors maxed together, four
// times (46 instructions; sixteen horizontal reductions take ~150).
inline __m512 lane_max16(const __m512* v) {
  __m512 w[8], u[4], t[2];
  for (int k = 0; k < 8; ++k)  // lanes 0-7: v[2k]'s 8 partial maxima, 8-15: v[2k + 1]'s
    w[k] = _mm512_max_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44), _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  for (int k = 0; k < 4; ++k)  // 128-bit lane j: 4 partial maxima of v[4k + j]
    u[k] = _mm512_max_ps(_mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0x88), _mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0xDD));
  for (int k = 0; k < 2; ++k)  // lane L: v[8k + L]'s 2 partials, then v[8k + 4 + L]'s
    t[k] = _mm512_max_ps(_mm512_shuffle_ps(u[2 * k], u[2 * k + 1], 0x44), _mm512_shuffle_ps(u[2 * k], u[2 * k + 1], 0xEE));
  // lane 4L + j: the maximum of v[4j + L]
  const __m512 r = _mm512_max_ps(_mm512_shuffle_ps(t[0], t[1], 0x88), _mm512_shuffle_ps(t[0], t[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

inline __mmask16 first_lanes(int64_t n) {  // lanes [0, n) of 16, n clamped to [0, 16]
  return n <= 0 ? 0 : n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
}

template <typename P>
struct Aligned {  // a 64-byte aligned buffer
  std::unique_ptr<P, decltype(&std::free)> ptr{nullptr, &std::free};
  explicit Aligned(size_t n) : ptr(static_cast<P*>(std::aligned_alloc(64, (n * sizeof(P) + 63) / 64 * 64)), &std::free) {
    TORCH_CHECK(ptr, "paged_prefill_amx: out of memory");
  }
  P* get() const { return ptr.get(); }
};

using bf16 = at::BFloat16;

struct AmxAttention {
  const bf16* q; int64_t q_row_stride; const bf16* kv; int64_t v_offset; const int64_t* table; int64_t max_blocks;
  const int64_t* q_start; const int64_t* q_len; const int64_t* ctx; bf16* out;
  int64_t S, H, KVH, BS, D; float scale;

  int64_t G() const { return H / KVH; }
  const bf16* key(int64_t s, int64_t h, int64_t t) const {  // token t's K row of sequence s, KV head h
    return kv + (table[s * max_blocks + t / BS] * BS + t % BS) * KVH * D + h * D;
  }

  struct Scratch {
    Aligned<bf16> qt;       // [row tiles][16][D]: the item's queries (zero rows past its tokens)
    Aligned<uint32_t> kt;   // [2 key halves][D / 2 dim pairs][16 keys]: the block's K, B tiles
    Aligned<uint32_t> vt;   // [D / 16 dim tiles][16 key pairs][16 dims]: the block's V, B tiles
    Aligned<float> s;       // [2][16][kKB] scores of two row tiles
    Aligned<bf16> p;        // [2][16][kKB] their probabilities, A tiles
    Aligned<float> o;       // [row tiles][16][D] output accumulators
    Aligned<float> m, l;    // [row tiles][16] running max (raw scores), [row tiles][16][16] sum partials
    Aligned<uint32_t> zero; // a zero row (keys past the context)
    explicit Scratch(int64_t tiles, int64_t D)
        : qt(tiles * 16 * D), kt(2 * (D / 2) * 16), vt((D / 16) * 256), s(2 * 16 * kKB), p(2 * 16 * kKB), o(tiles * 16 * D),
          m(tiles * 16), l(tiles * 256), zero(D) { std::memset(zero.get(), 0, D * sizeof(uint32_t)); }
  };

  // K and V of keys j0 .. j0 + nk (nk <= kKB) of (s, h) into the block's B tiles; keys past nk are zero.
  void pack(Scratch& sc, int64_t s, int64_t h, int64_t j0, int64_t nk) const {
    const uint32_t* rows[16];
    for (int half = 0; half < 2; ++half) {
      for (int j = 0; j < 16; ++j) {
        const int64_t t = half * 16 + j;
        rows[j] = t < nk ? reinterpret_cast<const uint32_t*>(key(s, h, j0 + t)) : sc.zero.get();
      }
      transpose_rows(rows, D / 2, sc.kt.get() + half * (D / 2) * 16, 16);
    }
    const bf16* zero = reinterpret_cast<const bf16*>(sc.zero.get());
    for (int64_t pr = 0; pr < kKB / 2; ++pr) {
      const bf16* v0 = 2 * pr < nk ? key(s, h, j0 + 2 * pr) + v_offset : zero;
      const bf16* v1 = 2 * pr + 1 < nk ? key(s, h, j0 + 2 * pr + 1) + v_offset : zero;
      for (int64_t n = 0; n < D / 16; ++n) {
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + n * 16)));
        const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + n * 16)));
        _mm512_store_si512(sc.vt.get() + n * 256 + pr * 16, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    }
  }

  // S = Q K^T of row tile rt against the packed block into st ([16][kKB] float32). Tiles 0-4.
  void scores(Scratch& sc, int64_t rt, float* st) const {
    const bf16* qa = sc.qt.get() + rt * 16 * D;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t ks = 0; ks < D / 32; ++ks) {
      _tile_loadd(2, qa + ks * 32, D * 2);
      _tile_loadd(3, sc.kt.get() + ks * 256, 64);
      _tile_loadd(4, sc.kt.get() + (D / 2) * 16 + ks * 256, 64);
      _tile_dpbf16ps(0, 2, 3);
      _tile_dpbf16ps(1, 2, 4);
    }
    _tile_stored(0, st, kKB * 4);
    _tile_stored(1, st + 16, kKB * 4);
  }

  // O += P V of row tile rt, P in pt ([16][kKB] bf16). Tiles 5-7, none of scores' (so the next row
  // tile's scores need not wait for this one's P V).
  void pv(Scratch& sc, int64_t rt, const bf16* pt) const {
    float* o = sc.o.get() + rt * 16 * D;
    _tile_loadd(7, pt, kKB * 2);
    for (int64_t c = 0; c < D / 16; ++c) {
      _tile_loadd(5, o + c * 16, D * 4);
      _tile_loadd(6, sc.vt.get() + c * 256, 64);
      _tile_dpbf16ps(5, 7, 6);
      _tile_stored(5, o + c * 16, D * 4);
    }
  }

  // The online softmax of row tile rt (16 tokens, `valid` of them real; `lim0`: its first row's last
  // key) over its scores st of the block from key j0: m, l and O rescaled, P into pt as bf16.
  void softmax(Scratch& sc, int64_t rt, const float* st, bf16* pt, int64_t j0, int64_t lim0, int64_t valid) const {
    const float c = scale * 1.44269504088896341f;  // exp(x scale) = 2^(x c)
    const bool masked = j0 + kKB - 1 > lim0;
    float* m = sc.m.get() + rt * 16;
    float* l = sc.l.get() + rt * 256;
    float* o = sc.o.get() + rt * 16 * D;
    alignas(64) float mnew[16];
    __mmask16 ka[16], kb[16];
    __m512 rowmax[16];
    for (int r = 0; r < 16; ++r) {
      if (masked) {
        const int64_t keys = lim0 + std::min<int64_t>(r, valid - 1) + 1 - j0;  // visible keys of the block
        ka[r] = first_lanes(keys);
        kb[r] = first_lanes(keys - 16);
      } else {
        ka[r] = kb[r] = 0xFFFF;
      }
      const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      const __m512 a = _mm512_mask_load_ps(ninf, ka[r], st + r * kKB), b = _mm512_mask_load_ps(ninf, kb[r], st + r * kKB + 16);
      rowmax[r] = _mm512_max_ps(a, b);
    }
    const __m512 mold = _mm512_load_ps(m), mn = _mm512_max_ps(mold, lane_max16(rowmax));
    _mm512_store_ps(mnew, mn);
    alignas(64) float corr[16];
    _mm512_store_ps(corr, exp2_neg<true>(_mm512_mul_ps(_mm512_sub_ps(mold, mn), _mm512_set1_ps(c)), 0xFFFF));
    const __mmask16 moved = _mm512_cmp_ps_mask(mn, mold, _CMP_NEQ_OQ);
    _mm512_store_ps(m, mn);
    for (int r = 0; r < 16; ++r) {
      const __m512 off = _mm512_set1_ps(mnew[r] * c), cc = _mm512_set1_ps(c);
      const __m512 pa = exp2_neg(_mm512_fmsub_ps(_mm512_load_ps(st + r * kKB), cc, off), ka[r]);
      const __m512 pb = exp2_neg(_mm512_fmsub_ps(_mm512_load_ps(st + r * kKB + 16), cc, off), kb[r]);
      const __m512 cr = _mm512_set1_ps(corr[r]);
      _mm512_store_ps(l + r * 16, _mm512_fmadd_ps(_mm512_load_ps(l + r * 16), cr, _mm512_add_ps(pa, pb)));
      _mm512_store_si512(pt + r * kKB, (__m512i)_mm512_cvtne2ps_pbh(pb, pa));
      if (moved >> r & 1)
        for (int64_t d = 0; d < D; d += 16) _mm512_store_ps(o + r * D + d, _mm512_mul_ps(_mm512_load_ps(o + r * D + d), cr));
    }
  }

  // One work item: tokens i0 .. i0 + nq of sequence s, query heads h G .. h G + G.
  void item(Scratch& sc, int64_t s, int64_t h, int64_t i0, int64_t nq) const {
    const int64_t G_ = G(), halves = (nq + 15) / 16, tiles = G_ * halves, past = ctx[s] - q_len[s];
    for (int64_t g = 0; g < G_; ++g)
      for (int64_t hf = 0; hf < halves; ++hf) {
        bf16* dst = sc.qt.get() + (g * halves + hf) * 16 * D;
        for (int64_t r = 0; r < 16; ++r) {
          const int64_t i = hf * 16 + r;
          if (i < nq) std::memcpy(dst + r * D, q + (q_start[s] + i0 + i) * q_row_stride + (h * G_ + g) * D, D * 2);
          else std::memset(dst + r * D, 0, D * 2);
        }
      }
    std::fill(sc.o.get(), sc.o.get() + tiles * 16 * D, 0.f);
    std::fill(sc.m.get(), sc.m.get() + tiles * 16, -std::numeric_limits<float>::infinity());
    std::fill(sc.l.get(), sc.l.get() + tiles * 256, 0.f);
    const int64_t n_keys = past + i0 + nq;
    for (int64_t j0 = 0; j0 < n_keys; j0 += kKB) {
      pack(sc, s, h, j0, std::min(kKB, n_keys - j0));
      // the row tiles that see keys of the block, software-pipelined: the next tile's scores are issued
      // before this tile's softmax (AMX products overlapping AVX-512 work; buffers alternate)
      int64_t rts[kMaxTiles], lim0[kMaxTiles], valid[kMaxTiles], n = 0;
      for (int64_t hf = 0; hf < halves; ++hf) {
        const int64_t v = std::min<int64_t>(16, nq - hf * 16), l0 = past + i0 + hf * 16;
        if (j0 > l0 + v - 1) continue;  // past the tile's last row
        for (int64_t g = 0; g < G_; ++g) {
          rts[n] = g * halves + hf;
          lim0[n] = l0;
          valid[n++] = v;
        }
      }
      float* sbuf[2] = {sc.s.get(), sc.s.get() + 16 * kKB};
      bf16* pbuf[2] = {sc.p.get(), sc.p.get() + 16 * kKB};
      scores(sc, rts[0], sbuf[0]);
      for (int64_t i = 0; i < n; ++i) {
        if (i + 1 < n) scores(sc, rts[i + 1], sbuf[(i + 1) & 1]);
        softmax(sc, rts[i], sbuf[i & 1], pbuf[i & 1], j0, lim0[i], valid[i]);
        pv(sc, rts[i], pbuf[i & 1]);
      }
    }
    for (int64_t g = 0; g < G_; ++g)
      for (int64_t hf = 0; hf < halves; ++hf) {
        const int64_t rt = g * halves + hf;
        for (int64_t r = 0; r < std::min<int64_t>(16, nq - hf * 16); ++r) {
          const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_load_ps(sc.l.get() + rt * 256 + r * 16)));
          const float* o = sc.o.get() + (rt * 16 + r) * D;
          bf16* dst = out + ((q_start[s] + i0 + hf * 16 + r) * H + h * G_ + g) * D;
          for (int64_t d = 0; d < D; d += 16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(o + d), inv)));
        }
      }
  }

  void run() const {
    struct Item { int64_t s, h, i0, nq, cost; };
    std::vector<Item> items;
    for (int64_t s = 0; s < S; ++s)
      for (int64_t i0 = 0; i0 < q_len[s]; i0 += kQT) {
        const int64_t nq = std::min(kQT, q_len[s] - i0), keys = ctx[s] - q_len[s] + i0 + nq;
        for (int64_t h = 0; h < KVH; ++h) items.push_back({s, h, i0, nq, keys * nq});
      }
    // items of one (sequence, KV head) in a row, largest first, so its K/V stays in cache from item to
    // item (largest first over all items, as paged_prefill, measured 12% slower on 4 x 1,024 tokens at
    // one thread); the groups by their total cost, largest first
    std::vector<int64_t> group_cost(S * KVH, 0);
    for (const Item& it : items) group_cost[it.s * KVH + it.h] += it.cost;
    std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
      const int64_t ga = a.s * KVH + a.h, gb = b.s * KVH + b.h;
      if (ga != gb) return group_cost[ga] != group_cost[gb] ? group_cost[ga] > group_cost[gb] : ga < gb;
      return a.cost > b.cost;
    });
    std::atomic<int64_t> next{0};
    const int64_t n_items = items.size();
    at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n_items), 1, [&](int64_t, int64_t) {
      Scratch sc(G() * (kQT / 16), D);
      TileConfig cfg;
      _tile_loadconfig(&cfg);
      for (int64_t w = next++; w < n_items; w = next++) item(sc, items[w].s, items[w].h, items[w].i0, items[w].nq);
      _tile_release();
    });
  }
};
#endif

}  // namespace

bool prefill_amx_usable() {
#ifdef KVFLOW_AMX_ATTENTION
  return amx_usable();
#else
  return false;
#endif
}

// paged_prefill's contract (bf16 only, head_dim a multiple of 32 up to 256); writes into `out` when
// given (rows of tokens outside the sequences keep their values), else into a new tensor whose other
// rows are left unset.
at::Tensor paged_prefill_amx(at::Tensor q, at::Tensor kv, at::Tensor table, at::Tensor q_start, at::Tensor q_len,
                             at::Tensor ctx, double scale, std::optional<at::Tensor> out) {
  NoGil no_gil;
  TORCH_CHECK(prefill_amx_usable(), "paged_prefill_amx: no AMX on this CPU or build");
  check_prompt_chunks("paged_prefill_amx", q, kv, table, q_start, q_len, ctx);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16, "paged_prefill_amx: bf16 only");
  const int64_t S = q_start.size(0), H = q.size(1), D = q.size(2), KVH = kv.size(3), BS = kv.size(2);
  TORCH_CHECK(D % 32 == 0 && D <= 256, "paged_prefill_amx: head_dim ", D, " is not a multiple of 32 up to 256");
  TORCH_CHECK(H / KVH <= kMaxG, "paged_prefill_amx: more than ", kMaxG, " query heads per KV head");
  const int64_t* qs = q_start.data_ptr<int64_t>();
  const int64_t* ql = q_len.data_ptr<int64_t>();
  const int64_t* cl = ctx.data_ptr<int64_t>();
  const int64_t* tb = table.data_ptr<int64_t>();
  at::Tensor o = out.has_value() ? *out : at::empty({q.size(0), H, D}, q.options());
  TORCH_CHECK(o.is_contiguous() && o.scalar_type() == at::kBFloat16 && o.dim() == 3 && o.size(0) == q.size(0) &&
              o.size(1) == H && o.size(2) == D, "paged_prefill_amx: out must be a contiguous bf16 [T, H, D]");
#ifdef KVFLOW_AMX_ATTENTION
  AmxAttention{q.data_ptr<bf16>(), q.stride(0), kv.data_ptr<bf16>(), kv.stride(0), tb, table.size(1), qs, ql, cl,
               o.data_ptr<bf16>(), S, H, KVH, BS, D, static_cast<float>(scale)}.run();
#endif
  return o;
}
