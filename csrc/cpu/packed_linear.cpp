// packed_linear: input [M, K] @ W^T for a weight W [N, K] packed in panels of kPanel output columns
// with 4-byte lanes, [ceil(N / kPanel), ceil(K / G), kPanel, G], G = 4 / element size: lane n of
// panel p is column p * kPanel + n, and holds G consecutive inputs k (fp32: one; bf16: a pair, what one
// lane of an AVX512-BF16 dot product sums); zeros past N and K. A decode step's GEMM (M = batch x
// tokens, a few rows) streams each panel once, contiguously, and every weight it loads serves all the
// tile's rows. fp32 accumulation, the output in the input's dtype. fp32: AVX-512 FMAs where the CPU
// has them (QSPEC_CPU_AVX512=0 turns them off), else 8-lane multiplies and adds. bf16: on a CPU
// with AMX, tiles of 16 rows x 32 inputs times 32 inputs x 16 columns (tdpbf16ps: the packed panel
// is already the tile's layout, 16 pairs of a panel one 1 KB tile), so that a few rows cost what one
// does (the weights' bytes bound both); with AVX512-BF16 only, vdpbf16ps on the bf16 rows (two
// multiply-adds per lane and instruction); elsewhere the pairs are widened to fp32 in registers (half
// of fp32's bytes streamed on any x86 CPU). A row's result never depends on the other rows (the
// same sums in the same order whatever the row count): a projection gives a token the same bits in
// a verify step as in a plain one. CPU only: on CUDA the projections run cuBLAS on the weight as
// stored.
//
// Why not oneDNN's packed weights (mkldnn::_reorder_linear_weight + _linear_pointwise, what this op
// called before): on a CPU without AVX-512 oneDNN keeps the plain layout and has no bf16 kernels, and
// each call costs 50-100 us of primitive lookup on top of the GEMM (a 192 x 320 fp32 projection, one
// row: 130 us against F.linear's 23 us; benchmarks/HISTORY.md).
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>


#include "checks.h"
#include "cpu_common.h"
#include "ops.h"

namespace qspec_ext {

namespace {

using namespace cpu;

constexpr std::string_view kOp = "packed_linear";
constexpr int64_t kPanel = 16;     // output columns per panel: two 8-lane registers
constexpr int64_t kTileRows = 4;   // input rows per register tile: 8 accumulators + 2 weights + 1 row value
constexpr int64_t kDotTileRows = 8;  // AVX-512 (32 registers): 16 accumulators + 2 weights + 1 pair
constexpr int64_t kBlockRows = 64; // input rows per work item (a prefill's rows, in L2 while a panel is reused)

// Inputs per 4-byte lane of a packed weight: fp32 one, bf16 a pair.
template <typename W>
constexpr int64_t kGroup = 4 / sizeof(W);

typedef uint32_t Words8 __attribute__((vector_size(32)));

QSPEC_INLINE Lanes8 as_lanes(const Words8& w) {
  Lanes8 v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

template <int R, typename T>
QSPEC_INLINE void store_tile(const Lanes8 (&acc)[R][2], T* __restrict__ out, int64_t out_stride, int64_t columns) {
  for (int r = 0; r < R; ++r) {
    float row[kPanel];
    std::memcpy(row, &acc[r][0], sizeof acc[r][0]);
    std::memcpy(row + 8, &acc[r][1], sizeof acc[r][1]);
    for (int64_t c = 0; c < columns; ++c) out[r * out_stride + c] = static_cast<T>(row[c]);
  }
}

// Register tiles of fp32 multiply-adds (fp32 weights, or bf16 ones widened), kRows rows at most.
// run<R>: out rows [0, R) x the panel's valid columns = x rows [0, R) (fp32, row stride x_stride) @
// the panel; a tile given `ahead` (the next panel) prefetches it, one line per line it reads.
struct Fp32Tiles {
  static constexpr int kRows = kTileRows;

  template <int R, typename T>
  QSPEC_INLINE static void run(const float* __restrict__ x, int64_t x_stride, const float* __restrict__ panel,
                               int64_t K, T* __restrict__ out, int64_t out_stride, int64_t columns, const float* ahead) {
    Lanes8 acc[R][2] = {};
    for (int64_t k = 0; k < K; ++k) {
      const Lanes8 w0 = load8(panel + k * kPanel), w1 = load8(panel + k * kPanel + 8);
      if (ahead != nullptr) __builtin_prefetch(ahead + k * kPanel, 0, 1);
      for (int r = 0; r < R; ++r) {
        const float v = x[r * x_stride + k];
        acc[r][0] += v * w0;
        acc[r][1] += v * w1;
      }
    }
    store_tile<R>(acc, out, out_stride, columns);
  }

  // A bf16 panel, its pairs widened in registers: bf16 is the top half of an fp32, so the low half
  // of a lane (input k) shifted up and the high half (input k + 1) masked are the two fp32s.
  template <int R, typename T>
  QSPEC_INLINE static void run(const float* __restrict__ x, int64_t x_stride, const c10::BFloat16* __restrict__ panel,
                               int64_t K, T* __restrict__ out, int64_t out_stride, int64_t columns,
                               const c10::BFloat16* ahead) {
    Lanes8 acc[R][2] = {};
    const Words8 high = Words8{} + 0xFFFF0000u;
    for (int64_t k = 0; k < K; k += 2) {
      Words8 w0, w1;
      std::memcpy(&w0, panel + k * kPanel, sizeof w0);
      std::memcpy(&w1, panel + k * kPanel + kPanel, sizeof w1);
      if (ahead != nullptr) __builtin_prefetch(ahead + k * kPanel, 0, 1);
      const Lanes8 even0 = as_lanes(w0 << 16), even1 = as_lanes(w1 << 16);
      for (int r = 0; r < R; ++r) {
        const float v = x[r * x_stride + k];
        acc[r][0] += v * even0;
        acc[r][1] += v * even1;
      }
      if (k + 1 == K) break;  // an odd K: the last pair's high halves are padding
      const Lanes8 odd0 = as_lanes(w0 & high), odd1 = as_lanes(w1 & high);
      for (int r = 0; r < R; ++r) {
        const float v = x[r * x_stride + k + 1];
        acc[r][0] += v * odd0;
        acc[r][1] += v * odd1;
      }
    }
    store_tile<R>(acc, out, out_stride, columns);
  }
};

// Tiles::run<left> for the rows a panel's whole tiles leave (0 < left < Tiles::kRows).
template <typename Tiles, int R, typename X, typename W, typename T>
QSPEC_INLINE void tail_tile(int64_t left, const X* x, int64_t x_stride, const W* panel, int64_t K, T* out,
                            int64_t out_stride, int64_t columns, const W* ahead) {
  if constexpr (R > 0) {
    if (left == R)
      Tiles::template run<R>(x, x_stride, panel, K, out, out_stride, columns, ahead);
    else
      tail_tile<Tiles, R - 1>(left, x, x_stride, panel, K, out, out_stride, columns, ahead);
  }
}

// Rows [row, row + rows) of the output, columns of panel p: tiles of Tiles::kRows rows, then one
// smaller tile; the first prefetches the next panel, so the weights stream while the tiles compute.
template <typename Tiles, typename X, typename W, typename T>
QSPEC_INLINE void panel_rows_impl(const X* x, int64_t x_stride, const W* packed, int64_t K, int64_t N, int64_t p,
                                  int64_t row, int64_t rows, T* out) {
  const int64_t panel_size = (K + kGroup<W> - 1) / kGroup<W> * kGroup<W> * kPanel;
  const W* panel = packed + p * panel_size;
  const int64_t columns = std::min(kPanel, N - p * kPanel);
  T* dst = out + row * N + p * kPanel;
  const X* src = x + row * x_stride;
  const W* ahead = panel + panel_size;
  int64_t r = 0;
  for (; r + Tiles::kRows <= rows; r += Tiles::kRows, ahead = nullptr)
    Tiles::template run<Tiles::kRows>(src + r * x_stride, x_stride, panel, K, dst + r * N, N, columns, ahead);
  tail_tile<Tiles, Tiles::kRows - 1>(rows - r, src + r * x_stride, x_stride, panel, K, dst + r * N, N, columns,
                                     ahead);
}

QSPEC_CPU_CLONES void panel_rows(const float* x, int64_t x_stride, const float* packed, int64_t K, int64_t N,
                                 int64_t p, int64_t row, int64_t rows, float* out) {
  panel_rows_impl<Fp32Tiles>(x, x_stride, packed, K, N, p, row, rows, out);
}
QSPEC_CPU_CLONES void panel_rows(const float* x, int64_t x_stride, const c10::BFloat16* packed, int64_t K, int64_t N,
                                 int64_t p, int64_t row, int64_t rows, c10::BFloat16* out) {
  panel_rows_impl<Fp32Tiles>(x, x_stride, packed, K, N, p, row, rows, out);
}

#if QSPEC_BF16_DOT
QSPEC_TARGET_BF16_DOT QSPEC_INLINE uint32_t pair_at(const uint16_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Register tiles of vdpbf16ps on bf16 rows, as Fp32Tiles: each lane adds x[k] * w[k] + x[k + 1] *
// w[k + 1] (products exact in fp32) for the pair broadcast from the row. Two accumulators per row
// (even and odd pairs), so that even one row keeps two dot products in flight. run is not inlined
// into the shared row loop (compiled for any x86-64): a call per tile.
struct DotTiles {
  static constexpr int kRows = kDotTileRows;

  template <int R>
  QSPEC_TARGET_BF16_DOT static void run(const uint16_t* __restrict__ x, int64_t x_stride,
                                        const uint16_t* __restrict__ panel, int64_t K, c10::BFloat16* __restrict__ out,
                                        int64_t out_stride, int64_t columns, const uint16_t* ahead) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int64_t pairs = K / 2;  // whole pairs; an odd K's last input is paired with the padding below
    int64_t j = 0;
    for (; j + 2 <= pairs; j += 2) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + j * 2 * kPanel);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + (j + 1) * 2 * kPanel);
      if (ahead != nullptr) {
        __builtin_prefetch(ahead + j * 2 * kPanel, 0, 1);
        __builtin_prefetch(ahead + (j + 1) * 2 * kPanel, 0, 1);
      }
      for (int r = 0; r < R; ++r) {
        const uint16_t* xr = x + r * x_stride + 2 * j;
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)_mm512_set1_epi32(pair_at(xr)), w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)_mm512_set1_epi32(pair_at(xr + 2)), w1);
      }
    }
    if (j < pairs) {
      const __m512bh w = (__m512bh)_mm512_loadu_si512(panel + j * 2 * kPanel);
      for (int r = 0; r < R; ++r)
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)_mm512_set1_epi32(pair_at(x + r * x_stride + 2 * j)), w);
    }
    if (K % 2) {  // x[K - 1] with a zero beside it (x[K] is past the row)
      const __m512bh w = (__m512bh)_mm512_loadu_si512(panel + pairs * 2 * kPanel);
      for (int r = 0; r < R; ++r) {
        const uint32_t last = x[r * x_stride + K - 1];
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)_mm512_set1_epi32(static_cast<int>(last)), w);
      }
    }
    for (int r = 0; r < R; ++r) {
      float row[kPanel];
      _mm512_storeu_ps(row, _mm512_add_ps(acc[r][0], acc[r][1]));
      for (int64_t c = 0; c < columns; ++c) out[r * out_stride + c] = static_cast<c10::BFloat16>(row[c]);
    }
  }
};

void panel_rows(const uint16_t* x, int64_t x_stride, const uint16_t* packed, int64_t K, int64_t N, int64_t p,
                int64_t row, int64_t rows, c10::BFloat16* out) {
  panel_rows_impl<DotTiles>(x, x_stride, packed, K, N, p, row, rows, out);
}

// AMX tiles (tdpbf16ps) on bf16 rows, a work item of up to kAmxRows rows at a time. The tiles
// (ldtilecfg: palette 1) are tmm0 / tmm1 the two accumulators (rows x 16 fp32), tmm2 / tmm3 the
// rows' 32 inputs (rows x 16 pairs), tmm4 / tmm5 a panel's 16 pairs (16 x 16 columns x a pair):
// two chunks of 32 inputs in flight. Inputs past the whole chunks (K % 32) are added with vdpbf16ps.
constexpr int64_t kAmxRows = 16;
constexpr int64_t kAmxPairs = 16;  // input pairs per chunk: a tile row of bf16 x is 64 bytes

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64);

#define QSPEC_TARGET_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

QSPEC_TARGET_AMX void configure_tiles(int64_t rows) {
  TileConfig config;
  for (int tile : {0, 1}) config.rows[tile] = rows, config.bytes_per_row[tile] = kPanel * sizeof(float);
  for (int tile : {2, 3}) config.rows[tile] = rows, config.bytes_per_row[tile] = kAmxPairs * 4;
  for (int tile : {4, 5}) config.rows[tile] = kAmxPairs, config.bytes_per_row[tile] = kPanel * 4;
  asm volatile("ldtilecfg %0" ::"m"(config));  // the whole struct as the operand (the intrinsic names 8 bytes)
}

QSPEC_TARGET_AMX void release_tiles() { _tile_release(); }

// Rows [row, row + rows) (rows <= kAmxRows, the tiles configured for them) x the columns of panel p.
QSPEC_TARGET_AMX void amx_panel_rows(const uint16_t* x, int64_t x_stride, const uint16_t* packed, int64_t K,
                                     int64_t N, int64_t p, int64_t row, int64_t rows, c10::BFloat16* out) {
  const int64_t pairs = K / 2, panel_size = (K + 1) / 2 * 2 * kPanel;
  const uint16_t* panel = packed + p * panel_size;
  const uint16_t* ahead = panel + panel_size;  // the next panel, fetched while this one computes
  const uint16_t* rows_x = x + row * x_stride;
  const int64_t x_bytes = x_stride * static_cast<int64_t>(sizeof(uint16_t));
  constexpr int64_t kChunk = kAmxPairs * 2 * kPanel;  // a chunk's weights: 16 pairs x 16 columns x 2
  const int64_t chunks = pairs / kAmxPairs;
  _tile_zero(0);
  _tile_zero(1);
  int64_t c = 0;
  for (; c + 2 <= chunks; c += 2) {
    _tile_loadd(2, rows_x + c * 2 * kAmxPairs, x_bytes);
    _tile_loadd(4, panel + c * kChunk, 64);
    _tile_loadd(3, rows_x + (c + 1) * 2 * kAmxPairs, x_bytes);
    _tile_loadd(5, panel + (c + 1) * kChunk, 64);
    for (int64_t line = 0; line < 2 * kChunk; line += 32) __builtin_prefetch(ahead + c * kChunk + line, 0, 1);
    _tile_dpbf16ps(0, 2, 4);
    _tile_dpbf16ps(1, 3, 5);
  }
  if (c < chunks) {
    _tile_loadd(2, rows_x + c * 2 * kAmxPairs, x_bytes);
    _tile_loadd(4, panel + c * kChunk, 64);
    for (int64_t line = 0; line < kChunk; line += 32) __builtin_prefetch(ahead + c * kChunk + line, 0, 1);
    _tile_dpbf16ps(0, 2, 4);
  }
  alignas(64) float sums[2][kAmxRows][kPanel];
  _tile_stored(0, sums[0], kPanel * sizeof(float));
  _tile_stored(1, sums[1], kPanel * sizeof(float));
  const int64_t columns = std::min(kPanel, N - p * kPanel);
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* xr = rows_x + r * x_stride;
    __m512 acc = _mm512_add_ps(_mm512_load_ps(sums[0][r]), _mm512_load_ps(sums[1][r]));
    for (int64_t j = chunks * kAmxPairs; j < pairs; ++j)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(pair_at(xr + 2 * j)),
                             (__m512bh)_mm512_loadu_si512(panel + j * 2 * kPanel));
    if (K % 2) {  // an odd K: its last input and a zero
      const uint32_t last = xr[K - 1];
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(last)),
                             (__m512bh)_mm512_loadu_si512(panel + pairs * 2 * kPanel));
    }
    float sum[kPanel];
    _mm512_storeu_ps(sum, acc);
    c10::BFloat16* dst = out + (row + r) * N + p * kPanel;
    for (int64_t col = 0; col < columns; ++col) dst[col] = static_cast<c10::BFloat16>(sum[col]);
  }
}

// out = x @ the packed weight on AMX tiles: work items (panel, block of kAmxRows rows), panel-major.
void amx_gemm(const uint16_t* x, int64_t x_stride, const uint16_t* packed, int64_t M, int64_t K, int64_t N,
              c10::BFloat16* out) {
  const int64_t panels = (N + kPanel - 1) / kPanel, row_blocks = (M + kAmxRows - 1) / kAmxRows;
  torch::stable::parallel_for(0, panels * row_blocks, grain_for(std::min(M, kAmxRows) * K * kPanel), [&](int64_t first,
                                                                                              int64_t last) {
    int64_t configured = 0;  // the rows the tiles are configured for (per thread: configure on first use)
    for (int64_t item = first; item < last; ++item) {
      const int64_t row = (item % row_blocks) * kAmxRows;
      const int64_t rows = std::min(kAmxRows, M - row);
      if (rows != configured) configure_tiles(configured = rows);
      amx_panel_rows(x, x_stride, packed, K, N, item / row_blocks, row, rows, out);
    }
    release_tiles();
  });
}

// Register tiles of AVX-512 FMAs on fp32 panels, as Fp32Tiles with a whole panel per register: each
// row's value broadcast into one FMA per input, 8 rows. (Fp32Tiles issue a multiply and an add per 8
// columns: on AVX-512 their instruction count, not the arithmetic, bounded them.)
struct FmaTiles {
  static constexpr int kRows = kDotTileRows;

  template <int R>
  QSPEC_TARGET_AVX512 static void run(const float* __restrict__ x, int64_t x_stride, const float* __restrict__ panel,
                                      int64_t K, float* __restrict__ out, int64_t out_stride, int64_t columns,
                                      const float* ahead) {
    __m512 acc[R][2];  // even and odd inputs: even one row keeps two FMA chains in flight
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 2 <= K; k += 2) {
      const __m512 w0 = _mm512_loadu_ps(panel + k * kPanel), w1 = _mm512_loadu_ps(panel + (k + 1) * kPanel);
      if (ahead != nullptr) {
        __builtin_prefetch(ahead + k * kPanel, 0, 1);
        __builtin_prefetch(ahead + (k + 1) * kPanel, 0, 1);
      }
      for (int r = 0; r < R; ++r) {
        acc[r][0] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * x_stride + k]), w0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * x_stride + k + 1]), w1, acc[r][1]);
      }
    }
    if (k < K) {  // an odd K's last input
      const __m512 w = _mm512_loadu_ps(panel + k * kPanel);
      for (int r = 0; r < R; ++r) acc[r][0] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * x_stride + k]), w, acc[r][0]);
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << columns) - 1);
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(out + r * out_stride, valid, _mm512_add_ps(acc[r][0], acc[r][1]));
  }
};

void panel_rows_fma(const float* x, int64_t x_stride, const float* packed, int64_t K, int64_t N, int64_t p,
                    int64_t row, int64_t rows, float* out) {
  panel_rows_impl<FmaTiles>(x, x_stride, packed, K, N, p, row, rows, out);
}
#endif

// Whether a switch (an environment variable) is set to 0: the kernels it names are not used, so
// the others run and are tested on this CPU.
bool turned_off(const char* variable) {
  const char* setting = std::getenv(variable);
  return setting != nullptr && std::string_view(setting) == "0";
}

#if QSPEC_BF16_DOT
bool cpu_has_avx512_f_bw_vl() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}
#endif

#if QSPEC_BF16_DOT
// AMX-TILE and AMX-BF16 on this CPU (CPUID leaf 7: EDX bits 24 and 22), and the kernel's leave to
// use their registers in this process (Linux asks a process to request it).
bool cpu_has_usable_amx_bf16() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx >> 24 & 1) || !(edx >> 22 & 1)) return false;
  constexpr long kArchRequestXcompPermission = 0x1023, kXfeatureTileData = 18;
  return syscall(SYS_arch_prctl, kArchRequestXcompPermission, kXfeatureTileData) == 0;
}
#endif

// AVX-512 (F, BW, VL) on this CPU, unless QSPEC_CPU_AVX512=0.
bool detect_avx512() {
#if QSPEC_BF16_DOT
  return !turned_off("QSPEC_CPU_AVX512") && cpu_has_avx512_f_bw_vl();
#else
  return false;
#endif
}

// AVX512-BF16 (with AVX-512 F, BW, VL) on this CPU, unless QSPEC_CPU_BF16_DOT=0.
bool detect_bf16_dot() {
#if QSPEC_BF16_DOT
  return !turned_off("QSPEC_CPU_BF16_DOT") && cpu_has_avx512_f_bw_vl() && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// AMX on this CPU, unless QSPEC_CPU_AMX=0 (the AMX kernel also needs AVX512-BF16: kBf16Dot).
bool detect_amx() {
#if QSPEC_BF16_DOT
  return !turned_off("QSPEC_CPU_AMX") && cpu_has_usable_amx_bf16();
#else
  return false;
#endif
}

// out = x @ the packed weight, over work items (panel, block of rows): panel-major, so a thread's
// consecutive items reuse one panel over the row blocks.
template <typename X, typename W, typename T>
void packed_gemm(const X* x, int64_t x_stride, const W* packed, int64_t M, int64_t K, int64_t N, T* out) {
  const int64_t panels = (N + kPanel - 1) / kPanel, row_blocks = (M + kBlockRows - 1) / kBlockRows;
  const int64_t item_work = std::min(M, kBlockRows) * K * kPanel;
  const bool fma_tiles = cpu_avx512();  // fp32 weights: AVX-512 FMA tiles
  torch::stable::parallel_for(0, panels * row_blocks, grain_for(item_work), [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t row = (item % row_blocks) * kBlockRows;
      const int64_t rows = std::min(kBlockRows, M - row);
#if QSPEC_BF16_DOT
      if constexpr (std::is_same_v<W, float>)
        if (fma_tiles) {
          panel_rows_fma(x, x_stride, packed, K, N, item / row_blocks, row, rows, out);
          continue;
        }
#endif
      panel_rows(x, x_stride, packed, K, N, item / row_blocks, row, rows, out);
    }
  });
}

const bool kBf16Dot = detect_bf16_dot();
const bool kAvx512 = detect_avx512();
const bool kAmx = kBf16Dot && detect_amx();

}  // namespace

Tensor packed_linear_cpu(const Tensor& input, const Tensor& packed_weight, int64_t out_features) {
  QSPEC_CHECK(input.dim() == 2, kOp, "input", "must be 2-D [rows, in_features], got ", input.dim(), "-D ",
              input.sizes());
  QSPEC_CHECK(dtype_of(input) == kFloat || dtype_of(input) == kBFloat16, kOp, "input",
              "must be float32 or bfloat16, got ", dtype_of(input));
  QSPEC_CHECK(dtype_of(input) == dtype_of(packed_weight), kOp, "input", "must have the packed weight's dtype ",
              dtype_of(packed_weight), ", got ", dtype_of(input));
  const int64_t group = 4 / static_cast<int64_t>(input.element_size());  // inputs per 4-byte lane
  QSPEC_CHECK(packed_weight.dim() == 4 && packed_weight.size(2) == kPanel && packed_weight.size(3) == group, kOp,
              "packed_weight", "must be 4-D [ceil(out_features / ", kPanel, "), ceil(in_features / ", group, "), ",
              kPanel, ", ", group, "] (qspec_ext.models.linear.pack_weight), got ", packed_weight.sizes());
  QSPEC_CHECK(out_features > 0 && (out_features + kPanel - 1) / kPanel == packed_weight.size(0), kOp, "out_features",
              "must need the packed weight's ", packed_weight.size(0), " panels of ", kPanel, " columns, got ",
              out_features);
  const int64_t lanes = packed_weight.size(1), K = input.size(1);
  QSPEC_CHECK((K + group - 1) / group == lanes, kOp, "input", "must have ",
              group == 1 ? std::to_string(lanes) : std::to_string(2 * lanes - 1) + " or " + std::to_string(2 * lanes),
              " columns (the packed weight's in_features), got ", input.sizes());
  QSPEC_CHECK(packed_weight.is_contiguous(), kOp, "packed_weight", "must be contiguous, got strides ",
              packed_weight.strides());
  Tensor out = empty({input.size(0), out_features}, input);
  const int64_t M = input.size(0), N = out_features;
  if (M == 0 || K == 0) return torch::stable::zero_(out);
#if QSPEC_BF16_DOT
  if (dtype_of(input) == kBFloat16 && kBf16Dot) {
    const Tensor x = input.stride(1) == 1 ? input : as_contiguous(input);
    const auto* rows = reinterpret_cast<const uint16_t*>(const_data<c10::BFloat16>(x));
    const auto* packed = reinterpret_cast<const uint16_t*>(const_data<c10::BFloat16>(packed_weight));
    auto* result = mutable_data<c10::BFloat16>(out);
    if (kAmx)
      amx_gemm(rows, x.stride(0), packed, M, K, N, result);
    else
      packed_gemm(rows, x.stride(0), packed, M, K, N, result);
    return out;
  }
#endif
  // The rows in fp32 with unit column stride (a bf16 input is widened once, not per panel).
  const Tensor x =
      dtype_of(input) == kFloat && input.stride(1) == 1 ? input : as_contiguous(torch::stable::to(input, kFloat));
  if (dtype_of(input) == kFloat)
    packed_gemm(const_data<float>(x), x.stride(0), const_data<float>(packed_weight), M, K, N,
                mutable_data<float>(out));
  else
    packed_gemm(const_data<float>(x), x.stride(0), const_data<c10::BFloat16>(packed_weight), M, K, N,
                mutable_data<c10::BFloat16>(out));
  return out;
}

STABLE_TORCH_LIBRARY_IMPL(qspec_ext, CPU, m) { m.impl("packed_linear", TORCH_BOX((&packed_linear_cpu))); }

bool cpu_bf16_dot() { return kBf16Dot; }
bool cpu_avx512() { return kAvx512; }
bool cpu_amx() { return kAmx; }

}  // namespace qspec_ext
