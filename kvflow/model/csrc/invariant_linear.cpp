// A batch-invariant projection: y [M, N] = x [M, K] @ W [N, K]^T where every output element is one
// fixed chain of multiply-adds over k, whatever M is, wherever the row sits and however rows and
// columns are split over threads or register tiles. Row tiles, column panels and thread splits only
// decide which accumulators are live at once, never the order in which one accumulator is summed, so
// a row's result is bitwise the same alone or among 500 rows (GEMM libraries pick their blocking,
// sometimes their K split, by M: the reason this kernel exists). One ISA per machine and dtype, chosen
// once (`invariant_linear_isa`), for every M:
// - "amx-bf16" (bf16, a CPU with AMX): 16 x 16 float32 tiles accumulated by TDPBF16PS over k in steps
//   of 32 (zero-padded), rows padded to whole tiles (a padding row changes no other row);
// - "avx512-bf16" (bf16, AVX512-BF16 without AMX): VDPBF16PS, one bf16 pair of k per step;
// - "fma" (float32 and fp16 everywhere, bf16 elsewhere): float32 FMAs, one k per step, bf16/fp16
//   widened exactly as loaded.
// The weight is packed once, at load, into the ISA's panel layout (kvflow/model/linear.py,
// `pack_invariant`). Results are rounded once to the dtype at the end (round to nearest even).
#include "kernel_utils.h"

#include <ATen/ops/zeros.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

enum class Isa { kFma, kDpBf16, kAmx };

// KVFLOW_INVARIANT_ISA (read once) picks a slower ISA than the CPU's best, to test the paths of other
// CPUs on this one: "avx512-bf16" (no AMX) or "fma" (bf16 without native bf16); unset: the best.
Isa isa_for(at::ScalarType t) {
  static const std::string forced = [] { const char* e = std::getenv("KVFLOW_INVARIANT_ISA"); return std::string(e ? e : ""); }();
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
  if (t == at::kBFloat16 && forced != "fma") return amx_usable() && forced != "avx512-bf16" ? Isa::kAmx : Isa::kDpBf16;
#endif
  (void)t;
  return Isa::kFma;
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// ---- "fma": the packed weight is [N / V panels][K][V] (V = the float32 vector width, N padded with
// zero columns); y[m, n] = fma(x[m, k], w[n, k], acc) for k = 0 .. K - 1, from acc = 0.
constexpr int kFmaRows = Vec::size() >= 16 ? 6 : 4;  // register tile: rows x column vectors
constexpr int kFmaCols = Vec::size() >= 16 ? 4 : 2;

template <typename T, int MR, int NR>
void fma_tile(const T* x, int64_t K, const T* w, int64_t panel, float* out, int64_t ldo) {
  constexpr int64_t V = Vec::size();
  Vec acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = Vec(0.f);
  for (int64_t k = 0; k < K; ++k) {
    Vec b[NR];
    for (int n = 0; n < NR; ++n) b[n] = load_f32<T>(w + n * panel + k * V);
    for (int m = 0; m < MR; ++m) {
      const Vec a(static_cast<float>(x[m * K + k]));
      for (int n = 0; n < NR; ++n) acc[m][n] = at::vec::fmadd(a, b[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n].store(out + m * ldo + n * V);
}

template <typename T, int NR>
void fma_rows(const T* x, int64_t M, int64_t K, const T* w, int64_t panel, float* out, int64_t ldo) {
  int64_t m = 0;
  for (; m + kFmaRows <= M; m += kFmaRows) fma_tile<T, kFmaRows, NR>(x + m * K, K, w, panel, out + m * ldo, ldo);
  switch (M - m) {  // the last rows: a smaller tile, the same chain per element
    case 1: fma_tile<T, 1, NR>(x + m * K, K, w, panel, out + m * ldo, ldo); break;
    case 2: fma_tile<T, 2, NR>(x + m * K, K, w, panel, out + m * ldo, ldo); break;
    case 3: fma_tile<T, 3, NR>(x + m * K, K, w, panel, out + m * ldo, ldo); break;
    case 4: if constexpr (kFmaRows > 4) fma_tile<T, 4, NR>(x + m * K, K, w, panel, out + m * ldo, ldo); break;
    case 5: if constexpr (kFmaRows > 5) fma_tile<T, 5, NR>(x + m * K, K, w, panel, out + m * ldo, ldo); break;
    default: break;
  }
}

// Rows [0, M) x columns [n0, n0 + cols) of the float32 results in `acc` ([M][cols]) -> y [M, N] in T.
template <typename T>
void store_block(const float* acc, int64_t M, int64_t cols, T* y, int64_t N, int64_t n0) {
  const int64_t valid = std::min(cols, N - n0);
  for (int64_t m = 0; m < M; ++m) {
    const float* a = acc + m * cols;
    T* dst = y + m * N + n0;
    int64_t i = 0;
    if (valid == cols)
      for (; i + Vec::size() <= valid; i += Vec::size()) store_t<T>(dst + i, Vec::loadu(a + i));
    for (; i < valid; ++i) dst[i] = to_t<T>(a[i]);
  }
}

template <typename T>
void fma_linear(const T* x, int64_t M, int64_t K, const T* w, T* y, int64_t N) {
  constexpr int64_t V = Vec::size();
  const int64_t panels = round_up(N, V) / V, blocks = (panels + kFmaCols - 1) / kFmaCols;
  // rows are taken in chunks so the float32 block buffer stays small; a chunk boundary is a row boundary
  constexpr int64_t kChunk = 192;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(kChunk * kFmaCols * V);
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t p0 = blk * kFmaCols, np = std::min<int64_t>(kFmaCols, panels - p0), cols = np * V;
      const T* wp = w + p0 * K * V;
      for (int64_t m0 = 0; m0 < M; m0 += kChunk) {
        const int64_t mc = std::min(kChunk, M - m0);
        switch (np) {
          case 1: fma_rows<T, 1>(x + m0 * K, mc, K, wp, K * V, acc.data(), cols); break;
          case 2: fma_rows<T, 2>(x + m0 * K, mc, K, wp, K * V, acc.data(), cols); break;
          case 3: if constexpr (kFmaCols > 3) fma_rows<T, 3>(x + m0 * K, mc, K, wp, K * V, acc.data(), cols); break;
          default: if constexpr (kFmaCols > 3) fma_rows<T, kFmaCols>(x + m0 * K, mc, K, wp, K * V, acc.data(), cols); break;
        }
        store_block<T>(acc.data(), mc, cols, y + m0 * N, N, p0 * V);
      }
    }
  });
}

#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
// ---- "avx512-bf16" and "amx-bf16" share one packed layout: [N / 16 panels][K / 2 pairs][16 columns]
// of int32 bf16 pairs (k = 2p in the low half, 2p + 1 in the high), N padded to 32 and K to 32 with
// zeros: 16 consecutive pairs of a panel are one AMX B tile (16 rows x 64 bytes), one pair row is
// one VDPBF16PS operand.
constexpr int64_t kPanel = 16, kKStep = 32;

template <int MR, int NR>
void dp_tile(const at::BFloat16* x, int64_t ldx, int64_t pairs, const Pair* w, int64_t panel, float* out, int64_t ldo) {
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh b[NR];
    for (int n = 0; n < NR; ++n) b[n] = (__m512bh)_mm512_loadu_si512(w + n * panel + p * kPanel);
    for (int m = 0; m < MR; ++m) {
      Pair xp;
      std::memcpy(&xp, x + m * ldx + 2 * p, sizeof(Pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(xp);
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], a, b[n]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) _mm512_storeu_ps(out + m * ldo + n * kPanel, acc[m][n]);
}

template <int NR>
void dp_rows(const at::BFloat16* x, int64_t ldx, int64_t M, int64_t pairs, const Pair* w, int64_t panel, float* out, int64_t ldo) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) dp_tile<6, NR>(x + m * ldx, ldx, pairs, w, panel, out + m * ldo, ldo);
  switch (M - m) {
    case 1: dp_tile<1, NR>(x + m * ldx, ldx, pairs, w, panel, out + m * ldo, ldo); break;
    case 2: dp_tile<2, NR>(x + m * ldx, ldx, pairs, w, panel, out + m * ldo, ldo); break;
    case 3: dp_tile<3, NR>(x + m * ldx, ldx, pairs, w, panel, out + m * ldo, ldo); break;
    case 4: dp_tile<4, NR>(x + m * ldx, ldx, pairs, w, panel, out + m * ldo, ldo); break;
    case 5: dp_tile<5, NR>(x + m * ldx, ldx, pairs, w, panel, out + m * ldo, ldo); break;
    default: break;
  }
}

// x [M, ldx] with ldx >= 2 * pairs; `pairs` of k summed, of the `panel_pairs` a weight panel holds
// (the rest are zero padding); 4 panels (64 columns) per task.
void dp_linear(const at::BFloat16* x, int64_t ldx, int64_t M, int64_t pairs, const Pair* w, int64_t panel_pairs,
               at::BFloat16* y, int64_t N) {
  const int64_t panels = round_up(N, 2 * kPanel) / kPanel, blocks = (panels + 3) / 4;
  constexpr int64_t kChunk = 192;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(kChunk * 4 * kPanel);
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t p0 = blk * 4, np = std::min<int64_t>(4, panels - p0), cols = np * kPanel;
      const Pair* wp = w + p0 * panel_pairs * kPanel;
      for (int64_t m0 = 0; m0 < M; m0 += kChunk) {
        const int64_t mc = std::min(kChunk, M - m0);
        if (np == 4) dp_rows<4>(x + m0 * ldx, ldx, mc, pairs, wp, panel_pairs * kPanel, acc.data(), cols);
        else dp_rows<2>(x + m0 * ldx, ldx, mc, pairs, wp, panel_pairs * kPanel, acc.data(), cols);  // panels come in twos
        store_block<at::BFloat16>(acc.data(), mc, cols, y + m0 * N, N, p0 * kPanel);
      }
    }
  });
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
struct alignas(64) TileConfig {  // 8 tiles of 16 rows x 64 bytes
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() { for (int t = 0; t < 8; ++t) { rows[t] = 16; colsb[t] = 64; } }
};

// Tiles: C 0-3 (two row tiles x two column panels), A 4-5 (16 rows x 32 k), B 6-7 (16 pairs x 16 columns).
// x [rows, ldx] bf16 with ldx a multiple of 32 and zero columns past K, rows padded to 32 (zero rows).
void amx_linear(const at::BFloat16* x, int64_t ldx, int64_t M, int64_t Kp, const Pair* w, at::BFloat16* y, int64_t N) {
  const int64_t pairs = Kp / 2, steps = Kp / kKStep, blocks = round_up(N, 2 * kPanel) / (2 * kPanel);
  const int64_t mblocks = (M + 31) / 32;
  // rows in chunks of ~512 KB of x, so a chunk stays in L2 while every column block reads it
  const int64_t chunk = std::max<int64_t>(1, (512 << 10) / (32 * ldx * 2));
  for (int64_t mb0 = 0; mb0 < mblocks; mb0 += chunk)
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    TileConfig cfg;
    _tile_loadconfig(&cfg);
    alignas(64) float c[4][16][16];
    for (int64_t blk = begin; blk < end; ++blk) {
      const Pair* w0 = w + (2 * blk) * pairs * kPanel;
      const Pair* w1 = w0 + pairs * kPanel;
      for (int64_t mb = mb0; mb < std::min(mblocks, mb0 + chunk); ++mb) {
        const at::BFloat16* a0 = x + mb * 32 * ldx;
        const at::BFloat16* a1 = a0 + 16 * ldx;
        const bool two = mb * 32 + 16 < M;  // a second row tile holds rows
        _tile_zero(0); _tile_zero(1);
        if (two) { _tile_zero(2); _tile_zero(3); }
        if (two) {
          for (int64_t s = 0; s < steps; ++s) {  // each load issued as early as its tile is free
            _tile_loadd(4, a0 + s * kKStep, ldx * 2);
            _tile_loadd(6, w0 + s * 16 * kPanel, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, w1 + s * 16 * kPanel, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, a1 + s * kKStep, ldx * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        } else {
          for (int64_t s = 0; s < steps; ++s) {
            _tile_loadd(4, a0 + s * kKStep, ldx * 2);
            _tile_loadd(6, w0 + s * 16 * kPanel, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, w1 + s * 16 * kPanel, 64);
            _tile_dpbf16ps(1, 4, 7);
          }
        }
        _tile_stored(0, c[0], 64); _tile_stored(1, c[1], 64);
        if (two) { _tile_stored(2, c[2], 64); _tile_stored(3, c[3], 64); }
        for (int half = 0; half < (two ? 2 : 1); ++half) {
          const int64_t r0 = mb * 32 + 16 * half, rows = std::min<int64_t>(16, M - r0);
          for (int pn = 0; pn < 2; ++pn) {
            const int64_t n0 = (2 * blk + pn) * kPanel;
            if (n0 >= N) continue;
            store_block<at::BFloat16>(&c[2 * half + pn][0][0], rows, 16, y + r0 * N, N, n0);
          }
        }
      }
    }
    _tile_release();
  });
}
#endif

}  // namespace

// AMX needs the kernel's permission to use the tile state, once per process (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); refused (an old kernel, a CPU without AMX) -> no AMX.
bool amx_usable() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
#else
  return false;
#endif
}

std::string invariant_linear_isa(std::string dtype) {
  TORCH_CHECK(dtype == "float32" || dtype == "bfloat16" || dtype == "float16", "invariant_linear_isa: dtype ", dtype);
  switch (isa_for(dtype == "float32" ? at::kFloat : dtype == "bfloat16" ? at::kBFloat16 : at::kHalf)) {
    case Isa::kAmx: return "amx-bf16";
    case Isa::kDpBf16: return "avx512-bf16";
    default: return "fma";
  }
}

at::Tensor invariant_linear(at::Tensor x, at::Tensor packed, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && packed.is_contiguous(), "invariant_linear: x [M, K] contiguous");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "invariant_linear: x and the packed weight's dtypes differ");
  NoGil no_gil;
  const int64_t M = x.size(0), K = x.size(1);
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const Isa isa = isa_for(x.scalar_type());
  if (isa == Isa::kFma) {
    constexpr int64_t V = Vec::size();
    TORCH_CHECK(packed.dim() == 3 && packed.size(1) == K && packed.size(2) == V && packed.size(0) * V >= N,
                "invariant_linear: packed weight does not match x [", M, ", ", K, "] and N = ", N);
    by_dtype(x.scalar_type(), "invariant_linear", [&](auto tag) {
      using T = decltype(tag);
      fma_linear<T>(x.data_ptr<T>(), M, K, packed.data_ptr<T>(), y.data_ptr<T>(), N);
    });
    return y;
  }
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
  const int64_t Kp = round_up(K, kKStep);
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) == Kp / 2 && packed.size(2) == kPanel && packed.size(0) * kPanel >= N,
              "invariant_linear: packed weight does not match x [", M, ", ", K, "] and N = ", N);
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const Pair* wp = reinterpret_cast<const Pair*>(packed.data_ptr<at::BFloat16>());
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  if (isa == Isa::kDpBf16) {
    if (K % 2 == 0) {
      dp_linear(xp, K, M, K / 2, wp, Kp / 2, yp, N);
    } else {  // an odd K: rows copied with a zero column, so the last pair is whole
      auto xz = at::zeros({M, K + 1}, x.options());
      xz.narrow(1, 0, K).copy_(x);
      dp_linear(xz.data_ptr<at::BFloat16>(), K + 1, M, (K + 1) / 2, wp, Kp / 2, yp, N);
    }
    return y;
  }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  // full 32-row blocks straight from x where its rows are whole k steps; the last block (and every row
  // if K is not a multiple of 32) from a zero-padded copy
  const int64_t full = K == Kp ? M / 32 * 32 : 0;
  if (full) amx_linear(xp, K, full, Kp, wp, yp, N);
  if (full < M) {
    const int64_t rest = M - full;
    auto xz = at::zeros({round_up(rest, 32), Kp}, x.options());
    xz.narrow(0, 0, rest).narrow(1, 0, K).copy_(x.narrow(0, full, rest));
    amx_linear(xz.data_ptr<at::BFloat16>(), Kp, rest, Kp, wp, yp + full * N, N);
  }
  return y;
#endif
#endif
  TORCH_CHECK(false, "invariant_linear: no kernel for this ISA");
}
