// The projections' matmul on the CPU, from weights packed into panels, called from jitted JAX
// through XLA FFI:
//
//   y[m, n] = sum_k x[m, k] * w[k, n]                  (float32 panels)
//   y[m, n] = scale[n] * sum_k x[m, k] * float(q[k, n]) (int8 panels, weight-only quantization)
//   y[m, n] = sum_k bf16(x[m, k]) * float(w[k, n])       (bfloat16 pair panels, hosts without
//                                                         bfloat16 arithmetic: see below)
//
// x [M, K] float32, y [M, N] float32.  Why panels: a decode step multiplies a few rows by every
// weight, so it must stream the weights once at memory speed, and XLA:CPU's GEMM does not (12-14
// GB/s at 8-16 rows here, against 30 GB/s for a matrix-vector product).  The loader's [K, N]
// matrix is cut into panels of 64 columns, each stored contiguously as [K, 64]: the whole packed
// array is [P, K, 64] with P = ceil(N / 64), zero-padded past N.  One panel row (64 columns) is 4
// AVX-512 vectors (or 64 int8 bytes, one cache line), so the kernel reads a panel front to back,
// keeps a tile of rows x 64 columns of y in registers, and never sums horizontally.
//
// int8 panels interleave each row's 64 bytes so that a plain 4-byte-lane load widens into
// columns in order: byte 4i + j of a row holds column 16j + i.  A load of 4N bytes at byte offset
// 4N h (N int32 lanes: 16 for AVX-512, 8 for AVX2, 4 baseline) sign-extended by shifts gives four
// float vectors, vector j holding columns 16j + Nh .. 16j + Nh + N - 1: contiguous for every N,
// so one packed layout serves every vector width (pallas_kernels/native_matmul.py packs it).
//
// Each y[m, n] is summed over k in order, in blocks of kSumBlock (below), in one float32 lane
// (fused multiply-add where the ISA has it), the int8 scale applied once at the end: a row's
// result never depends on the other rows of the call or on how the work was split (batched
// equals alone).
//
// Work split: items are (a run of panels, a block of rows), taken from a shared atomic counter by
// the calling thread and by tasks queued on XLA's own CPU thread pool (work_pool.h, shared with
// the paged-attention kernel), each thread claiming its next item before it starts the current
// one, so that while it multiplies a panel it can prefetch the next panel it will read, across
// items too (tile()).  With more rows than one register tile,
// an int8 panel is first widened into an L2-resident float32 scratch, so that every further tile
// reads floats instead of widening again.
//
// Vector code: GCC/Clang vector extensions written once for N float lanes, compiled as baseline
// (N = 4), AVX2+FMA (N = 8) and AVX-512 (N = 16), chosen at run time by the attention kernel's
// switch (jaxserve_cpu_isa() in paged_attention.cc; JAXSERVE_CPU_ISA lowers it).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "work_pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define JM_X86 1
#endif

namespace ffi = xla::ffi;

#define JM_INLINE inline __attribute__((always_inline))
// A lambda does not inherit its function's target("avx512f") attribute, so GCC is free to compile
// it apart for the baseline ISA.  Left to itself, GCC 12 kept the AVX-512 float32 tiles in 8
// vector registers with the accumulators on the stack (0.43x, from 6073b93, a one-line change in
// run_item, to 2026-12-05 23:00), and with another small edit put float_panel out of line at
// SSE2 (11 GFLOP/s).  Every lambda in a kernel body is forced inline.
#define JM_LAMBDA_INLINE __attribute__((always_inline))
#define JM_EXPORT extern "C" __attribute__((visibility("default")))

// Defined in paged_attention.cc (same library): 0 baseline, 1 AVX2+FMA, 2 AVX-512,
// 3 AVX-512 + AVX512-BF16, 4 that + AMX.
extern "C" int jaxserve_cpu_isa();

namespace {

constexpr int64_t kPanel = 64;  // columns per panel (pallas_kernels/native_matmul.py: PANEL)

// k per block of the sum: each y element is summed over k in blocks of this many, in order, each
// block in its own accumulator, and the block sums added in order.  Rounding error then grows
// with about sqrt(block) + sqrt(K / block) instead of sqrt(K): against float64, a 1,536-long
// sum in one accumulator was 2.5x as far as PyTorch's float32 matmul (which also blocks k).
constexpr int64_t kSumBlock = 256;

template <int N>
struct MV {
  typedef float F __attribute__((vector_size(4 * N)));
  typedef int32_t I __attribute__((vector_size(4 * N)));
};

template <int N>
JM_INLINE typename MV<N>::F vload(const float* p) {
  typename MV<N>::F v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <int N>
JM_INLINE void vstore(float* p, typename MV<N>::F v) {
  std::memcpy(p, &v, sizeof v);
}

// Where vector j (0..V-1) of slice h of a panel row lands among the panel's 64 columns.  A slice
// is V x N columns' worth of weights (V = 4, or 2 for float32 panels in AVX2's tall tiles: below):
// float32 rows hold them in order; int8 rows interleaved (above; always V = 4).
template <int N, class WT, int V = 4>
constexpr int column(int h, int j) {
  return std::is_same<WT, int8_t>::value ? 16 * j + N * h : V * N * h + N * j;
}

// The V weight vectors of slice h of one panel row.
template <int N, int V>
JM_INLINE void load_slice(const float* row, int h, typename MV<N>::F (&w)[V]) {
  for (int j = 0; j < V; ++j) w[j] = vload<N>(row + V * N * h + N * j);
}
template <int N, int V>
JM_INLINE void load_slice(const int8_t* row, int h, typename MV<N>::F (&w)[V]) {
  static_assert(V == 4, "an int8 load widens into four vectors");
  typename MV<N>::I v;
  std::memcpy(&v, row + 4 * N * h, sizeof v);
  w[0] = __builtin_convertvector((v << 24) >> 24, typename MV<N>::F);
  w[1] = __builtin_convertvector((v << 16) >> 24, typename MV<N>::F);
  w[2] = __builtin_convertvector((v << 8) >> 24, typename MV<N>::F);
  w[3] = __builtin_convertvector(v >> 24, typename MV<N>::F);
}

// A bfloat16 weight of the pair layout (bfloat16 section below): panel rows 2i and 2i + 1 are
// interleaved, a 32-bit word per column, 128 elements per pair of rows.
struct bf16_t {
  uint16_t bits;
};

// The V weight vectors of slice h of row k of a panel (float32 and int8: [K, 64]; bfloat16:
// [Kpad / 2, 128] pairs, widened by a shift: row 2i is the words' top halves moved up, row 2i + 1
// their top halves in place).
template <int N, int V, class WT>
JM_INLINE void load_row(const WT* panel, int64_t k, int h, typename MV<N>::F (&w)[V]) {
  if constexpr (std::is_same<WT, bf16_t>::value) {
    const bf16_t* pair = panel + (k >> 1) * (2 * kPanel);
    const int shift = (k & 1) ? 0 : 16;
    for (int j = 0; j < V; ++j) {
      typename MV<N>::I v;
      std::memcpy(&v, pair + 2 * (V * N * h + N * j), sizeof v);
      w[j] = (typename MV<N>::F)((v << shift) & int32_t(0xffff0000u));
    }
  } else {
    load_slice<N, V>(panel + k * kPanel, h, w);
  }
}

struct Problem {
  const float* x;       // [M, K]
  const void* w;        // [P, Kpad, 64] float32, int8 (interleaved) or bfloat16 (pairs)
  const float* scale;   // [P * 64] (int8 only; zero past N)
  float* y;             // [M, N]
  int64_t M, K, N, P;
  int64_t Kpad;         // rows per panel: K, or K rounded up to 32 for bfloat16 pairs
  int64_t panels_per_item, rows_per_item;  // rows_per_item: a multiple of every tile height
  int64_t panel_items, n_items;
};

// bfloat16 panels, few rows: the first slice prefetches this many bytes ahead of the pair row it
// reads (AVX2, Zen 3: one row streamed SmolLM2's weights at 26 GB/s with the hardware prefetcher
// alone and 29-30 GB/s with this, the float32 panels' rate; 0.5-2 KiB all did as well; 3-4
// rows gained 5-10%).
constexpr int64_t kBf16Prefetch = 1024;

// y[m0, m0 + R) x (slice h of panels p .. p + NP - 1) from panel rows `wp` ([NP][K, 64] of type
// WT): R x NP x 4 vector accumulators (AVX-512: 6 x 1 x 4 of the 32 registers for many rows).
// A few rows read NP panels at once: one stream per core does not reach the memory's speed, a
// few do.  Every y element is still summed over k in the same order (kSumBlock), whatever R and NP.
//
// `next` (or null): the panel this thread multiplies after this one, rows of `next_row` bytes
// (float32 or int8 panels: 256 or 64).  The T tiles
// of a panel share out prefetching it into L2: tile t fetches rows t, t + T, ... as it goes.  The
// first tile of a panel would otherwise read it from memory as one stream, which on this kind of
// host runs at a third of the memory's speed, while the later tiles compute on it from L2; with
// the prefetch, memory streams the next panel the whole time the current one is being multiplied.
template <int N, int R, int NP, bool Q8, class WT, int V = 4>
JM_INLINE void tile(const Problem& pr, const WT* wp, int64_t p, int h, int64_t m0, const char* next,
                    int64_t next_row, int64_t t, int64_t T) {
  using F = typename MV<N>::F;
  const int64_t K = pr.K, PS = pr.Kpad * kPanel;  // PS: elements per panel
  const float* x0 = pr.x + m0 * K;
  int64_t pf_row = next ? t : K;  // the next row of `next` this tile prefetches
  float* const y0 = pr.y + m0 * pr.N;
  const float* const scale = pr.scale;
  const int64_t n_cols = pr.N;
  const bool full = (p + NP) * kPanel <= n_cols;  // no column of the tile is past N
  for (int64_t k0 = 0; k0 < K; k0 += kSumBlock) {
    const int64_t k1 = std::min(K, k0 + kSumBlock);
    F acc[R][NP][V];
    for (int r = 0; r < R; ++r)
      for (int q = 0; q < NP; ++q)
        for (int j = 0; j < V; ++j) acc[r][q][j] = F{};
    int64_t k_single = k0;  // where the row-at-a-time loop starts
    // bfloat16 in the few-row tiles: a pair of rows per load (load_row), widened once for both
    // (1-4 rows through SmolLM2's weights: 1.05-1.1x the row-at-a-time loop, 2 cores).  Not in
    // AVX2's tall tiles (V = 2): with a pair per load they ran at 0.65-0.75x (tiles of 4-6 rows);
    // there each row is loaded again and widened by the one operation its parity needs (the
    // shifts share the FMA units: two operations per row ran at 0.8x at 8-32 rows).
    if constexpr (std::is_same<WT, bf16_t>::value) {  // whole k pairs; an odd K's last row below
      using I = typename MV<N>::I;
      k_single = k0 + ((k1 - k0) & ~int64_t(1));
      for (int64_t k = k0; k < k_single; k += 2) {
        for (; pf_row <= k + 1; pf_row += T)
          for (int64_t b = 0; b < next_row; b += 64) __builtin_prefetch(next + pf_row * next_row + b, 0, 2);
        for (int q = 0; q < NP; ++q) {
          const bf16_t* pair = wp + q * PS + (k >> 1) * (2 * kPanel);
          if constexpr (V >= 4) {  // few rows: one load, both rows
            if (R <= 3 && h == 0)  // the first slice fetches ahead (kBf16Prefetch)
              for (int b = 0; b < 4; ++b)
                __builtin_prefetch(reinterpret_cast<const char*>(pair) + kBf16Prefetch + 64 * b, 0, 3);
            for (int j = 0; j < V; ++j) {
              I v;
              std::memcpy(&v, pair + 2 * (V * N * h + N * j), sizeof v);
              const F even = (F)(v << 16), odd = (F)(v & int32_t(0xffff0000u));
              for (int r = 0; r < R; ++r) {
                acc[r][q][j] += x0[r * K + k] * even;
                acc[r][q][j] += x0[r * K + k + 1] * odd;
              }
            }
          } else {  // the tall tiles: a row at a time, each widened by the one operation it needs
#pragma GCC unroll 2
            for (int e = 0; e < 2; ++e) {
              F w[V];
              for (int j = 0; j < V; ++j) {
                I v;
                std::memcpy(&v, pair + 2 * (V * N * h + N * j), sizeof v);
                w[j] = e ? (F)(v & int32_t(0xffff0000u)) : (F)(v << 16);
              }
              for (int r = 0; r < R; ++r) {
                const float xv = x0[r * K + k + e];
                for (int j = 0; j < V; ++j) acc[r][q][j] += xv * w[j];
              }
            }
          }
        }
      }
    }
    for (int64_t k = k_single; k < k1; ++k) {  // float32 and int8 rows (bfloat16: an odd K's last row)
      if (k == pf_row) {
        for (int64_t b = 0; b < next_row; b += 64) __builtin_prefetch(next + k * next_row + b, 0, 2);
        pf_row += T;
      }
      for (int q = 0; q < NP; ++q) {
        F w[V];
        load_row<N, V>(wp + q * PS, k, h, w);
        for (int r = 0; r < R; ++r) {
          const float xv = x0[r * K + k];
          for (int j = 0; j < V; ++j) acc[r][q][j] += xv * w[j];
        }
      }
    }
    // The block's sums join the running sums, which wait in y itself (the registers are all
    // accumulators); the int8 scale multiplies the total once, after the last block.  (y and
    // its stride are locals: a vstore is a memcpy, which may alias anything, pr included.)
    const bool first = k0 == 0, last = k1 == K;
#pragma GCC unroll 8
    for (int q = 0; q < NP; ++q)
#pragma GCC unroll 8
      for (int j = 0; j < V; ++j) {
        const int64_t c = (p + q) * kPanel + column<N, WT, V>(h, j);  // first column of this vector
        const int64_t live = full ? N : std::min<int64_t>(N, n_cols - c);
        if (live <= 0) continue;
        F s;
        if constexpr (Q8) s = vload<N>(scale + c);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          F v = acc[r][q][j];
          float* yr = y0 + r * n_cols + c;
          // Whole and part vectors in separate branches, each with its own add and scale: one
          // shared `live == N ? vload : part load` made GCC keep the tile in memory (2.7x slower).
          if (live == N) {
            if (!first) v += vload<N>(yr);
            if constexpr (Q8)
              if (last) v *= s;
            vstore<N>(yr, v);
          } else {  // a part vector: only its live lanes (the panel's padding columns are past N)
            float lanes[N] = {};
            if (!first) std::memcpy(lanes, yr, sizeof(float) * live);
            v += vload<N>(lanes);
            if constexpr (Q8)
              if (last) v *= s;
            std::memcpy(lanes, &v, sizeof lanes);
            std::memcpy(yr, lanes, sizeof(float) * live);
          }
        }
      }
  }
}

// Rows [m0, m1) of panels p .. p + NP - 1 in ceil(rows / RM) tiles of as equal a height as fits
// (32 rows: 6, 6, 5, 5, 5, 5 rather than five 6s and a 2), every slice.  Each tile reads the
// whole panel from L2 whatever its height, so a short last tile costs nearly a full tile's time
// for a fraction of its arithmetic (AVX-512, one core, 32 rows through the LM head's panels:
// the 6 x 5 + 2 split ran at 0.78x the balanced split's rate).  NP > 1 only for rows
// m1 - m0 < RM (one tile).  `next`: the panel to prefetch meanwhile (tile(); null for none).
template <int N, int RM, int NP, bool Q8, class WT, int V = 4>
JM_INLINE void panel_rows(const Problem& pr, const WT* wp, int64_t p, int64_t m0, int64_t m1,
                          const char* next = nullptr, int64_t next_row = 0) {
  constexpr int slices = int(kPanel / (V * N));
  const int64_t n = (m1 - m0 + RM - 1) / RM;  // tiles per slice
  const int64_t T = slices * n;               // tiles over this panel
  int64_t t = 0;
  for (int h = 0; h < slices; ++h)
    for (int64_t i = 0, m = m0; i < n; ++i) {
      const int64_t r = (m1 - m + n - i - 1) / (n - i);  // the taller tiles first
      switch (r) {  // the tile's accumulators stay in registers
#define JM_TILE(R) \
  case R: if constexpr (R <= RM && (NP == 1 || R * NP <= 4)) tile<N, R, NP, Q8, WT, V>(pr, wp, p, h, m, next, next_row, t++, T); break;
        JM_TILE(1) JM_TILE(2) JM_TILE(3) JM_TILE(4) JM_TILE(5) JM_TILE(6)
#undef JM_TILE
      }
      m += r;
    }
}

// int8 panel [K, 64] -> float32 [K, 64] in column order (the scale is still applied at the end).
template <int N>
JM_INLINE void widen_panel(const int8_t* wp, int64_t K, float* out) {
  for (int64_t k = 0; k < K; ++k)
    for (int h = 0; h < int(kPanel / (4 * N)); ++h) {
      typename MV<N>::F w[4];
      load_slice<N, 4>(wp + k * kPanel, h, w);
      for (int j = 0; j < 4; ++j) vstore<N>(out + k * kPanel + column<N, int8_t>(h, j), w[j]);
    }
}

// NP1 / NP2: how many panels to read at once for one / two rows (what the registers hold), V1
// the vectors of one row's slice; RM: the tallest tile of a slice of 4 vectors.  More rows than
// RM run in tiles of up to TR rows x TV vectors of float32 weights (int8 widened first): AVX2
// has 16 vector registers, so its 3 x 4 tile (12 accumulators, 4 weight vectors and the
// broadcast row value) spilled an accumulator to the stack on every k and ran at about half the
// FMA units' rate; 6 x 2 (12 + 2 + 1) fits.
// `next_item`: the item this thread takes after this one (-1: none), whose first panel the last
// panel's tiles prefetch; PFMIN: the fewest rows that prefetch it.  AVX2 (Zen 3) streams a panel
// faster without it below its tall tiles: 3-5 rows through SmolLM2's weights (a speculative
// step's verify) ran 8-11% faster, as the hardware prefetcher follows the first tile's reads.
// W: the weights' element type, float32 or int8 by Q8 unless given (bf16_t).
template <int N, int RM, int NP1, int NP2, bool Q8, int TR = RM, int TV = 4, int TMIN = RM + 1, int PFMIN = 1,
          class W = void, int V1 = 4>
JM_INLINE void run_item(const Problem& pr, int64_t item, int64_t next_item, float* scratch) {
  const int64_t pi = item % pr.panel_items, ri = item / pr.panel_items;
  const int64_t p0 = pi * pr.panels_per_item, p1 = std::min(pr.P, p0 + pr.panels_per_item);
  const int64_t m0 = ri * pr.rows_per_item, m1 = std::min(pr.M, m0 + pr.rows_per_item);
  const int64_t K = pr.K, PS = pr.Kpad * kPanel;
  using WT = typename std::conditional<std::is_void<W>::value, typename std::conditional<Q8, int8_t, float>::type,
                                       W>::type;
  const WT* w = static_cast<const WT*>(pr.w);
  constexpr int64_t row_bytes = kPanel * int64_t(sizeof(WT));
  // The panel after p: the next one of this item, else the next item's first.
  const int64_t p_after = next_item < 0 ? -1 : (next_item % pr.panel_items) * pr.panels_per_item;
  auto next_of = [&](int64_t p) JM_LAMBDA_INLINE -> const char* {
    const int64_t q = p + 1 < p1 ? p + 1 : p_after;
    return q < 0 || m1 - m0 < PFMIN ? nullptr : reinterpret_cast<const char*>(w + q * PS);
  };
  // One choice of tile for float32 or bfloat16 panels and widened int8 alike: tall tiles from
  // TMIN rows.
  auto float_panel = [&](const auto* fw, int64_t p) JM_LAMBDA_INLINE {
    using T = typename std::remove_cv<typename std::remove_pointer<decltype(fw)>::type>::type;
    if (m1 - m0 >= TMIN)
      panel_rows<N, TR, 1, Q8, T, TV>(pr, fw, p, m0, m1, next_of(p), row_bytes);
    else
      panel_rows<N, RM, 1, Q8, T>(pr, fw, p, m0, m1, next_of(p), row_bytes);
  };
  if constexpr (Q8) {
    if (m1 - m0 > RM && scratch) {
      for (int64_t p = p0; p < p1; ++p) {
        widen_panel<N>(w + p * PS, K, scratch);
        float_panel(scratch, p);
      }
      return;
    }
  } else {
    if (m1 - m0 >= TMIN) {
      for (int64_t p = p0; p < p1; ++p) float_panel(w + p * PS, p);
      return;
    }
  }
  int64_t p = p0;
  if (m1 - m0 == 1)
    for (; p + NP1 <= p1; p += NP1) panel_rows<N, RM, NP1, Q8, WT, V1>(pr, w + p * PS, p, m0, m1);
  else if (m1 - m0 == 2)
    for (; p + NP2 <= p1; p += NP2) panel_rows<N, RM, NP2, Q8>(pr, w + p * PS, p, m0, m1);
  for (; p < p1; ++p) panel_rows<N, RM, 1, Q8>(pr, w + p * PS, p, m0, m1, next_of(p), row_bytes);
}

using ItemFn = void (*)(const Problem&, int64_t, int64_t, float*);

// The panels' element type: float32, int8 (with scales), bfloat16 pairs (AVX2 and up).
enum class Weights { kF32, kQ8, kBf16 };

template <bool Q8, class W = void>
void item_generic(const Problem& pr, int64_t i, int64_t next, float* s) {
  run_item<4, 2, 1, 1, Q8, 2, 4, 3, 1, W>(pr, i, next, s);
}
#if JM_X86
template <bool Q8, class W = void>
__attribute__((target("avx2,fma"))) void item_avx2(const Problem& pr, int64_t i, int64_t next, float* s) {
  if constexpr (std::is_same<W, bf16_t>::value)  // one row: the whole panel at once, front to back
    run_item<8, 3, 1, 1, Q8, 6, 2, 8, 8, W, 8>(pr, i, next, s);
  else
    run_item<8, 3, 2, 1, Q8, 6, 2, 8, 8, W>(pr, i, next, s);
}
template <bool Q8, class W = void>
__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma"))) void item_avx512(const Problem& pr, int64_t i,
                                                                                       int64_t next, float* s) {
  run_item<16, 6, 4, 2, Q8, 6, 4, 7, 1, W>(pr, i, next, s);
}
#endif

ItemFn pick(int isa, Weights wt) {
  const bool q8 = wt == Weights::kQ8;
#if JM_X86
  if (wt == Weights::kBf16) return isa >= 2 ? &item_avx512<false, bf16_t> : &item_avx2<false, bf16_t>;
  if (isa >= 2) return q8 ? &item_avx512<true> : &item_avx512<false>;
  if (isa == 1) return q8 ? &item_avx2<true> : &item_avx2<false>;
#endif
  (void)isa;
  return q8 ? &item_generic<true> : &item_generic<false>;
}

// Work per item: about this many weight elements (times M / 4 once the rows make the item
// compute-bound), i.e. 5-10 us of streaming, well over the ~1 us of queueing a task, and at most 8
// items per worker, so a worker slowed by another process leaves little behind.
constexpr int64_t kItemElems = 1 << 15;
constexpr int64_t kItemsPerWorker = 8;

// Splits one problem's work into items for `workers` threads (sets its item fields).
void PlanItems(Problem& pr, int64_t workers) {
  const int64_t per_panel = pr.K * kPanel * std::max<int64_t>(1, pr.M / 4);
  int64_t items = std::clamp<int64_t>(pr.P * per_panel / kItemElems, 1, kItemsPerWorker * workers);
  // Split the rows too when there are too few panels to go round (a large prefill chunk through
  // a narrow projection); every row block is a whole number of tiles of every variant (6).  Not
  // for a decode step's few rows while each thread gets two panels or more: a second row block
  // reads every panel again (from L3 at best) for rows that cost little arithmetic.
  const bool split = pr.P < items && (pr.M > 64 || pr.P < 2 * workers);
  const int64_t row_blocks = split ? std::min<int64_t>((items + pr.P - 1) / pr.P, (pr.M + 5) / 6) : 1;
  pr.panel_items = std::min(pr.P, items);
  pr.panels_per_item = (pr.P + pr.panel_items - 1) / pr.panel_items;
  pr.panel_items = (pr.P + pr.panels_per_item - 1) / pr.panels_per_item;
  pr.rows_per_item = 6 * (((pr.M + row_blocks - 1) / row_blocks + 5) / 6);
  pr.n_items = pr.panel_items * ((pr.M + pr.rows_per_item - 1) / pr.rows_per_item);
}

// Several problems (a grouped matmul: one per expert's rows) as one set of work items.  first[g]
// is problem g's first item; an item's group is found by binary search.
template <class Pr>
struct Groups {
  std::vector<Pr> prs;
  std::vector<int64_t> first{0};
  void add(const Pr& pr) {
    prs.push_back(pr);
    first.push_back(first.back() + pr.n_items);
  }
  int64_t total() const { return first.back(); }
  // (problem, its local item) of item i; `next` (a global item or -1) becomes local to the same
  // problem, or -1 when it belongs to another (the tiles prefetch only their own problem's panels).
  int64_t find(int64_t i, int64_t& local, int64_t next, int64_t& local_next) const {
    const int64_t g = std::upper_bound(first.begin(), first.end(), i) - first.begin() - 1;
    local = i - first[g];
    local_next = next >= first[g] && next < first[g + 1] ? next - first[g] : -1;
    return g;
  }
};

ffi::Error RunGroups(ffi::ThreadPool pool, const std::vector<Problem>& prs, Weights wt) {
  const bool q8 = wt == Weights::kQ8;
  const int isa = jaxserve_cpu_isa();
  const int64_t rm = isa >= 2 ? 6 : isa == 1 ? 3 : 2;  // the variant's RM (run_item): more rows widen int8 first
  const int64_t workers = std::max<int64_t>(1, pool.num_threads());
  auto groups = std::make_shared<Groups<Problem>>();
  bool scratch = false;  // int8 with more rows than a tile: each thread widens a panel once into its scratch
  int64_t k_max = 0;
  for (Problem pr : prs) {
    if (pr.M == 0 || pr.N == 0) continue;
    if (pr.K == 0) {
      std::memset(pr.y, 0, sizeof(float) * pr.M * pr.N);
      continue;
    }
    PlanItems(pr, workers);
    // (none allocated: widen per tile instead).  Not bfloat16: its widening is a shift, and widening a
    // panel into scratch first ran 0.85x as fast as widening per tile at 32-256 rows here.
    scratch = scratch || (q8 && std::min(pr.M, pr.rows_per_item) > rm);
    k_max = std::max(k_max, pr.K);
    groups->add(pr);
  }
  const ItemFn fn = pick(isa, wt);
  jaxserve_cpu::run_items(
      pool, groups->total(),
      [scratch, k_max] { return std::unique_ptr<float[]>(scratch ? new (std::nothrow) float[k_max * kPanel] : nullptr); },
      [groups, fn](std::unique_ptr<float[]>& sc, int64_t i, int64_t next) {
        int64_t local, local_next;
        const int64_t g = groups->find(i, local, next, local_next);
        fn(groups->prs[g], local, local_next, sc.get());
        return true;
      });
  return ffi::Error::Success();
}

ffi::Error Run(ffi::ThreadPool pool, Problem pr, Weights wt) { return RunGroups(pool, {pr}, wt); }

ffi::Error Check(ffi::AnyBuffer::Dimensions xd, ffi::AnyBuffer::Dimensions wd, ffi::AnyBuffer::Dimensions yd,
                 int64_t scale_len, const char* what) {
  if (xd[1] != wd[1] || wd[2] != kPanel || yd[0] != xd[0] || yd[1] > wd[0] * kPanel ||
      yd[1] <= (wd[0] - 1) * kPanel || (scale_len >= 0 && scale_len != wd[0] * kPanel))
    return ffi::Error::InvalidArgument(std::string(what) + ": x [M, K], w [ceil(N / 64), K, 64]" +
                                       (scale_len >= 0 ? ", scale [ceil(N / 64) * 64]" : "") +
                                       " -> y [M, N]; got x " + jaxserve_cpu::dims_str(xd) + ", w " + jaxserve_cpu::dims_str(wd) + ", y " +
                                       jaxserve_cpu::dims_str(yd));
  return ffi::Error::Success();
}

Problem Make(const float* x, const void* w, const float* scale, float* y, ffi::AnyBuffer::Dimensions xd,
             ffi::AnyBuffer::Dimensions wd, ffi::AnyBuffer::Dimensions yd) {
  Problem pr{};
  pr.x = x;
  pr.w = w;
  pr.scale = scale;
  pr.y = y;
  pr.M = xd[0];
  pr.K = xd[1];
  pr.P = wd[0];
  pr.N = yd[1];
  pr.Kpad = pr.K;
  return pr;
}

// Rows at and past live[0] (a ragged step's padding tokens) are not multiplied: they are
// zeroed, so a padded token bucket costs no arithmetic and no extra weight reads.
int64_t LiveRows(ffi::BufferR1<ffi::S32> live, int64_t m, float* y, int64_t n) {
  const int64_t rows = live.dimensions()[0] > 0 ? std::clamp<int64_t>(live.typed_data()[0], 0, m) : m;
  if (rows < m) std::memset(y + rows * n, 0, sizeof(float) * (m - rows) * n);
  return rows;
}

ffi::Error MatmulF32Impl(ffi::ThreadPool pool, ffi::BufferR2<ffi::F32> x, ffi::BufferR3<ffi::F32> w,
                         ffi::BufferR1<ffi::S32> live, ffi::ResultBufferR2<ffi::F32> y) {
  if (auto e = Check(x.dimensions(), w.dimensions(), y->dimensions(), -1, "matmul"); e.failure()) return e;
  Problem pr = Make(x.typed_data(), w.typed_data(), nullptr, y->typed_data(), x.dimensions(), w.dimensions(),
                    y->dimensions());
  pr.M = LiveRows(live, pr.M, pr.y, pr.N);
  if (pr.M == 0) return ffi::Error::Success();
  return Run(pool, pr, Weights::kF32);
}

ffi::Error MatmulQ8Impl(ffi::ThreadPool pool, ffi::BufferR2<ffi::F32> x, ffi::BufferR3<ffi::S8> w,
                        ffi::BufferR1<ffi::F32> scale, ffi::BufferR1<ffi::S32> live, ffi::ResultBufferR2<ffi::F32> y) {
  if (auto e = Check(x.dimensions(), w.dimensions(), y->dimensions(), scale.dimensions()[0], "int8 matmul");
      e.failure())
    return e;
  Problem pr = Make(x.typed_data(), w.typed_data(), scale.typed_data(), y->typed_data(), x.dimensions(),
                    w.dimensions(), y->dimensions());
  pr.M = LiveRows(live, pr.M, pr.y, pr.N);
  if (pr.M == 0) return ffi::Error::Success();
  return Run(pool, pr, Weights::kQ8);
}

// ---- bfloat16 weights on the AMX tiles (or AVX512-BF16) ------------------------------------------------------
//
//   y[m, n] = sum_k bf16(x[m, k]) * w[k, n]     (w bfloat16, products and sums in float32)
//
// Layout (pallas_kernels/native_matmul.py pack_bf16): the same panels of 64 columns, each cut
// along K into blocks of 32 (K zero-padded to KB = ceil(K / 32) blocks), each block 16 k pairs x
// 64 columns x 2: element [kk][j][c][e] = w[32 kb + 2 kk + e, 64 p + 16 j + c].  Row kk of AMX
// "B" tile j (16 columns x one k pair, the VNNI pairs TDPBF16PS reads) is the 64 bytes at
// 128 kk + 32 j, so a tile load takes its 16 rows at a stride of 256 bytes, and the dot-product
// path reads a k pair's four weight vectors as one contiguous 256 bytes: the panel in order.  (With
// each tile's rows contiguous instead, one row of x read the weights as four streams a KiB apart,
// at half the memory's speed on an AVX512-BF16 host.)  The whole array is [P, KB, 2048] bfloat16; a
// panel is one contiguous run read front to back.
//
// Each work item converts its rows of x to bfloat16 once (round to nearest even, zero past K)
// into a per-thread scratch, then for each of its panels and each block of up to 32 rows runs
// one micro-kernel in the 8 tile registers:
//   - up to 16 rows: 4 accumulators (16 x 16 float32 each, the panel's 64 columns), 1 A tile,
//     3 B tiles in rotation;
//   - 17-32 rows: 2 x 2 accumulators, 2 A tiles, 2 B tiles, the panel in two halves (each B tile
//     loaded once for 32 rows).
// Tile heights are set to the block's rows (LDTILECFG), so no row past M is read or written.
// A row's result depends only on that row and the weights (the k order is fixed): batched
// equals alone, bit for bit.
//
// The tiles need the process's permission (arch_prctl, asked in paged_attention.cc's
// detect_isa()), so this code runs only when jaxserve_cpu_isa() is 4 (at 3, AVX512-BF16 without
// the tiles, dp_block below reads the same layout); the library itself is
// still built for any x86-64 (function-level target attributes).

constexpr int64_t kKBlock = 32;              // k per tile step (native_matmul.K_BLOCK)
constexpr int64_t kBlockElems = kPanel * kKBlock;  // bf16 elements per (panel, k block): 2048
constexpr int64_t kTileCols = 32;           // bf16 elements of one B tile row: 16 columns x 2
constexpr int64_t kPairRow = 2 * kPanel;     // elements of one k pair of a panel: 64 columns x 2
constexpr int64_t kPairRowBytes = 2 * kPairRow;  // ... in bfloat16: a tile load's row stride
constexpr int64_t kBfRowsPerItem = 128;      // the item's rows in bf16 stay in L2

struct BfProblem {
  const float* x;     // [M, K]
  const uint16_t* w;  // [P, KB, 2048] bfloat16, or null for int8 weights:
  const int8_t* q;    // [P, KB, 2048] int8 in the same element order (W8A16), or null
  const float* scale; // [P * 64] with q: each column's scale, applied to its sums
  float* y;           // [M, N]
  int64_t M, K, N, P, KB;
  int64_t rows_per_item, panels_per_item, panel_items, n_items;
  bool tiles;         // this problem runs on the AMX tiles (else AVX512-BF16 dot products)
};

#if JM_X86 && JAXSERVE_CAN_AMX
#define JM_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16,avx512vl,avx512bw,avx2,fma")))
#define JM_BF16 __attribute__((target("avx512f,avx512bf16,avx512vl,avx512bw,avx512dq,avx2,fma")))

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3 accumulate, 4(-5) hold x, the rest weights; r1 == 0: one block of r0 rows.
JM_AMX void load_config(int r0, int r1) {
  TileConfig c{};
  c.palette = 1;
  const int rows1[8] = {r0, r0, r0, r0, r0, 16, 16, 16};
  const int rows2[8] = {r0, r0, r1, r1, r0, r1, 16, 16};
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = uint8_t(r1 ? rows2[t] : rows1[t]);
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// Rows of x (float32 [rows, K]) -> bfloat16 [rows, ld], zero past K.
JM_BF16 void convert_rows(const float* x, int64_t K, int64_t rows, int64_t ld, uint16_t* a) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * K;
    uint16_t* ar = a + r * ld;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(ar + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(xr + k)));
    if (k < K) {
      const __mmask16 live = __mmask16((1u << (K - k)) - 1);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(ar + k),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(live, xr + k)));
      k += 16;
    }
    for (; k < ld; ++k) ar[k] = 0;
  }
}

// Accumulator tile `t` (rows r, 16 columns from column c) into y, or as many columns as are
// live (the last panel's padding is dropped).
#define JM_STORE(t, r, m, c)                                                        \
  do {                                                                              \
    if ((c) + 16 <= pr.N) {                                                         \
      _tile_stored(t, pr.y + (m) * pr.N + (c), pr.N * 4);                           \
    } else if ((c) < pr.N) {                                                        \
      _tile_stored(t, buf, 64);                                                     \
      for (int64_t i_ = 0; i_ < (r); ++i_)                                          \
        std::memcpy(pr.y + ((m) + i_) * pr.N + (c), buf + i_ * 16, 4 * (pr.N - (c))); \
    }                                                                               \
  } while (0)

// Rows m .. m + r0 (<= 16) of one panel: A at `a` (row stride lda bytes).
JM_AMX void block16(const BfProblem& pr, const uint16_t* a, int64_t lda, const uint16_t* wp, int64_t p, int64_t m,
                    int r0, float* buf) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kb = 0; kb < pr.KB; ++kb) {
    const uint16_t* b = wp + kb * kBlockElems;
    _tile_loadd(4, a + kb * kKBlock, lda);
    _tile_loadd(5, b, kPairRowBytes);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, b + kTileCols, kPairRowBytes);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, b + 2 * kTileCols, kPairRowBytes);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, b + 3 * kTileCols, kPairRowBytes);
    _tile_dpbf16ps(3, 4, 5);
  }
  const int64_t c = p * kPanel;
  JM_STORE(0, r0, m, c);
  JM_STORE(1, r0, m, c + 16);
  JM_STORE(2, r0, m, c + 32);
  JM_STORE(3, r0, m, c + 48);
}

// Rows m .. m + 16 + r1 (r1 in 1..16) of one panel, in two halves of 32 columns.
JM_AMX void block32(const BfProblem& pr, const uint16_t* a, int64_t lda, const uint16_t* wp, int64_t p, int64_t m,
                    int r1, float* buf) {
  const uint16_t* a1 = a + 16 * (lda / 2);
  for (int half = 0; half < 2; ++half) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < pr.KB; ++kb) {
      const uint16_t* b = wp + kb * kBlockElems + 2 * half * kTileCols;
      _tile_loadd(4, a + kb * kKBlock, lda);
      _tile_loadd(6, b, kPairRowBytes);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, b + kTileCols, kPairRowBytes);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(5, a1 + kb * kKBlock, lda);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    const int64_t c = p * kPanel + 32 * half;
    JM_STORE(0, 16, m, c);
    JM_STORE(1, 16, m, c + 16);
    JM_STORE(2, r1, m + 16, c);
    JM_STORE(3, r1, m + 16, c + 16);
  }
}
#undef JM_STORE

JM_BF16 void widen_panel(const int8_t* src, int64_t KB, uint16_t* dst);  // below
JM_BF16 void scale_columns(const BfProblem& pr, int64_t p, int64_t m0, int64_t m1);

// One item: rows [m0, m1) x panels [p0, p1).  `a`: scratch for rows_per_item x KB * 32 bf16;
// `buf`: 16 x 16 floats; `wide`: KB x 2048 bf16, where an int8 panel is widened first (its
// columns' scales applied to y after the panel's tiles).
JM_AMX void bf16_item(const BfProblem& pr, int64_t item, uint16_t* a, uint16_t* wide, float* buf) {
  const int64_t pi = item % pr.panel_items, ri = item / pr.panel_items;
  const int64_t p0 = pi * pr.panels_per_item, p1 = std::min(pr.P, p0 + pr.panels_per_item);
  const int64_t m0 = ri * pr.rows_per_item, m1 = std::min(pr.M, m0 + pr.rows_per_item);
  const int64_t ld = pr.KB * kKBlock, lda = 2 * ld;
  convert_rows(pr.x + m0 * pr.K, pr.K, m1 - m0, ld, a);
  int cur0 = -1, cur1 = -1;
  for (int64_t p = p0; p < p1; ++p) {
    const uint16_t* wp = pr.q ? wide : pr.w + p * pr.KB * kBlockElems;
    if (pr.q) widen_panel(pr.q + p * pr.KB * kBlockElems, pr.KB, wide);
    for (int64_t m = m0; m < m1; m += 32) {
      const int r = int(std::min<int64_t>(32, m1 - m)), r0 = std::min(16, r), r1 = r - r0;
      if (r0 != cur0 || r1 != cur1) {
        load_config(r0, r1);
        cur0 = r0, cur1 = r1;
      }
      if (r1)
        block32(pr, a + (m - m0) * ld, lda, wp, p, m, r1, buf);
      else
        block16(pr, a + (m - m0) * ld, lda, wp, p, m, r0, buf);
    }
    if (pr.q) scale_columns(pr, p, m0, m1);
  }
  _tile_release();
}

// ---- the same weights by AVX512-BF16 dot products (hosts without the tiles) ----
//
// Row kk of tile j of a (panel, k block) is 16 columns x one k pair: exactly the 32 bfloat16
// lanes VDPBF16PS reads as its second operand, lane c += x[2kk] w[2kk, c] + x[2kk+1] w[2kk+1, c]
// when the first operand is the row's pair (x[2kk], x[2kk+1]) broadcast as one 32-bit word.  So
// the AMX layout serves as it is: R rows x the panel's 64 columns in 4R float32 accumulators
// (R <= 6: 24 of the 32 vector registers), 4 weight vectors per k pair shared by the R rows.  A
// row's sums run over k in the same order whatever R is: batched equals alone, bit for bit.
//
// int8 weights (W8A16) come one byte each, in blocks of the same shape ([KB, 2048] per panel;
// within a k pair's 128 bytes in widen_pair_row's order).  An int8 value is exact in bfloat16
// (8 significant bits), so they widen to the bfloat16 layout's weight vectors and the dot
// products are the bfloat16 path's; each column's scale
// multiplies its sums once, at the store.  A call of a few rows widens in registers, k pair by k
// pair (Q8 below); more rows widen each panel once into a per-thread bf16 copy (widen_panel, L2)
// that every block of rows then reads as bfloat16 panels: the same values in the same order,
// so a row's result is the same either way.

// One k pair of an int8 (panel, k block): 128 bytes -> the 4 bfloat16 weight vectors of the
// bfloat16 layout (tile j's row kk).  The int8 bytes are ordered for this (native_matmul.py
// pack_int8_bf16): in each 64-byte half l, byte b of 32-bit lane i holds k parity i & 1 of
// column 16 (2l + b / 2) + 8 (b % 2) + i / 2, so that in-lane shifts sign-extend each byte
// position into a float vector and a pack of two of them is a tile row in column order: about
// half the cost of widening bytes across lanes (VPMOVSXBD), which made a row of int8 weights
// compute-bound here.
JM_BF16 JM_INLINE void widen_pair_row(const int8_t* src, __m512bh (&bv)[4]) {
  for (int l = 0; l < 2; ++l) {
    const __m512i v = _mm512_loadu_si512(src + 64 * l);
    const __m512 f0 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24));
    const __m512 f1 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 24));
    const __m512 f2 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 8), 24));
    const __m512 f3 = _mm512_cvtepi32_ps(_mm512_srai_epi32(v, 24));
    bv[2 * l] = _mm512_cvtne2ps_pbh(f1, f0);
    bv[2 * l + 1] = _mm512_cvtne2ps_pbh(f3, f2);
  }
}

// One int8 panel ([KB, 2048] bytes) -> bfloat16 [KB, 2048] in the bfloat16 layout.
JM_BF16 void widen_panel(const int8_t* src, int64_t KB, uint16_t* dst) {
  for (int64_t kb = 0; kb < KB; ++kb)
    for (int kk = 0; kk < 16; ++kk) {
      __m512bh bv[4];
      widen_pair_row(src + kb * kBlockElems + kk * kPairRow, bv);
      for (int j = 0; j < 4; ++j) _mm512_storeu_si512(dst + kb * kBlockElems + kk * kPairRow + j * kTileCols, (__m512i)bv[j]);
    }
}

// y[m0 .. m1, panel p's columns] *= their scales.
JM_BF16 void scale_columns(const BfProblem& pr, int64_t p, int64_t m0, int64_t m1) {
  for (int j = 0; j < 4; ++j) {
    const int64_t c = p * kPanel + 16 * j;
    if (c >= pr.N) break;
    const __mmask16 live = c + 16 <= pr.N ? __mmask16(0xffff) : __mmask16((1u << (pr.N - c)) - 1);
    const __m512 s = _mm512_loadu_ps(pr.scale + c);
    for (int64_t m = m0; m < m1; ++m) {
      float* y = pr.y + m * pr.N + c;
      _mm512_mask_storeu_ps(y, live, _mm512_mul_ps(_mm512_maskz_loadu_ps(live, y), s));
    }
  }
}

// int8 weights: prefetch this far ahead of the k pair being widened (two k blocks): a few rows
// widen in registers, enough arithmetic per byte that the hardware prefetcher alone let a row
// fall to 0.8x the float32-arithmetic int8 kernel's streaming rate here.
constexpr int64_t kQ8Prefetch = 4096;
// Up to this many rows per item, each block of 6 rows widens the int8 panel again in registers;
// past it the panel is widened once into bfloat16 scratch that every block reads (or, on AMX,
// the tiles take it).  Measured with this constant at 6, 12, 36 and unbounded (AVX512-BF16, 2
// cores, 30 projections of 576 x 3072): widening again beat the scratch copy by 1.3-1.5x from 8
// to 32 rows, and lost from 64 rows on.
constexpr int64_t kQ8WidenOnce = 36;

// WT: uint16_t (bfloat16 weights) or int8_t (widened here).  scale: null, or the columns' scales.
template <int R, class WT>
JM_BF16 void dp_block(const BfProblem& pr, const uint16_t* a, int64_t ld, const WT* wp, int64_t p, int64_t m,
                      const float* scale) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < pr.KB; ++kb) {
    const WT* b = wp + kb * kBlockElems;
    const uint16_t* ak = a + kb * kKBlock;
#pragma GCC unroll 4
    for (int kk = 0; kk < 16; ++kk) {
      __m512bh bv[4];
      if constexpr (std::is_same_v<WT, int8_t>) {
        _mm_prefetch(reinterpret_cast<const char*>(b + kk * kPairRow + kQ8Prefetch), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(b + kk * kPairRow + kQ8Prefetch + 64), _MM_HINT_T0);
        widen_pair_row(b + kk * kPairRow, bv);
      }
      else
        for (int j = 0; j < 4; ++j) bv[j] = (__m512bh)_mm512_loadu_si512(b + kk * kPairRow + j * kTileCols);
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, ak + r * ld + 2 * kk, 4);
        const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], av, bv[j]);
      }
    }
  }
  for (int j = 0; j < 4; ++j) {
    const int64_t c = p * kPanel + 16 * j;
    if (c >= pr.N) break;
    const __mmask16 live = c + 16 <= pr.N ? __mmask16(0xffff) : __mmask16((1u << (pr.N - c)) - 1);
    const __m512 s = scale ? _mm512_loadu_ps(scale + c) : _mm512_set1_ps(1.0f);
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(pr.y + (m + r) * pr.N + c, live, scale ? _mm512_mul_ps(acc[r][j], s) : acc[r][j]);
  }
}

// Rows m .. m + rows (<= 6) of panel p.
template <class WT>
JM_BF16 void dp_rows(const BfProblem& pr, const uint16_t* am, int64_t ld, const WT* wp, int64_t p, int64_t m,
                     int64_t rows, const float* scale) {
  switch (rows) {
    case 1: dp_block<1>(pr, am, ld, wp, p, m, scale); break;
    case 2: dp_block<2>(pr, am, ld, wp, p, m, scale); break;
    case 3: dp_block<3>(pr, am, ld, wp, p, m, scale); break;
    case 4: dp_block<4>(pr, am, ld, wp, p, m, scale); break;
    case 5: dp_block<5>(pr, am, ld, wp, p, m, scale); break;
    default: dp_block<6>(pr, am, ld, wp, p, m, scale); break;
  }
}

// One item (as bf16_item): rows in blocks of 6, each over every panel of the item in turn (the
// panel, KB x 4 KiB, stays in L2 for the next block of rows).  `wide`: KB x 2048 bf16 of scratch
// for an int8 panel widened once (int8 weights only).
JM_BF16 void bf16_dp_item(const BfProblem& pr, int64_t item, uint16_t* a, uint16_t* wide) {
  const int64_t pi = item % pr.panel_items, ri = item / pr.panel_items;
  const int64_t p0 = pi * pr.panels_per_item, p1 = std::min(pr.P, p0 + pr.panels_per_item);
  const int64_t m0 = ri * pr.rows_per_item, m1 = std::min(pr.M, m0 + pr.rows_per_item);
  const int64_t ld = pr.KB * kKBlock;
  const bool widen_once = pr.q && m1 - m0 > kQ8WidenOnce;
  convert_rows(pr.x + m0 * pr.K, pr.K, m1 - m0, ld, a);
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t off = p * pr.KB * kBlockElems;
    if (widen_once) widen_panel(pr.q + off, pr.KB, wide);
    for (int64_t m = m0; m < m1; m += 6) {
      const uint16_t* am = a + (m - m0) * ld;
      const int64_t rows = std::min<int64_t>(6, m1 - m);
      if (!pr.q)
        dp_rows(pr, am, ld, pr.w + off, p, m, rows, nullptr);
      else if (widen_once)
        dp_rows(pr, am, ld, static_cast<const uint16_t*>(wide), p, m, rows, pr.scale);
      else
        dp_rows(pr, am, ld, pr.q + off, p, m, rows, pr.scale);
    }
  }
}
#endif

// ---- the same bfloat16 weights on AVX2 / AVX-512 (hosts without bfloat16 arithmetic) ----
//
// The float32 kernel above runs them (its bf16_t panels): a 32-bit word of the pair layout is
// one column's (w[2kk], w[2kk+1]), and a bfloat16 is the top half of a float32, so a 16-bit
// shift left gives row 2kk's weights as floats and a mask of the low half row 2kk + 1's.  The
// point is the bytes, not the arithmetic: a decode step streams every weight once, and these
// are half of float32's.  x is first rounded to bfloat16 here (round to nearest even, as the
// bfloat16 units do), so every product is exact and a row's result is the float32 kernel's on
// the rounded operands, bit for bit, whatever the rows beside it.
#if JM_X86
// x (float32 [rows, K]) -> the same rounded to bfloat16, as float32.
__attribute__((target("avx2,fma"))) void round_to_bf16(const float* x, int64_t n, float* out) {
  const __m256i half = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
  const __m256i top = _mm256_set1_epi32(int(0xffff0000u)), quiet = _mm256_set1_epi32(0x400000);
  for (int64_t i = 0; i < n; i += 8) {
    float part[8] = {};
    const int64_t live = std::min<int64_t>(8, n - i);
    std::memcpy(part, x + i, sizeof(float) * live);
    const __m256 v = _mm256_loadu_ps(part);
    const __m256i b = _mm256_castps_si256(v);
    const __m256i rne = _mm256_and_si256(
        _mm256_add_epi32(_mm256_add_epi32(b, half), _mm256_and_si256(_mm256_srli_epi32(b, 16), one)), top);
    const __m256i nan = _mm256_and_si256(_mm256_or_si256(b, quiet), top);  // NaN stays NaN
    _mm256_storeu_ps(part, _mm256_blendv_ps(_mm256_castsi256_ps(rne), _mm256_castsi256_ps(nan),
                                            _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    std::memcpy(out + i, part, sizeof(float) * live);
  }
}
#endif

// Work split: rows in blocks of at most kBfRowsPerItem (whole 32-row tiles but the last),
// panels in runs so that there are about kItemsPerWorker items per thread, none smaller than
// kItemElems weights.
// prs: problems whose x rows all lie in x_all [rows_all, K] (a grouped matmul's experts, or one).
ffi::Error RunBf16Groups(ffi::ThreadPool pool, const std::vector<BfProblem>& prs, const float* x_all,
                         int64_t rows_all) {
  if (prs.empty()) return ffi::Error::Success();
  const bool q8 = prs[0].q != nullptr;
  const int isa = jaxserve_cpu_isa();
  // bfloat16 weights: AVX2 and up (float32 arithmetic below AVX512-BF16); int8 pair-layout
  // weights: the bfloat16 units only (an AVX2 host packs int8 as float32-arithmetic panels).
  if (isa < (q8 ? 3 : 1))
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      q8 ? "int8 matmul (bfloat16 pair layout): needs AVX512-BF16 or the AMX tiles, which this host "
                           "lacks or JAXSERVE_CPU_ISA turned off (pack the weights with pack_int8 instead)"
                         : "bfloat16 matmul: needs AVX2, which this host lacks or JAXSERVE_CPU_ISA turned off "
                           "(pack the weights as float32 instead)");
#if JM_X86
  if (isa < 3) {  // AVX2 or AVX-512 without bfloat16 arithmetic: the float32 kernel on rounded x
    const int64_t K = prs[0].K;
    std::unique_ptr<float[]> xr(new (std::nothrow) float[rows_all * K]);
    if (!xr) return ffi::Error(ffi::ErrorCode::kResourceExhausted, "bfloat16 matmul: out of memory rounding x");
    round_to_bf16(x_all, rows_all * K, xr.get());
    std::vector<Problem> p32s;
    for (const BfProblem& pr : prs) {
      Problem p32{};
      p32.x = xr.get() + (pr.x - x_all);
      p32.w = pr.w;
      p32.y = pr.y;
      p32.M = pr.M;
      p32.K = pr.K;
      p32.N = pr.N;
      p32.P = pr.P;
      p32.Kpad = pr.KB * kKBlock;
      p32s.push_back(p32);
    }
    return RunGroups(pool, p32s, Weights::kBf16);
  }
#endif
#if JM_X86 && JAXSERVE_CAN_AMX
  const int64_t workers = std::max<int64_t>(1, pool.num_threads());
  auto groups = std::make_shared<Groups<BfProblem>>();
  int64_t rows_elems = 0, wide_elems = 0;
  for (BfProblem pr : prs) {
    if (pr.M == 0 || pr.N == 0) continue;
    const int64_t row_blocks0 = (pr.M + kBfRowsPerItem - 1) / kBfRowsPerItem;
    pr.rows_per_item = 32 * (((pr.M + row_blocks0 - 1) / row_blocks0 + 31) / 32);
    const int64_t row_blocks = (pr.M + pr.rows_per_item - 1) / pr.rows_per_item;
    const int64_t by_size = std::max<int64_t>(1, pr.P * pr.KB * kBlockElems / kItemElems);
    const int64_t want = (kItemsPerWorker * workers + row_blocks - 1) / row_blocks;
    pr.panel_items = std::clamp<int64_t>(std::min(want, by_size), 1, pr.P);
    pr.panels_per_item = (pr.P + pr.panel_items - 1) / pr.panel_items;
    pr.panel_items = (pr.P + pr.panels_per_item - 1) / pr.panels_per_item;
    pr.n_items = pr.panel_items * row_blocks;
    // Up to kQ8WidenOnce rows, int8 weights widen in registers (dot products) whatever the host:
    // the tiles would need each panel widened into memory first, a second pass over it.
    pr.tiles = isa >= 4 && !(pr.q && pr.M <= kQ8WidenOnce);
    // Per thread: the item's x rows in bf16, an int8 panel widened (int8 weights only), 256 floats.
    rows_elems = std::max(rows_elems, pr.rows_per_item * pr.KB * kKBlock);
    wide_elems = std::max(wide_elems, pr.q ? pr.KB * kBlockElems : 0);
    groups->add(pr);
  }
  const int64_t scratch = rows_elems + wide_elems + 2 * 256;
  jaxserve_cpu::run_items(
      pool, groups->total(),
      [scratch] { return std::unique_ptr<uint16_t[]>(new (std::nothrow) uint16_t[scratch + 32]); },
      [groups, rows_elems, wide_elems](std::unique_ptr<uint16_t[]>& sc, int64_t i) {
        if (!sc) return false;
        uint16_t* base = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(sc.get()) + 63) & ~uintptr_t(63));
        uint16_t* wide = base + rows_elems;
        int64_t local, unused;
        const BfProblem& pr = groups->prs[groups->find(i, local, -1, unused)];
        if (pr.tiles)
          bf16_item(pr, local, base, wide, reinterpret_cast<float*>(wide + wide_elems));
        else
          bf16_dp_item(pr, local, base, wide);
        return true;
      });
  return ffi::Error::Success();
#else
  (void)pool;
  return ffi::Error::Internal("unreachable");
#endif
}

ffi::Error RunBf16(ffi::ThreadPool pool, BfProblem pr) {
  if (pr.M == 0 || pr.N == 0) return ffi::Error::Success();
  return RunBf16Groups(pool, {pr}, pr.x, pr.M);
}

// Shapes and the problem for bfloat16 or int8 pair-layout weights (w or q, the other null).
ffi::Error RunPairs(ffi::ThreadPool pool, const float* x, const uint16_t* w, const int8_t* q, const float* scale,
                    ffi::BufferR1<ffi::S32> live, float* y, ffi::AnyBuffer::Dimensions xd,
                    ffi::AnyBuffer::Dimensions wd, ffi::AnyBuffer::Dimensions yd, int64_t scale_len) {
  const char* what = q ? "int8 matmul (bfloat16 pair layout)" : "bfloat16 matmul";
  if (wd[1] != (xd[1] + kKBlock - 1) / kKBlock || wd[2] != kBlockElems || yd[0] != xd[0] || yd[1] > wd[0] * kPanel ||
      yd[1] <= (wd[0] - 1) * kPanel || (q && scale_len != wd[0] * kPanel))
    return ffi::Error::InvalidArgument(std::string(what) + ": x [M, K], w [ceil(N / 64), ceil(K / 32), 2048]" +
                                       (q ? ", scale [ceil(N / 64) * 64]" : "") + " -> y [M, N]; got x " +
                                       jaxserve_cpu::dims_str(xd) + ", w " + jaxserve_cpu::dims_str(wd) + ", y " +
                                       jaxserve_cpu::dims_str(yd));
  BfProblem pr{};
  pr.x = x;
  pr.w = w;
  pr.q = q;
  pr.scale = scale;
  pr.y = y;
  pr.M = xd[0];
  pr.K = xd[1];
  pr.N = yd[1];
  pr.P = wd[0];
  pr.KB = wd[1];
  if (pr.K == 0) {
    std::memset(pr.y, 0, sizeof(float) * pr.M * pr.N);
    return ffi::Error::Success();
  }
  pr.M = LiveRows(live, pr.M, pr.y, pr.N);
  if (pr.M == 0) return ffi::Error::Success();
  return RunBf16(pool, pr);
}

ffi::Error MatmulBf16Impl(ffi::ThreadPool pool, ffi::BufferR2<ffi::F32> x, ffi::BufferR3<ffi::BF16> w,
                          ffi::BufferR1<ffi::S32> live, ffi::ResultBufferR2<ffi::F32> y) {
  return RunPairs(pool, x.typed_data(), reinterpret_cast<const uint16_t*>(w.typed_data()), nullptr, nullptr, live,
                  y->typed_data(), x.dimensions(), w.dimensions(), y->dimensions(), -1);
}

ffi::Error MatmulQ8Bf16Impl(ffi::ThreadPool pool, ffi::BufferR2<ffi::F32> x, ffi::BufferR3<ffi::S8> w,
                            ffi::BufferR1<ffi::F32> scale, ffi::BufferR1<ffi::S32> live,
                            ffi::ResultBufferR2<ffi::F32> y) {
  return RunPairs(pool, x.typed_data(), nullptr, w.typed_data(), scale.typed_data(), live, y->typed_data(),
                  x.dimensions(), w.dimensions(), y->dimensions(), scale.dimensions()[0]);
}

// ---- grouped: a mixture-of-experts layer's experts, one call for all of them ----
//
//   y[r, n] = sum_k x[r, k] * w[g, k, n]     for every row r of group g (times scale[g, n] for int8)
//
// The rows are sorted by group: group g's sizes[g] rows follow those of groups 0 .. g - 1, and
// rows past every group come out as zeros.  w stacks G weights packed as the plain matmul packs a
// projection, any of its four layouts: [G, P, K, 64] float32 or int8 (scales [G, P * 64]), or
// [G, P, ceil(K / 32), 2048] bfloat16 or int8 pairs (scales [G, P * 64]).  Each group with rows is
// its own problem, cut into (row block, panel run) items as a projection is, and all groups'
// items run as one set on the pool: an expert nobody chose costs nothing, and the experts' few
// rows each share both threads instead of each group waiting for its own call.  A row's result
// is the plain matmul's against its group's weights (the same k order), whatever else is in the
// call.  (pallas_kernels/native_matmul.py grouped_matmul; models/qwen3_moe.py uses it.)
using Dims = ffi::AnyBuffer::Dimensions;

ffi::Error Grouped(ffi::ThreadPool pool, const float* x, const char* w, int64_t elem_bytes, const float* scale,
                   Dims sd, ffi::BufferR1<ffi::S32> sizes, float* y, Dims xd, Dims wd, Dims yd, Weights wt,
                   bool pairs) {
  const int64_t G = wd[0], M = xd[0], K = xd[1], N = yd[1], P = wd[1];
  const bool bad_w = pairs ? (wd[2] != (K + kKBlock - 1) / kKBlock || wd[3] != kBlockElems)
                           : (wd[2] != K || wd[3] != kPanel);
  if (bad_w || sizes.dimensions()[0] != G || yd[0] != M || N > P * kPanel || N <= (P - 1) * kPanel ||
      (scale && (sd[0] != G || sd[1] != P * kPanel)))
    return ffi::Error::InvalidArgument(
        std::string("grouped matmul: x [M, K], w [G, ceil(N / 64), ") +
        (pairs ? "ceil(K / 32), 2048]" : "K, 64]") + (scale ? ", scale [G, ceil(N / 64) * 64]" : "") +
        ", group sizes [G] -> y [M, N]; got x " + jaxserve_cpu::dims_str(xd) + ", w " + jaxserve_cpu::dims_str(wd) +
        ", y " + jaxserve_cpu::dims_str(yd) + ", sizes " + jaxserve_cpu::dims_str(sizes.dimensions()));
  const int64_t stack_bytes = P * wd[2] * wd[3] * elem_bytes;
  const int32_t* sz = sizes.typed_data();
  std::vector<Problem> prs;
  std::vector<BfProblem> bprs;
  int64_t start = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t n = std::clamp<int64_t>(sz[g], 0, M - start);
    if (n == 0) continue;
    const char* wg = w + g * stack_bytes;
    const float* sg = scale ? scale + g * P * kPanel : nullptr;
    if (pairs) {
      BfProblem b{};
      b.x = x + start * K;
      b.w = scale ? nullptr : reinterpret_cast<const uint16_t*>(wg);
      b.q = scale ? reinterpret_cast<const int8_t*>(wg) : nullptr;
      b.scale = sg;
      b.y = y + start * N;
      b.M = n, b.K = K, b.N = N, b.P = P, b.KB = wd[2];
      bprs.push_back(b);
    } else {
      Problem pr{};
      pr.x = x + start * K;
      pr.w = wg;
      pr.scale = sg;
      pr.y = y + start * N;
      pr.M = n, pr.K = K, pr.N = N, pr.P = P, pr.Kpad = K;
      prs.push_back(pr);
    }
    start += n;
  }
  std::memset(y + start * N, 0, sizeof(float) * (M - start) * N);
  if (K == 0 || N == 0) {
    std::memset(y, 0, sizeof(float) * start * N);
    return ffi::Error::Success();
  }
  return pairs ? RunBf16Groups(pool, bprs, x, start) : RunGroups(pool, prs, wt);
}

ffi::Error GroupedF32Impl(ffi::ThreadPool pool, ffi::BufferR2<ffi::F32> x, ffi::BufferR4<ffi::F32> w,
                          ffi::BufferR1<ffi::S32> sizes, ffi::ResultBufferR2<ffi::F32> y) {
  return Grouped(pool, x.typed_data(), reinterpret_cast<const char*>(w.typed_data()), 4, nullptr, {}, sizes,
                 y->typed_data(), x.dimensions(), w.dimensions(), y->dimensions(), Weights::kF32, false);
}

ffi::Error GroupedQ8Impl(ffi::ThreadPool pool, ffi::BufferR2<ffi::F32> x, ffi::BufferR4<ffi::S8> w,
                         ffi::BufferR2<ffi::F32> scale, ffi::BufferR1<ffi::S32> sizes,
                         ffi::ResultBufferR2<ffi::F32> y) {
  return Grouped(pool, x.typed_data(), reinterpret_cast<const char*>(w.typed_data()), 1, scale.typed_data(),
                 scale.dimensions(), sizes, y->typed_data(), x.dimensions(), w.dimensions(), y->dimensions(),
                 Weights::kQ8, false);
}

ffi::Error GroupedBf16Impl(ffi::ThreadPool pool, ffi::BufferR2<ffi::F32> x, ffi::BufferR4<ffi::BF16> w,
                           ffi::BufferR1<ffi::S32> sizes, ffi::ResultBufferR2<ffi::F32> y) {
  return Grouped(pool, x.typed_data(), reinterpret_cast<const char*>(w.typed_data()), 2, nullptr, {}, sizes,
                 y->typed_data(), x.dimensions(), w.dimensions(), y->dimensions(), Weights::kBf16, true);
}

ffi::Error GroupedQ8Bf16Impl(ffi::ThreadPool pool, ffi::BufferR2<ffi::F32> x, ffi::BufferR4<ffi::S8> w,
                             ffi::BufferR2<ffi::F32> scale, ffi::BufferR1<ffi::S32> sizes,
                             ffi::ResultBufferR2<ffi::F32> y) {
  return Grouped(pool, x.typed_data(), reinterpret_cast<const char*>(w.typed_data()), 1, scale.typed_data(),
                 scale.dimensions(), sizes, y->typed_data(), x.dimensions(), w.dimensions(), y->dimensions(),
                 Weights::kQ8, true);
}

}  // namespace

JM_EXPORT XLA_FFI_Error* JaxserveMatmulF32(XLA_FFI_CallFrame* call_frame);
JM_EXPORT XLA_FFI_Error* JaxserveMatmulQ8(XLA_FFI_CallFrame* call_frame);
JM_EXPORT XLA_FFI_Error* JaxserveMatmulBF16(XLA_FFI_CallFrame* call_frame);
JM_EXPORT XLA_FFI_Error* JaxserveMatmulQ8BF16(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulF32, MatmulF32Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR2<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::BufferR3<ffi::F32>>()   // w [P, K, 64]
                                  .Arg<ffi::BufferR1<ffi::S32>>()   // live rows: [1], or [0] for all
                                  .Ret<ffi::BufferR2<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulQ8, MatmulQ8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR2<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::BufferR3<ffi::S8>>()    // w [P, K, 64], interleaved
                                  .Arg<ffi::BufferR1<ffi::F32>>()   // scale [P * 64]
                                  .Arg<ffi::BufferR1<ffi::S32>>()   // live rows: [1], or [0] for all
                                  .Ret<ffi::BufferR2<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulBF16, MatmulBf16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR2<ffi::F32>>()    // x [M, K]
                                  .Arg<ffi::BufferR3<ffi::BF16>>()   // w [P, ceil(K / 32), 2048]
                                  .Arg<ffi::BufferR1<ffi::S32>>()    // live rows: [1], or [0] for all
                                  .Ret<ffi::BufferR2<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulQ8BF16, MatmulQ8Bf16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR2<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::BufferR3<ffi::S8>>()    // w [P, ceil(K / 32), 2048], pair layout
                                  .Arg<ffi::BufferR1<ffi::F32>>()   // scale [P * 64]
                                  .Arg<ffi::BufferR1<ffi::S32>>()   // live rows: [1], or [0] for all
                                  .Ret<ffi::BufferR2<ffi::F32>>());  // y [M, N]

JM_EXPORT XLA_FFI_Error* JaxserveGroupedMatmulF32(XLA_FFI_CallFrame* call_frame);
JM_EXPORT XLA_FFI_Error* JaxserveGroupedMatmulQ8(XLA_FFI_CallFrame* call_frame);
JM_EXPORT XLA_FFI_Error* JaxserveGroupedMatmulBF16(XLA_FFI_CallFrame* call_frame);
JM_EXPORT XLA_FFI_Error* JaxserveGroupedMatmulQ8BF16(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveGroupedMatmulF32, GroupedF32Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR2<ffi::F32>>()   // x [M, K], rows sorted by group
                                  .Arg<ffi::BufferR4<ffi::F32>>()   // w [G, P, K, 64]
                                  .Arg<ffi::BufferR1<ffi::S32>>()   // group sizes [G]
                                  .Ret<ffi::BufferR2<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveGroupedMatmulQ8, GroupedQ8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR2<ffi::F32>>()   // x [M, K], rows sorted by group
                                  .Arg<ffi::BufferR4<ffi::S8>>()    // w [G, P, K, 64], interleaved
                                  .Arg<ffi::BufferR2<ffi::F32>>()   // scale [G, P * 64]
                                  .Arg<ffi::BufferR1<ffi::S32>>()   // group sizes [G]
                                  .Ret<ffi::BufferR2<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveGroupedMatmulBF16, GroupedBf16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR2<ffi::F32>>()    // x [M, K], rows sorted by group
                                  .Arg<ffi::BufferR4<ffi::BF16>>()   // w [G, P, ceil(K / 32), 2048]
                                  .Arg<ffi::BufferR1<ffi::S32>>()    // group sizes [G]
                                  .Ret<ffi::BufferR2<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveGroupedMatmulQ8BF16, GroupedQ8Bf16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR2<ffi::F32>>()   // x [M, K], rows sorted by group
                                  .Arg<ffi::BufferR4<ffi::S8>>()    // w [G, P, ceil(K / 32), 2048], pair layout
                                  .Arg<ffi::BufferR2<ffi::F32>>()   // scale [G, P * 64]
                                  .Arg<ffi::BufferR1<ffi::S32>>()   // group sizes [G]
                                  .Ret<ffi::BufferR2<ffi::F32>>());  // y [M, N]

// Bumped whenever these kernels' FFI signatures or the packed layout change, so that a stale
// library is not used.
JM_EXPORT int jaxserve_matmul_abi_version() { return 7; }  // 2: the bfloat16 (AMX) target; 3: live rows; 4: int8 in the pair layout; 5: k-pair-major blocks; 6: bfloat16 on AVX2; 7: the grouped targets
