// Paged attention on the CPU, called from jitted JAX through XLA FFI.
//
// JaxserveRaggedPagedAttention[Q8], the semantics of
// pallas_kernels/reference.py::ragged_paged_attention: q [N, H, D] one flat array of tokens;
// row r owns tokens [query_start_loc[r], query_start_loc[r + 1]) (query_start_loc [R+1] int32,
// nondecreasing from 0) and reads its keys through block_tables[r] [P]; seq_lens [R];
// positions [N].  Token n of row r sees key j iff j < seq_lens[r] and j <= positions[n], and
// with a sliding window W > 0 (the `window` attribute; 0: none) also j > positions[n] - W.
// Decode rows have one token, prefill chunks many, speculative verification k + 1.
// A token that sees nothing, and every token outside all rows (padding past
// query_start_loc[R]), gets zeros.  Pages are [num_pages, page_size, KVH, D]; grouped-query
// attention: H = KVH * G; query head h uses KV head h / G.
// Pages are float32 or bfloat16 (read and widened to float32 here), or int8 with bfloat16 scales
// [num_pages, page_size, KVH] (the Q8 handlers: one scale per token per KV head, a key/value
// vector is q * scale; see reference.quantize_kv); q is float32 or bfloat16; all arithmetic and
// accumulation is float32; the output has q's dtype.
//
// Work split: one work item = (row, a block of KV heads, a block of up to 32 consecutive
// queries of the row, and past 1,024 keys a partition of them: kSplitChunks), listed on the host
// side of the handler (plan()) and sorted so that the costliest (long query blocks over long
// contexts) are taken first; a split row's partitions are merged once every item is done.
// The item walks the row's pages in block-table order, a chunk of whole pages (64 tokens) at a
// time: it reads each K and V vector of its KV heads once and uses it for all G query heads of
// that KV head and all queries of the block, with an online softmax per chunk; while it reads a
// chunk it prefetches the next, and during its last chunk the first chunk of the next item it
// will take (claimed ahead: work_pool.h).  Items are taken from a shared atomic counter by the calling thread and by tasks
// queued on XLA's own CPU thread pool; the caller returns only when every item is done, and is
// correct even if the pool never runs a task (a late task finds no item and touches nothing).
//
// No key at or beyond an item's last visible position (min(seq_len, max position + 1)) is
// ever read: the tail of the last page and the pages past the end may hold anything, NaN
// included.  Block-table entries are clamped into the pool, context lengths to the table width,
// query_start_loc into [previous start, N].
//
// Vector code uses GCC/Clang vector extensions, written once for a vector of N float lanes and
// compiled three times on x86-64: baseline (SSE2, N = 4), AVX2+FMA (N = 8) and AVX-512 (N = 16);
// the variant is chosen at run time from CPUID (JAXSERVE_CPU_ISA=generic|avx2|avx512 lowers it).
// Other hosts get the baseline (N = 4: NEON on aarch64).  Head dims 16, 32, 64, 96, 128 and 256
// take the vector path, specialised for the head dim; any other head dim takes a scalar path.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "work_pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define JS_X86 1
#endif

namespace ffi = xla::ffi;

#define JS_INLINE inline __attribute__((always_inline))
#define JS_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr float kNeg = -1e30f;  // running max starts here (as the reference's mask value)
constexpr int64_t kRound = 16;  // score rows and chunks are padded to a multiple of this

// Vectors of N lanes.
template <int N>
struct VT {
  typedef float F __attribute__((vector_size(4 * N)));
  typedef int32_t I __attribute__((vector_size(4 * N)));
  typedef uint32_t U __attribute__((vector_size(4 * N)));
  typedef uint16_t H __attribute__((vector_size(2 * N)));
};
template <int N>
using Vf = typename VT<N>::F;

template <int N>
JS_INLINE Vf<N> splat(float x) {
  return Vf<N>{} + x;
}
template <int N>
JS_INLINE Vf<N> vload(const float* p) {
  Vf<N> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <int N>
JS_INLINE Vf<N> vload(const uint16_t* p) {  // bfloat16 -> float32 is a 16-bit shift
  typename VT<N>::H h;
  std::memcpy(&h, p, sizeof h);
#if JS_X86 && defined(__GNUC__) && !defined(__clang__)
  // GCC lowers the 8-lane conversion below to two 128-bit halves joined (5 instructions in
  // place of one VPMOVZXWD): the builtin, expanded in the AVX2 / AVX-512 wrappers it is
  // inlined into, gives the one instruction.
  if constexpr (N == 8) {
    typedef short S8 __attribute__((vector_size(16)));
    return (Vf<N>)((typename VT<N>::U)__builtin_ia32_pmovzxwd256((S8)h) << 16);
  }
#endif
  typename VT<N>::U u = __builtin_convertvector(h, typename VT<N>::U) << 16;
  return (Vf<N>)u;
}
// int8 -> float32, exact, N lanes from p.  (__builtin_convertvector from int8 lanes is scalarised
// by GCC, and widening a 16-byte load to a 64-byte vector goes through the stack, a stalled
// store-to-load forward per vector.)  So 4N bytes are loaded as N 32-bit words (when they lie
// inside the pool: `end`), lane i takes word i/4 (vpermd), shifts its byte i%4 to the top and
// back down arithmetically (sign extension), and converts (vcvtdq2ps).
template <int N, int... I>
JS_INLINE Vf<N> load_i8(const int8_t* p, const int8_t* end, std::integer_sequence<int, I...>) {
  typename VT<N>::U w;
  if (p + sizeof w <= end) {
    std::memcpy(&w, p, sizeof w);
  } else {  // the last rows of the pool: no read past it
    w = typename VT<N>::U{};
    std::memcpy(&w, p, N);
  }
  typename VT<N>::U r = __builtin_shufflevector(w, w, (I / 4)...);
  const typename VT<N>::U shl = {uint32_t(24 - 8 * (I % 4))...};
  return __builtin_convertvector((typename VT<N>::I)(r << shl) >> 24, Vf<N>);
}
template <int N>
JS_INLINE Vf<N> vload_i8(const int8_t* p, const int8_t* end) {
  return load_i8<N>(p, end, std::make_integer_sequence<int, N>{});
}
template <int N>
JS_INLINE void vstore(float* p, Vf<N> v) {
  std::memcpy(p, &v, sizeof v);
}
JS_INLINE float widen(float x) { return x; }
JS_INLINE float widen(int8_t x) { return float(x); }
JS_INLINE float widen(uint16_t x) {
  uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
JS_INLINE uint16_t to_bf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

template <int N, int... I>
JS_INLINE Vf<N / 2> lower_half(Vf<N> v, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(v, v, I...);
}
template <int N, int... I>
JS_INLINE Vf<N / 2> upper_half(Vf<N> v, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(v, v, (I + N / 2)...);
}
template <int N>
JS_INLINE float hsum(Vf<N> v) {
  if constexpr (N == 4) {
    return (v[0] + v[2]) + (v[1] + v[3]);
  } else {
    constexpr auto seq = std::make_integer_sequence<int, N / 2>{};
    return hsum<N / 2>(lower_half<N>(v, seq) + upper_half<N>(v, seq));
  }
}
template <int N>
JS_INLINE Vf<N> vmax(Vf<N> a, Vf<N> b) {
  return a > b ? a : b;
}
template <int N>
JS_INLINE float hmax(Vf<N> v) {
  if constexpr (N == 4) {
    return std::max(std::max(v[0], v[1]), std::max(v[2], v[3]));
  } else {
    constexpr auto seq = std::make_integer_sequence<int, N / 2>{};
    return hmax<N / 2>(vmax<N / 2>(lower_half<N>(v, seq), upper_half<N>(v, seq)));
  }
}

// N dot products at once.  x[bitrev(j)] holds the N partial sums of dot product j;
// reduce_levels<N, N / 2>(x) leaves their total in lane j of x[0].  log2(N) levels; at level g
// each pair of vectors becomes one, lanes [o, o+g) from the first and [o+g, o+2g) from the second
// of every block of 2g lanes, summed with the other halves of those blocks: N-1 pairs of
// shuffles and an add in all, instead of N horizontal sums.
template <int N, int G, int Half>
constexpr int level_lane(int i) {
  const int o = i / (2 * G) * (2 * G), w = i % (2 * G);
  return w < G ? o + w + Half * G : N + o + (w - G) + Half * G;
}
template <int N, int G, int... I>
JS_INLINE Vf<N> reduce_pair(Vf<N> a, Vf<N> b, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(a, b, level_lane<N, G, 0>(I)...) +
         __builtin_shufflevector(a, b, level_lane<N, G, 1>(I)...);
}
template <int N, int G>
JS_INLINE void reduce_levels(Vf<N>* x) {
  for (int i = 0; i < G; ++i)
    x[i] = reduce_pair<N, G>(x[2 * i], x[2 * i + 1], std::make_integer_sequence<int, N>{});
  if constexpr (G > 1) reduce_levels<N, G / 2>(x);
}
template <int N>
constexpr int bitrev(int j) {
  int r = 0;
  for (int bit = 1, rbit = N / 2; bit < N; bit <<= 1, rbit >>= 1)
    if (j & bit) r |= rbit;
  return r;
}

// exp(x) for x <= 0 (Cephes expf: x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial for e^r,
// 2^n from the exponent bits); about 1 ulp.  Lanes below -87.3 give exactly 0.
template <int N>
JS_INLINE Vf<N> vexp(Vf<N> x) {
  using V = Vf<N>;
  const V lo = splat<N>(-87.33654f), hi = splat<N>(88.0f);
  V xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  V n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  V r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V y = splat<N>(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  typename VT<N>::I e = (__builtin_convertvector(n, typename VT<N>::I) + 127) << 23;
  y = y * (V)e;
  return x < lo ? splat<N>(0.0f) : y;
}

// One work item: row b, its queries [n0, n0 + nt) of the flat token array, KV heads
// [kh0, kh0 + min(khi, KVH - kh0)), the softmax chunks [c0, c1) of its keys.  part >= 0: one
// partition of a long row's keys (kSplitChunks chunks from a multiple of it), whose unnormalised
// result goes to partials slot `part`, merged with its siblings after every item is done.
struct WorkItem {
  int64_t b, n0, nt, kh0;
  int64_t c0 = 0, c1 = INT64_MAX, part = -1;
};

struct Problem {
  const void* q;  // [N, H, D]
  const void* k;
  const void* v;
  void* out;  // [N, H, D]
  const int32_t* bt;    // [R, P]
  const int32_t* lens;  // [R]
  const int32_t* pos;   // [N]
  const uint16_t* ks;   // int8 pages: bfloat16 scales [num_pages, ps, KVH] (else null)
  const uint16_t* vs;
  int64_t R, N, H, KVH, G, D, P, num_pages, ps;
  float scale;
  int64_t window;  // sliding window: keys per query, its own included (0: full attention)
  bool q_bf16;
  // Set by plan():
  int64_t khi;           // KV heads per item
  int64_t tb;            // the most queries in one item
  const WorkItem* items;  // n_items of them, in the order they are taken
  int64_t n_items;
  float* partials;        // per partition slot: its rows' (m, l, acc[D]), D + 2 floats each
  const int64_t* part_off;  // slot -> offset into partials
  int64_t cps, cl, clp;  // pages per softmax chunk, its tokens, rounded up to kRound
};

// Tokens per online-softmax step: whole pages, at least one.  Larger chunks spread the
// per-step cost (max, exp of the correction, rescaling) over more tokens.
constexpr int64_t kChunkTokens = 64;
// Queries per item: at most kMaxQueries (the scratch and the scores of a chunk stay in L1/L2);
// down to kMinQueries when a few long rows must be cut finer to give every thread work.
constexpr int64_t kMaxQueries = 32, kMinQueries = 8;
// Keys past this many chunks (1,024 keys of 64-token chunks) are split into partitions of this
// many chunks, each its own item, merged at the end (flash-decoding's split-K): a batch-1 decode
// over a long context otherwise has as many items as KV-head blocks (SmolLM2: 3 on 2 threads, a
// third of the time one thread idles).  The partitions start at multiples of it from key 0 and
// depend on the row alone, so a query's arithmetic is the same whatever the step around it.
constexpr int64_t kSplitChunks = 16;

// Query t of the item sees keys [0, its limit): below the row's context and at or before its
// position.  Writes every query's limit to lim (if not null); returns the largest, past which no
// query of the item reads.
JS_INLINE int64_t item_limits(const Problem& pr, const WorkItem& ip, int64_t* lim) {
  const int64_t ctx = std::clamp<int64_t>(pr.lens[ip.b], 0, pr.P * pr.ps);
  int64_t maxlim = 0;
  for (int64_t t = 0; t < ip.nt; ++t) {
    const int64_t l = std::max<int64_t>(0, std::min<int64_t>(ctx, int64_t(pr.pos[ip.n0 + t]) + 1));
    if (lim) lim[t] = l;
    maxlim = std::max(maxlim, l);
  }
  return maxlim;
}

// Query t of the item sees no key below lo[t] = positions - window + 1 (0 without a window).
// Writes them to lo (if not null); returns the smallest among queries that see a key (the
// item's keys below it are read by none of them), or 0.
JS_INLINE int64_t item_starts(const Problem& pr, const WorkItem& ip, int64_t* lo) {
  int64_t minlo = INT64_MAX;
  const int64_t ctx = std::clamp<int64_t>(pr.lens[ip.b], 0, pr.P * pr.ps);
  for (int64_t t = 0; t < ip.nt; ++t) {
    const int64_t pos = pr.pos[ip.n0 + t];
    const int64_t l = pr.window > 0 ? std::max<int64_t>(0, pos - pr.window + 1) : 0;
    if (lo) lo[t] = l;
    if (l < std::min<int64_t>(ctx, pos + 1)) minlo = std::min(minlo, l);
  }
  return minlo == INT64_MAX ? 0 : minlo;
}

// The items a long row's keys were split into: the whole item, its first partials slot, how many.
struct SplitGroup {
  WorkItem it;
  int64_t first, parts;
};

// The work items for `workers` threads (the caller and workers - 1 pool tasks); row r owns the
// tokens [starts[r], starts[r + 1]).  Sets pr's plan fields; pr.items points into `sorted`.
void plan(Problem& pr, const std::vector<int64_t>& starts, int64_t workers, int64_t kv_heads_per_item,
          std::vector<WorkItem>& sorted, std::vector<SplitGroup>& groups) {
  pr.cps = std::max<int64_t>(1, kChunkTokens / pr.ps);
  pr.cl = pr.cps * pr.ps;
  pr.clp = (pr.cl + kRound - 1) / kRound * kRound;
  auto blocks = [&](int64_t tb) {  // query blocks of at most tb queries over all rows
    int64_t n = 0;
    for (int64_t r = 0; r < pr.R; ++r) n += (starts[r + 1] - starts[r] + tb - 1) / tb;
    return n;
  };
  int64_t tb = kMaxQueries, nqb = blocks(tb);
  auto n_khb = [&](int64_t khi) { return (pr.KVH + khi - 1) / khi; };
  if (kv_heads_per_item > 0) {
    pr.khi = std::min(kv_heads_per_item, pr.KVH);
  } else {
    // Whole rows (each page read front to back) when there are enough query blocks to share
    // out; otherwise split the KV heads (no K/V read twice), then the queries of long rows (one
    // prefill chunk alone), so that every thread gets several items.
    const int64_t want = 4 * workers;
    pr.khi = pr.KVH;
    while (nqb * n_khb(pr.khi) < want && pr.khi > 1) {
      int64_t d = pr.khi - 1;
      while (d > 1 && pr.KVH % d) --d;
      pr.khi = d;
    }
    while (nqb * n_khb(pr.khi) < want && tb > kMinQueries) {
      const int64_t n = blocks(tb / 2);
      if (n == nqb) break;  // every row is already that short
      tb /= 2;
      nqb = n;
    }
  }
  pr.tb = 1;
  std::vector<WorkItem> items;
  items.reserve(size_t(nqb * n_khb(pr.khi)));
  int64_t slots = 0;  // partials slots handed out to split rows so far
  for (int64_t r = 0; r < pr.R; ++r) {
    const int64_t len = starts[r + 1] - starts[r];
    if (len == 0) continue;
    // Blocks of as equal a size as fit (40 queries: 20 + 20, not 32 + 8).
    const int64_t nb = (len + tb - 1) / tb, base = len / nb, extra = len % nb;
    for (int64_t kh0 = 0; kh0 < pr.KVH; kh0 += pr.khi)
      for (int64_t i = 0, n0 = starts[r]; i < nb; ++i) {
        const int64_t nt = base + (i < extra ? 1 : 0);
        WorkItem it{r, n0, nt, kh0};
        const int64_t nchunks = (item_limits(pr, it, nullptr) + pr.cl - 1) / pr.cl;
        // a sliding window: the partitions wholly before every query's window are left out
        const int64_t q0 = std::min(item_starts(pr, it, nullptr) / pr.cl, nchunks) / kSplitChunks;
        if (nchunks - q0 * kSplitChunks <= kSplitChunks) {
          items.push_back(it);
        } else {
          const int64_t first = slots, parts = (nchunks + kSplitChunks - 1) / kSplitChunks - q0;
          slots += parts;
          groups.push_back({it, first, parts});
          for (int64_t q = 0; q < parts; ++q) {
            WorkItem pi = it;
            pi.c0 = (q0 + q) * kSplitChunks;
            pi.c1 = pi.c0 + kSplitChunks;
            pi.part = first + q;
            items.push_back(pi);
          }
        }
        n0 += nt;
        pr.tb = std::max(pr.tb, nt);
      }
  }
  // Costliest first, so that no thread starts a long item when the others are nearly done: an
  // item reads its keys' K/V (the 16 stands for that) and does nt * G rows of arithmetic on each.
  std::vector<std::pair<int64_t, int64_t>> cost(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const WorkItem& it = items[i];
    const int64_t nkh = std::min(pr.khi, pr.KVH - it.kh0);
    const int64_t lim = item_limits(pr, it, nullptr);
    const int64_t from = std::max(it.c0 * pr.cl, item_starts(pr, it, nullptr));
    const int64_t keys = std::max<int64_t>(0, (it.part < 0 ? lim : std::min(lim, it.c1 * pr.cl)) - from);
    cost[i] = {-keys * nkh * (16 + it.nt * pr.G), int64_t(i)};
  }
  std::sort(cost.begin(), cost.end());  // ties keep the listing order (the index breaks them)
  sorted.resize(items.size());
  for (size_t i = 0; i < items.size(); ++i) sorted[i] = items[size_t(cost[i].second)];
  pr.items = sorted.data();
  pr.n_items = int64_t(sorted.size());
}

// out[dst .. dst + D) = acc * inv in q's dtype: a query's normalised result, written by an unsplit
// item and by the merge alike (so a query within one partition gets the same bits either way).
void store_row(const Problem& pr, int64_t dst, const float* acc, float inv) {
  if (pr.q_bf16) {
    uint16_t* o = static_cast<uint16_t*>(pr.out) + dst;
    for (int64_t d = 0; d < pr.D; ++d) o[d] = to_bf16(acc[d] * inv);
  } else {
    float* o = static_cast<float*>(pr.out) + dst;
    for (int64_t d = 0; d < pr.D; ++d) o[d] = acc[d] * inv;
  }
}

// A split row's result from its partitions, in partition order: with M the largest running max
// among those that saw a key, out = sum_i e^(m_i - M) acc_i / sum_i e^(m_i - M) l_i.  A query whose
// keys all fall in one partition gets exactly what the unsplit kernel writes (e^0 = 1).
void merge_partitions(const Problem& pr, const SplitGroup& g) {
  const int64_t D = pr.D, G = pr.G, nt = g.it.nt;
  const int64_t nkh = std::min(pr.khi, pr.KVH - g.it.kh0), rows = nkh * nt * G;
  std::vector<float> sum(static_cast<size_t>(D), 0.0f);
  for (int64_t row = 0; row < rows; ++row) {
    float mx = kNeg;
    for (int64_t q = 0; q < g.parts; ++q) {
      const float* p = pr.partials + pr.part_off[g.first + q] + row * (D + 2);
      if (p[1] > 0.0f) mx = std::max(mx, p[0]);
    }
    float l = 0.0f;
    std::fill(sum.begin(), sum.end(), 0.0f);
    for (int64_t q = 0; q < g.parts; ++q) {
      const float* p = pr.partials + pr.part_off[g.first + q] + row * (D + 2);
      if (!(p[1] > 0.0f)) continue;
      const float w = std::exp(p[0] - mx);
      l += w * p[1];
      for (int64_t d = 0; d < D; ++d) sum[size_t(d)] += w * p[2 + d];
    }
    const int64_t kh = row / (nt * G), t = row / G % nt, gg = row % G;
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    store_row(pr, ((g.it.n0 + t) * pr.H + (g.it.kh0 + kh) * G + gg) * D, sum.data(), inv);
  }
}

// Per-worker scratch, 64-byte aligned: scaled queries and accumulators [khi][tb*G][D], running
// max / sum [khi][tb*G], scores / probabilities [tb*G][clp], one chunk of K and of V widened to
// float32 [clp][D] (bfloat16 pages), per-query key limits and window starts [2][tb], the element offsets of the
// tokens of this chunk and the next [2][clp].
//
// The bfloat16 dot-product variant (run_item's DP) adds: the scaled queries in bfloat16 [khi][tb*G][D],
// the probabilities in bfloat16 [tb*G][clp], the chunk's K transposed to k pairs
// [D/2][clp rounded up to 64] (32-bit words) and its V as key pairs [clp/2][D] (words).
struct Scratch {
  float* base = nullptr;
  float *q, *acc, *m, *l, *s, *p, *kf, *vf;
  int64_t *lim, *lo, *off;
  uint16_t *qb, *pb;
  uint32_t *kp, *vp;
  int64_t kw;  // kp's row stride in words: clp rounded up to 64
  explicit Scratch(const Problem& pr) {
    auto up = [](int64_t n) { return (n + kRound - 1) / kRound * kRound; };
    const int64_t rows = pr.khi * pr.tb * pr.G;
    const int64_t nq = up(rows * pr.D), nm = up(rows), ns = up(pr.tb * pr.G * pr.clp);
    const int64_t nk = up(pr.clp * pr.D), nl = up(pr.tb * 4), no = up(pr.clp * 4);
    kw = (pr.clp + 63) / 64 * 64;
    // in floats (4 bytes): qb and pb are halves, kp [D/2][kw] and vp [clp/2][D] words
    const int64_t nqb = up((rows * pr.D + 1) / 2), npb = up((pr.tb * pr.G * pr.clp + 1) / 2);
    const int64_t nkp = up((pr.D + 1) / 2 * kw), nvp = up((pr.clp + 1) / 2 * pr.D);
    const size_t bytes =
        size_t(2 * nq + 2 * nm + 2 * ns + 2 * nk + nl + no + nqb + npb + nkp + nvp) * sizeof(float);
    base = static_cast<float*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64));
    if (!base) return;
    std::memset(base, 0, bytes);
    q = base;
    acc = q + nq;
    m = acc + nq;
    l = m + nm;
    s = l + nm;
    p = s + ns;
    kf = p + ns;
    vf = kf + nk;
    lim = reinterpret_cast<int64_t*>(vf + nk);
    lo = lim + pr.tb;
    off = reinterpret_cast<int64_t*>(vf + nk + nl);
    float* tail = vf + nk + nl + no;
    qb = reinterpret_cast<uint16_t*>(tail);
    pb = reinterpret_cast<uint16_t*>(tail + nqb);
    kp = reinterpret_cast<uint32_t*>(tail + nqb + npb);
    vp = reinterpret_cast<uint32_t*>(tail + nqb + npb + nkp);
  }
  ~Scratch() { std::free(base); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

// Prefetch one token's K or V vector (d elements) into L2 (prefetcht1), not L1: with the pages
// scattered, two cores doing plain reads of 8 KiB pages in random order get 14-15 GB/s this way
// against 11-12.5 with prefetcht0 (an L1 prefetch holds a fill buffer until its line arrives);
// in this kernel, where the arithmetic hides part of the latency, the gain is 2-4%.
template <class KT>
JS_INLINE void prefetch_row(const KT* p, int64_t d) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < d * int64_t(sizeof(KT)); off += 64) __builtin_prefetch(c + off, 0, 2);
}

// Elements [from, from + n) of each of the chunk's token rows (element offsets off[j]) into L2.
// An item over several KV heads (every item from 8 query rows on, with 2 threads) reads a
// chunk's rows once per head, one head's slice of each row at a time; fetching the rest of its
// rows during the first head's pass keeps more lines in flight: 1.1-1.2x at 8 and 32 rows x 512
// keys, pages in order or scattered, every page dtype and instruction set (AMD EPYC
// Zen 4, 2 cores: docs/benchmarks.md); the whole decode step did not move beyond the noise.
template <class KT>
JS_INLINE void prefetch_rest(const KT* pool, const int64_t* off, int64_t nvalid, int64_t from, int64_t n) {
  for (int64_t j = 0; j < nvalid; ++j) prefetch_row(pool + off[j] + from, n);
}

// The chunk's rows of one KV head (element offsets off[j] + hoff) widened to float32 in dst
// [nvalid][D]: bfloat16 by a shift, int8 times its token-head's scale (a bfloat16, widened by
// the same shift; scale index = element offset / D, as the scales are the pages without their
// last axis).  Prefetches the same head's rows of the next chunk.
template <class KT, int N, int HD>
JS_INLINE void widen_rows(const KT* pool, const KT* pool_end, const uint16_t* scales, const int64_t* off,
                          const int64_t* off_next, int64_t nvalid, int64_t n_next, int64_t hoff, int64_t D,
                          float* dst) {
  constexpr bool kQ8 = std::is_same_v<KT, int8_t>;
  constexpr int DV = HD / N;
  for (int64_t j = 0; j < nvalid; ++j) {
    if (j < n_next) prefetch_row(pool + off_next[j] + hoff, D);
    const KT* src = pool + off[j] + hoff;
    float* row = dst + j * D;
    float s = 1.0f;
    if constexpr (kQ8) s = widen(scales[(off[j] + hoff) / (HD > 0 ? int64_t(HD) : D)]);  // HD: a constant divisor
    if constexpr (DV > 0) {
      for (int c = 0; c < DV; ++c) {
        if constexpr (kQ8) {
          vstore<N>(row + c * N, vload_i8<N>(src + c * N, pool_end) * s);
        } else {
          vstore<N>(row + c * N, vload<N>(src + c * N));
        }
      }
    } else {
      for (int64_t d = 0; d < D; ++d) row[d] = kQ8 ? widen(src[d]) * s : widen(src[d]);
    }
  }
}

// f(rows, r) for query rows r .. r + rows - 1 (rows a std::integral_constant): pairs while
// Pairs, then single rows.
template <bool Pairs, class Fn>
JS_INLINE void by_row_pairs(int64_t R, Fn&& f) {
  int64_t r = 0;
  if constexpr (Pairs)
    for (; r + 2 <= R; r += 2) f(std::integral_constant<int, 2>{}, r);
  for (; r < R; ++r) f(std::integral_constant<int, 1>{}, r);
}

#if JS_X86 && JAXSERVE_CAN_AMX
// ---- bfloat16 dot products (AVX512-BF16's VDPBF16PS) for a bfloat16 pool ----------------------
//
// With the pool in bfloat16, the scores and P.V are dot products of bfloat16 pairs: lane c of
// VDPBF16PS(acc, a, b) gains a[2c] b[2c] + a[2c+1] b[2c+1], products exact and sums in float32.
// Scores: K of a chunk is transposed to k pairs, kp[dd][j] = (k_j[2dd], k_j[2dd+1]) as one
// 32-bit word, so one vector holds 16 keys' pair dd and a query's pair, broadcast, scores 16 keys
// at once with no horizontal sum: the matmul's micro-kernel (matmul.cc dp_block) with the keys as
// columns, up to 6 query rows sharing each K vector.  P.V: V is interleaved by key pairs, vp[jj][d]
// = (v_{2jj}[d], v_{2jj+1}[d]), and a row's probability pair, broadcast, weighs 16 dims at once.
// The queries (scaled) and the probabilities are rounded to bfloat16 (round to nearest even),
// as FlashAttention does on GPUs; softmax stays float32.  Every row's sums run in the same order
// whatever the other rows of the item: a query alone equals the query in a chunk, bit for bit.
#define JS_DP_TARGET "avx512f,avx512vl,avx512bw,avx512dq,avx512bf16,avx2,fma"
// The entry points are real calls (each does a chunk's worth of work): run_item, compiled without
// this target, may call but not inline them.
#define JS_DP __attribute__((noinline, target(JS_DP_TARGET)))
#define JS_DP_INLINE __attribute__((always_inline, target(JS_DP_TARGET))) inline

// 16 x 16 32-bit words, rows r[0..15] -> columns (in place).
JS_DP_INLINE void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4q + m] now holds, in 128-bit lane L, column 4L + m of rows 4q .. 4q + 3; two rounds of
  // 128-bit lane shuffles gather column c = 4L + m from lane L of r[m], r[4 + m], r[8 + m], r[12 + m].
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// kp[dd * kw + j] = word dd of key j's row (D bfloat16 = D/2 words) for j < nvalid, zero for
// j in [nvalid, kw).  Prefetches the next chunk's rows.
template <int HD>
JS_DP void pack_k_pairs(const uint16_t* pool, const int64_t* off, const int64_t* off_next, int64_t nvalid,
                        int64_t n_next, int64_t hoff, uint32_t* kp, int64_t kw) {
  constexpr int W = HD / 2;  // words per key
  for (int64_t j0 = 0; j0 < kw; j0 += 16) {
    for (int wb = 0; wb < W; wb += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t j = j0 + i;
        if (wb == 0 && j < n_next) prefetch_row(pool + off_next[j] + hoff, HD);
        r[i] = j < nvalid ? _mm512_loadu_si512(pool + off[j] + hoff + 2 * wb) : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(kp + (wb + i) * kw + j0, r[i]);
    }
  }
}

// vp[jj * HD + d] = (v_{2jj}[d], v_{2jj+1}[d]) for the pairs covering nvalid keys (a missing odd
// key is zero; HD a multiple of 32).  Prefetches the next chunk's rows.
template <int HD>
JS_DP void pack_v_pairs(const uint16_t* pool, const int64_t* off, const int64_t* off_next, int64_t nvalid,
                        int64_t n_next, int64_t hoff, uint32_t* vp) {
  alignas(64) static constexpr uint16_t kLo[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                   8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                   24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(kLo), hi = _mm512_load_si512(kHi);
  for (int64_t j = 0; j < nvalid; j += 2) {
    if (j < n_next) prefetch_row(pool + off_next[j] + hoff, HD);
    if (j + 1 < n_next) prefetch_row(pool + off_next[j + 1] + hoff, HD);
    const uint16_t* v0 = pool + off[j] + hoff;
    const uint16_t* v1 = j + 1 < nvalid ? pool + off[j + 1] + hoff : nullptr;
    uint32_t* dst = vp + (j / 2) * HD;
    for (int c = 0; c < HD; c += 32) {
      const __m512i x0 = _mm512_loadu_si512(v0 + c);
      const __m512i x1 = v1 ? _mm512_loadu_si512(v1 + c) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + c, _mm512_permutex2var_epi16(x0, lo, x1));
      _mm512_storeu_si512(dst + c + 16, _mm512_permutex2var_epi16(x0, hi, x1));
    }
  }
}

// Scores of RB query rows (bfloat16 qb rows, D apart) against the chunk's keys in kp: s rows
// (stride clp) get the first clp keys.
template <int HD, int RB>
JS_DP void dp_scores(const uint16_t* qb, const uint32_t* kp, int64_t kw, int64_t nkeys, int64_t clp, float* s) {
  for (int64_t k0 = 0; k0 < nkeys; k0 += 64) {
    __m512 acc[RB][4];
    for (int i = 0; i < RB; ++i)
      for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int dd = 0; dd < HD / 2; ++dd) {
      __m512bh b[4];
      for (int v = 0; v < 4; ++v) b[v] = (__m512bh)_mm512_loadu_si512(kp + dd * kw + k0 + 16 * v);
      for (int i = 0; i < RB; ++i) {
        int32_t pair;
        std::memcpy(&pair, qb + i * HD + 2 * dd, 4);
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], a, b[v]);
      }
    }
    for (int v = 0; v < 4 && k0 + 16 * v < clp; ++v)
      for (int i = 0; i < RB; ++i) _mm512_storeu_ps(s + i * clp + k0 + 16 * v, acc[i][v]);
  }
}

// acc rows (float32, D apart) += P (bfloat16 pb rows, stride clp) . V for `npairs` key pairs.
template <int HD, int RB>
JS_DP void dp_weigh(const uint16_t* pb, int64_t clp, const uint32_t* vp, int64_t npairs, float* acc) {
  constexpr int DV = HD / 16;
  __m512 a[RB][DV];
  for (int i = 0; i < RB; ++i)
    for (int c = 0; c < DV; ++c) a[i][c] = _mm512_loadu_ps(acc + i * HD + 16 * c);
#pragma GCC unroll 2
  for (int64_t jj = 0; jj < npairs; ++jj) {
    __m512bh b[DV];
    for (int c = 0; c < DV; ++c) b[c] = (__m512bh)_mm512_loadu_si512(vp + jj * HD + 16 * c);
    for (int i = 0; i < RB; ++i) {
      int32_t pair;
      std::memcpy(&pair, pb + i * clp + 2 * jj, 4);
      const __m512bh p = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < DV; ++c) a[i][c] = _mm512_dpbf16_ps(a[i][c], p, b[c]);
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int c = 0; c < DV; ++c) _mm512_storeu_ps(acc + i * HD + 16 * c, a[i][c]);
}

// A row of probabilities (n floats, n a multiple of 16) to bfloat16.
JS_DP void probs_to_bf16(const float* p, int64_t n, uint16_t* dst) {
  for (int64_t j = 0; j < n; j += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + j)));
}

// Calls F<HD, rb>(args...) for R rows in blocks of MAXRB (r0: the block's first row), then the tail.
#define JS_ROW_BLOCKS(MAXRB, R, CALL)                        \
  do {                                                       \
    int64_t r0 = 0;                                          \
    for (; r0 + (MAXRB) <= (R); r0 += (MAXRB)) CALL(MAXRB);   \
    switch ((R) - r0) {                                      \
      case 1: if constexpr ((MAXRB) > 1) CALL(1); break;      \
      case 2: if constexpr ((MAXRB) > 2) CALL(2); break;      \
      case 3: if constexpr ((MAXRB) > 3) CALL(3); break;      \
      case 4: if constexpr ((MAXRB) > 4) CALL(4); break;      \
      case 5: if constexpr ((MAXRB) > 5) CALL(5); break;      \
      default: break;                                        \
    }                                                        \
  } while (0)
#endif

// The lambdas of run_item hold its vector arithmetic: they must be inlined into the wrapper that
// compiles run_item for an instruction set (GCC does not give a lambda its enclosing function's
// target), or a copy compiled for the baseline could round differently (no fused multiply-add)
// from an inlined one, and a query alone would no longer equal the query in a chunk.
#define JS_LAMBDA __attribute__((always_inline))

// How many of a head's dv vectors P.V takes at a time (run_item): all of them with two sets of
// accumulators, else the largest divisor of dv whose accumulators fit in `fit` registers.
constexpr int weigh_cols(int dv, bool two_sets, int fit) {
  if (dv <= 0) return 1;
  if (two_sets) return dv;
  int cb = dv < fit ? dv : fit;
  while (dv % cb) --cb;
  return cb;
}

// How a work item blocks its query rows for an instruction set of N lanes and head dim HD (0: the
// scalar path).  Query rows go in pairs (scores and P.V) while a pair's queries and accumulators
// fit in the registers (up to 4 vectors per head: head dim 64 on AVX-512, 32 on AVX2); one at a
// time past that.  Either way each row's arithmetic is the same, in the same order.  P.V
// accumulators: two sets (even and odd keys) where both fit in the registers beside the loaded V
// vectors (AVX-512's 32: 24 of them; 16 elsewhere: 12); otherwise one set, over kWeighCols of the
// head's vectors at a time, so that nothing spills (AVX2 at head dim 64 kept 16 accumulators in
// 16 registers and spilled each key).  The choice depends on the head dim and the vector width
// alone, so a query's sums run in one order whether its row is paired or not.
template <int N, int HD>
struct RowBlocking {
  static_assert(HD % N == 0, "head dim must be a multiple of the vector width");
  static constexpr int DV = HD / N;  // vectors per head
  static constexpr bool kPairs = DV <= 4;
  static constexpr int kAccRegs = N >= 16 ? 24 : 12, kRowsMax = kPairs ? 2 : 1;
  static constexpr bool kTwoSets = DV > 0 && 2 * kRowsMax * DV <= kAccRegs;
  static constexpr int kWeighCols = weigh_cols(DV, kTwoSets, kAccRegs / kRowsMax);
};

// Step 1 of a work item: its queries, scaled, in sc.q as rows [KV head][query][G] (DP: also in
// bfloat16, sc.qb); accumulators zeroed, running max at kNeg, sum at 0.
template <bool DP>
JS_INLINE void load_queries(const Problem& pr, const WorkItem& ip, int64_t nkh, int64_t D, Scratch& sc) {
  const int64_t H = pr.H, G = pr.G, R = ip.nt * G;
  for (int64_t kh = 0; kh < nkh; ++kh)
    for (int64_t t = 0; t < ip.nt; ++t)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t row = kh * R + t * G + g;
        const int64_t src = ((ip.n0 + t) * H + (ip.kh0 + kh) * G + g) * D;
        float* dst = sc.q + row * D;
        if (pr.q_bf16) {
          const uint16_t* qs = static_cast<const uint16_t*>(pr.q) + src;
          for (int64_t d = 0; d < D; ++d) dst[d] = widen(qs[d]) * pr.scale;
        } else {
          const float* qs = static_cast<const float*>(pr.q) + src;
          for (int64_t d = 0; d < D; ++d) dst[d] = qs[d] * pr.scale;
        }
        if constexpr (DP)
          for (int64_t d = 0; d < D; ++d) sc.qb[row * D + d] = to_bf16(dst[d]);
        std::memset(sc.acc + row * D, 0, sizeof(float) * D);
        sc.m[row] = kNeg;
        sc.l[row] = 0.0f;
      }
}

// Element offsets (KV head 0) of the tokens of chunk c of a row (block table `row_bt`, keys
// below `lim`) into dst; returns how many there are.
JS_INLINE int64_t chunk_offsets(const Problem& pr, int64_t D, const int32_t* row_bt, int64_t lim, int64_t c,
                                int64_t* dst) {
  const int64_t ps = pr.ps, cl = pr.cl;
  const int64_t tstride = pr.KVH * D;  // elements between consecutive tokens of a page
  const int64_t pstride = ps * tstride;
  const int64_t n = std::min(cl, lim - c * cl);
  for (int64_t pg = 0; pg * ps < n; ++pg) {
    const int64_t base = std::clamp<int64_t>(row_bt[c * pr.cps + pg], 0, pr.num_pages - 1) * pstride;
    const int64_t m = std::min(ps, n - pg * ps);
    for (int64_t i = 0; i < m; ++i) dst[pg * ps + i] = base + i * tstride;
  }
  return n;
}

// After an item's last chunk: the offsets of the first chunk of the item this thread takes next
// (-1: none), if it reads the same KV heads (kh0, nkh); else none.
JS_INLINE int64_t next_item_offsets(const Problem& pr, int64_t D, int64_t next_item, int64_t kh0, int64_t nkh,
                                    int64_t* dst) {
  if (next_item < 0) return 0;
  const WorkItem& np = pr.items[next_item];
  if (np.kh0 != kh0 || std::min(pr.khi, pr.KVH - np.kh0) != nkh) return 0;
  const int64_t c0 = std::max(np.c0, item_starts(pr, np, nullptr) / pr.cl);
  return std::max<int64_t>(0, chunk_offsets(pr, D, pr.bt + np.b * pr.P, item_limits(pr, np, nullptr), c0, dst));
}

// One KV head's K (or V) rows of a chunk as float32: read in place from a float32 pool, else the
// rows widened into `widened` [nvalid][D].  off / off_next: the element offsets of this chunk's
// tokens and of the next chunk's (n_next of them), whose rows are prefetched while these are read.
template <class KT>
struct ChunkRows {
  const KT* pool;
  const int64_t* off;
  const int64_t* off_next;
  int64_t nvalid, n_next, hoff, D;
  const float* widened;

  JS_INLINE const float* row(int64_t j) const {
    if constexpr (std::is_same_v<KT, float>) return pool + off[j] + hoff;
    else return widened + j * D;
  }
  // Token j's row of the next chunk into L2 (float32 pools: the others prefetch while widening).
  JS_INLINE void prefetch_next(int64_t j) const {
    if (j < n_next) prefetch_row(pool + off_next[j] + hoff, D);
  }
};

// Step 2, per chunk and KV head: scores S[r][j] = q_r . k_j (sc.s, stride clp) for the R query
// rows from qk (DP: qbk, bfloat16) and the chunk's live tokens, N tokens at a time, query rows in
// pairs (kPairs: the G query heads of a KV head, or consecutive queries), so that each K row
// loaded serves both rows of a pair.  Tokens jj and jj + N/2 meet at the reduction tree's first
// level (reduce_pair), so only N/2 partial vectors per row stay live.
template <class KT, int N, int HD, bool DP>
JS_INLINE void chunk_scores(const ChunkRows<KT>& k, const float* qk, const uint16_t* qbk, int64_t R, int64_t clp,
                            Scratch& sc) {
  using V = Vf<N>;
  using B = RowBlocking<N, HD>;
  constexpr int DV = B::DV;
  constexpr bool kF32 = std::is_same_v<KT, float>;
  const int64_t D = k.D, nvalid = k.nvalid;
  if constexpr (DP) {
#if JS_X86 && JAXSERVE_CAN_AMX
#define JS_SCORES(RB) dp_scores<HD, RB>(qbk + r0 * D, sc.kp, sc.kw, nvalid, clp, sc.s + r0 * clp)
    JS_ROW_BLOCKS(6, R, JS_SCORES);
#undef JS_SCORES
#endif
  } else if constexpr (DV > 0) {
    auto scores = [&](auto rows, int64_t r0) JS_LAMBDA {
      constexpr int RB = decltype(rows)::value;
      const bool pf = kF32 && r0 == 0;
      V qv[RB][DV];
      for (int i = 0; i < RB; ++i)
        for (int c = 0; c < DV; ++c) qv[i][c] = vload<N>(qk + (r0 + i) * D + c * N);
      auto dot = [&](int64_t j, V (&a)[RB]) JS_LAMBDA {
        if (j >= nvalid) {
          for (int i = 0; i < RB; ++i) a[i] = splat<N>(0.0f);
          return;
        }
        if (pf) k.prefetch_next(j);
        const float* kr = k.row(j);
        V kv[DV];
        for (int c = 0; c < DV; ++c) kv[c] = vload<N>(kr + c * N);
        for (int i = 0; i < RB; ++i) {
          V s = qv[i][0] * kv[0];
          for (int c = 1; c < DV; ++c) s += qv[i][c] * kv[c];
          a[i] = s;
        }
      };
      for (int64_t j0 = 0; j0 < nvalid; j0 += N) {
        V half[RB][N / 2];
#pragma GCC unroll 16
        for (int jj = 0; jj < N / 2; ++jj) {
          V lo[RB], hi[RB];
          dot(j0 + jj, lo);
          dot(j0 + jj + N / 2, hi);
          for (int i = 0; i < RB; ++i)
            half[i][bitrev<N / 2>(jj)] = reduce_pair<N, N / 2>(lo[i], hi[i], std::make_integer_sequence<int, N>{});
        }
        for (int i = 0; i < RB; ++i) {
          if constexpr (N / 4 >= 1) reduce_levels<N, N / 4>(half[i]);
          vstore<N>(sc.s + (r0 + i) * clp + j0, half[i][0]);
        }
      }
    };
    by_row_pairs<B::kPairs>(R, scores);
  } else {
    for (int64_t r = 0; r < R; ++r) {
      const float* qr = qk + r * D;
      float* srow = sc.s + r * clp;
      const bool pf = kF32 && r == 0;
      for (int64_t j = 0; j < nvalid; ++j) {
        if (pf) k.prefetch_next(j);
        const float* kr = k.row(j);
        float a = 0.0f;
        for (int64_t d = 0; d < D; ++d) a += qr[d] * kr[d];
        srow[j] = a;
      }
    }
  }
}

// Step 3, per chunk and KV head: the online softmax of each query row over this chunk (keys
// [start, start + nvalid)): probabilities in sc.p, the running max mk and sum lk updated, the
// accumulators ak rescaled.  Query t sees keys in [sc.lo[t], sc.lim[t]).
template <int N, int HD>
JS_INLINE void chunk_softmax(const Problem& pr, const WorkItem& ip, int64_t start, int64_t nvalid, int64_t D,
                             float* mk, float* lk, float* ak, Scratch& sc) {
  using V = Vf<N>;
  constexpr int DV = RowBlocking<N, HD>::DV;
  const int64_t G = pr.G, clp = pr.clp;
  for (int64_t t = 0; t < ip.nt; ++t) {
    const int64_t nq = std::clamp<int64_t>(sc.lim[t] - start, 0, nvalid);
    const int64_t nlo = std::clamp<int64_t>(sc.lo[t] - start, 0, nvalid);  // before its window
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = t * G + g;
      float* srow = sc.s + r * clp;
      float* prow = sc.p + r * clp;
      if (nq <= nlo) {  // this query sees none of the chunk
        for (int64_t c0 = 0; c0 < nvalid; c0 += N) vstore<N>(prow + c0, splat<N>(0.0f));
        continue;
      }
      // Keys this query does not see (and the padding up to whole vectors) score kNeg,
      // whose exp below is exactly 0.
      for (int64_t j = nq; j < clp; ++j) srow[j] = kNeg;
      for (int64_t j = 0; j < nlo; ++j) srow[j] = kNeg;
      V mv = splat<N>(kNeg);
      for (int64_t c0 = 0; c0 < nq; c0 += N) mv = vmax<N>(mv, vload<N>(srow + c0));
      const float m_old = mk[r];
      const float m_new = std::max(m_old, hmax<N>(mv));
      V sv = splat<N>(0.0f);
      for (int64_t c0 = 0; c0 < nvalid; c0 += N) {
        V e = vexp<N>(vload<N>(srow + c0) - m_new);
        vstore<N>(prow + c0, e);
        sv += e;
      }
      const float corr = vexp<N>(splat<N>(m_old - m_new))[0];
      lk[r] = lk[r] * corr + hsum<N>(sv);
      mk[r] = m_new;
      float* ar = ak + r * D;
      if constexpr (DV > 0) {
        for (int c = 0; c < DV; ++c) vstore<N>(ar + c * N, vload<N>(ar + c * N) * corr);
      } else {
        for (int64_t d = 0; d < D; ++d) ar[d] *= corr;
      }
    }
  }
}

// Step 4, per chunk and KV head: acc[r] += sum_j P[r][j] v_j, the accumulators in registers (two
// sets: even and odd j), query rows in pairs as for the scores: each V row loaded serves both.
template <class KT, int N, int HD, bool DP>
JS_INLINE void chunk_weigh(const ChunkRows<KT>& v, int64_t R, int64_t clp, float* ak, Scratch& sc) {
  using V = Vf<N>;
  using B = RowBlocking<N, HD>;
  // static: the lambda below uses them as array bounds without capturing them (as run_item's did)
  static constexpr int DV = B::DV, kWeighCols = B::kWeighCols;
  static constexpr bool kF32 = std::is_same_v<KT, float>, kTwoSets = B::kTwoSets;
  const int64_t D = v.D, nvalid = v.nvalid;
  if constexpr (DP) {
#if JS_X86 && JAXSERVE_CAN_AMX
    constexpr int kRows = HD <= 64 ? 6 : HD == 128 ? 3 : 1;  // kRows x HD / 16 accumulators <= 24
    const int64_t npairs = (nvalid + 1) / 2;
#define JS_WEIGH(RB) dp_weigh<HD, RB>(sc.pb + r0 * clp, clp, sc.vp, npairs, ak + r0 * D)
    JS_ROW_BLOCKS(kRows, R, JS_WEIGH);
#undef JS_WEIGH
#endif
  } else if constexpr (DV > 0) {
    auto weigh = [&](auto rows, int64_t r0) JS_LAMBDA {
      constexpr int RB = decltype(rows)::value;
      const float* pr0 = sc.p + r0 * clp;
      for (int c0 = 0; c0 < DV; c0 += kWeighCols) {  // kWeighCols of the head's vectors at a time
        const bool pf = kF32 && r0 == 0 && c0 == 0;
        V a0[RB][kWeighCols], a1[RB][kTwoSets ? kWeighCols : 1];
        for (int i = 0; i < RB; ++i)
          for (int c = 0; c < kWeighCols; ++c) {
            a0[i][c] = vload<N>(ak + (r0 + i) * D + (c0 + c) * N);
            if constexpr (kTwoSets) a1[i][c] = splat<N>(0.0f);
          }
        int64_t j = 0;
        if constexpr (kTwoSets) {
          for (; j + 1 < nvalid; j += 2) {
            if (pf) v.prefetch_next(j);
            if (pf) v.prefetch_next(j + 1);
            const float* v0 = v.row(j) + c0 * N;
            const float* v1 = v.row(j + 1) + c0 * N;
            for (int c = 0; c < kWeighCols; ++c) {
              const V x0 = vload<N>(v0 + c * N), x1 = vload<N>(v1 + c * N);
              for (int i = 0; i < RB; ++i) {
                a0[i][c] += pr0[i * clp + j] * x0;
                a1[i][c] += pr0[i * clp + j + 1] * x1;
              }
            }
          }
        }
        for (; j < nvalid; ++j) {
          if (pf) v.prefetch_next(j);
          const float* v0 = v.row(j) + c0 * N;
          for (int c = 0; c < kWeighCols; ++c) {
            const V x0 = vload<N>(v0 + c * N);
            for (int i = 0; i < RB; ++i) a0[i][c] += pr0[i * clp + j] * x0;
          }
        }
        for (int i = 0; i < RB; ++i)
          for (int c = 0; c < kWeighCols; ++c) {
            V a = a0[i][c];
            if constexpr (kTwoSets) a += a1[i][c];
            vstore<N>(ak + (r0 + i) * D + (c0 + c) * N, a);
          }
      }
    };
    by_row_pairs<B::kPairs>(R, weigh);
  } else {
    for (int64_t r = 0; r < R; ++r) {
      const float* prow = sc.p + r * clp;
      float* ar = ak + r * D;
      const bool pf = kF32 && r == 0;
      for (int64_t j = 0; j < nvalid; ++j) {
        if (pf) v.prefetch_next(j);
        const float pj = prow[j];
        const float* vr = v.row(j);
        for (int64_t d = 0; d < D; ++d) ar[d] += pj * vr[d];
      }
    }
  }
}

// One chunk of keys (tokens at offsets off, nvalid of them, from key `start`) for KV head kh of
// the item: steps 2 to 4, with K and V widened (or, DP, packed into pairs) first.  The next
// chunk's rows (off_next, n_next) are prefetched meanwhile.
template <class KT, int N, int HD, bool DP>
JS_INLINE void chunk_head(const Problem& pr, const WorkItem& ip, int64_t kh, int64_t nkh, int64_t D, int64_t start,
                          const int64_t* off, const int64_t* off_next, int64_t nvalid, int64_t n_next, Scratch& sc) {
  constexpr bool kF32 = std::is_same_v<KT, float>;
  const KT* kpool = static_cast<const KT*>(pr.k);
  const KT* vpool = static_cast<const KT*>(pr.v);
  const KT* kend = kpool + pr.num_pages * pr.ps * pr.KVH * D;
  const KT* vend = vpool + pr.num_pages * pr.ps * pr.KVH * D;
  const int64_t R = ip.nt * pr.G, clp = pr.clp;
  const int64_t hoff = (ip.kh0 + kh) * D;
  // An item over several KV heads reads each token's row one head at a time; on the first
  // head's pass, the rest of the item's row goes to L2 (prefetch_rest).
  const bool rest = kh == 0 && nkh > 1;
  if (rest) prefetch_rest(kpool, off, nvalid, hoff + D, (nkh - 1) * D);
  float* ak = sc.acc + kh * R * D;

  // bfloat16: widen the chunk's K rows to float32 once (float32 rows are read in place), or
  // (DP) transpose them into k pairs.
#if JS_X86 && JAXSERVE_CAN_AMX
  if constexpr (DP) pack_k_pairs<HD>(kpool, off, off_next, nvalid, n_next, hoff, sc.kp, sc.kw);
#endif
  if constexpr (!kF32 && !DP) widen_rows<KT, N, HD>(kpool, kend, pr.ks, off, off_next, nvalid, n_next, hoff, D, sc.kf);
  const ChunkRows<KT> krows{kpool, off, off_next, nvalid, n_next, hoff, D, sc.kf};
  const uint16_t* qbk = nullptr;
  if constexpr (DP) qbk = sc.qb + kh * R * D;
  chunk_scores<KT, N, HD, DP>(krows, sc.q + kh * R * D, qbk, R, clp, sc);
  chunk_softmax<N, HD>(pr, ip, start, nvalid, D, sc.m + kh * R, sc.l + kh * R, ak, sc);

  if (rest) prefetch_rest(vpool, off, nvalid, hoff + D, (nkh - 1) * D);
  // V rows as float32, as for K (DP: key pairs, and the probabilities in bfloat16).
#if JS_X86 && JAXSERVE_CAN_AMX
  if constexpr (DP) {
    pack_v_pairs<HD>(vpool, off, off_next, nvalid, n_next, hoff, sc.vp);
    const int64_t np16 = (nvalid + 15) / 16 * 16;
    for (int64_t r = 0; r < R; ++r) probs_to_bf16(sc.p + r * clp, np16, sc.pb + r * clp);
  }
#endif
  if constexpr (!kF32 && !DP) widen_rows<KT, N, HD>(vpool, vend, pr.vs, off, off_next, nvalid, n_next, hoff, D, sc.vf);
  chunk_weigh<KT, N, HD, DP>(ChunkRows<KT>{vpool, off, off_next, nvalid, n_next, hoff, D, sc.vf}, R, clp, ak, sc);
}

// Step 5: a partition's rows (running max, sum and unnormalised sums) into its partials slot, or
// the normalised result in q's dtype (a query that saw nothing gets zeros).
JS_INLINE void finish_item(const Problem& pr, const WorkItem& ip, int64_t nkh, int64_t D, const Scratch& sc) {
  const int64_t H = pr.H, G = pr.G, R = ip.nt * G;
  if (ip.part >= 0) {
    float* dst = pr.partials + pr.part_off[ip.part];
    for (int64_t row = 0; row < nkh * R; ++row, dst += D + 2) {
      dst[0] = sc.m[row];
      dst[1] = sc.l[row];
      std::memcpy(dst + 2, sc.acc + row * D, sizeof(float) * D);
    }
    return;
  }
  for (int64_t kh = 0; kh < nkh; ++kh)
    for (int64_t t = 0; t < ip.nt; ++t)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t row = kh * R + t * G + g;
        const float inv = sc.l[row] > 0.0f ? 1.0f / sc.l[row] : 0.0f;
        store_row(pr, ((ip.n0 + t) * H + (ip.kh0 + kh) * G + g) * D, sc.acc + row * D, inv);
      }
}

// One work item.  KT: page element type (float, uint16_t holding bfloat16, or int8_t with a
// bfloat16 scale per token per KV head, multiplied in while a chunk is widened).  N: vector lanes.
// HD: the head dim (a multiple of N), or 0 for the scalar path (any head dim).
// `next_item`: the item this thread takes after this one (-1: none); while it reads its last
// chunk it prefetches that item's first, when both read the same KV heads.
// DP: the bfloat16 dot-product variant (bfloat16 pages, HD a multiple of 32, compiled for
// AVX512-BF16; see dp_scores): K and V are packed into pairs instead of widened to float32.
// The steps are always_inline, so the wrapper's target compiles them all (see JS_LAMBDA).
template <class KT, int N, int HD, bool DP = false>
JS_INLINE void run_item(const Problem& pr, int64_t item, int64_t next_item, Scratch& sc) {
  static_assert(!DP || (std::is_same_v<KT, uint16_t> && N == 16 && HD % 32 == 0 && HD > 0));
  static_assert(HD % N == 0, "head dim must be a multiple of the vector width");
  const WorkItem& ip = pr.items[item];
  const int64_t D = HD > 0 ? HD : pr.D, cl = pr.cl;
  const int64_t nkh = std::min(pr.khi, pr.KVH - ip.kh0);
  const int64_t maxlim = item_limits(pr, ip, sc.lim);
  const int64_t minlo = item_starts(pr, ip, sc.lo);
  load_queries<DP>(pr, ip, nkh, D, sc);

  const int32_t* bt = pr.bt + ip.b * pr.P;
  // This item's chunks: all of the keys it sees, or its partition's share of them.
  const int64_t nchunks = std::min(ip.c1, (maxlim + cl - 1) / cl);
  // From the first chunk any query sees: a chunk wholly before a query's window leaves its state
  // untouched, so skipping it changes no bits.
  const int64_t cfirst = std::min(std::max(ip.c0, minlo / cl), nchunks);
  int64_t* off = sc.off;
  int64_t* off_next = sc.off + pr.clp;
  int64_t nvalid = cfirst < nchunks ? chunk_offsets(pr, D, bt, maxlim, cfirst, off) : 0;
  for (int64_t ci = cfirst; ci < nchunks; ++ci) {
    // While reading token j of this chunk, prefetch token j of the next one.
    const int64_t n_next = ci + 1 < nchunks ? chunk_offsets(pr, D, bt, maxlim, ci + 1, off_next)
                                            : next_item_offsets(pr, D, next_item, ip.kh0, nkh, off_next);
    for (int64_t kh = 0; kh < nkh; ++kh)
      chunk_head<KT, N, HD, DP>(pr, ip, kh, nkh, D, ci * cl, off, off_next, nvalid, n_next, sc);
    std::swap(off, off_next);
    nvalid = n_next;
  }
  finish_item(pr, ip, nkh, D, sc);
}

using ItemFn = void (*)(const Problem&, int64_t, int64_t, Scratch&);

// The kernel compiled for three instruction sets, each with its own vector width; run_item is
// always_inline, so each wrapper's copy is compiled for the wrapper's target.
template <class KT, int HD>
void item_generic(const Problem& pr, int64_t i, int64_t next, Scratch& sc) {
  run_item<KT, 4, HD>(pr, i, next, sc);
}
#if JS_X86
template <class KT, int HD>
__attribute__((target("avx2,fma"))) void item_avx2(const Problem& pr, int64_t i, int64_t next, Scratch& sc) {
  run_item<KT, 8, HD>(pr, i, next, sc);
}
template <class KT, int HD>
__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma"))) void item_avx512(
    const Problem& pr, int64_t i, int64_t next, Scratch& sc) {
  run_item<KT, 16, HD>(pr, i, next, sc);
}
#if JAXSERVE_CAN_AMX
// AVX512-BF16: bfloat16 pages with a head dim the dot-product variant takes run it; the rest
// their AVX-512 code.
template <class KT, int HD>
__attribute__((target(JS_DP_TARGET))) void item_avx512bf16(const Problem& pr, int64_t i, int64_t next, Scratch& sc) {
  constexpr bool kDp = std::is_same_v<KT, uint16_t> && HD > 0 && HD % 32 == 0;
  run_item<KT, 16, HD, kDp>(pr, i, next, sc);
}
#endif
#endif

// kAvx512Bf16: AVX-512 plus AVX512-BF16 (VDPBF16PS: the matmul's bfloat16 weights by dot products,
// matmul.cc; AMD Zen 4 and later, Intel Cooper Lake and later); kAmx: that plus the AMX bf16 tiles
// (the same weights on the tiles).  Every other kernel runs its AVX-512 code on both.
enum Isa { kGeneric = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmx = 4 };

#if JS_X86 && JAXSERVE_CAN_AMX
// Linux hands out the AMX tile state (8 KiB per thread) only to a process that asks first: a
// tile instruction before this syscall is SIGILL.  Asked once; false if the kernel refuses.
bool request_amx_tiles() {
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

bool has_avx512bf16() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
  return a >> 5 & 1;
}

bool has_amx_bf16() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tiles = (d >> 24 & 1) && (d >> 22 & 1);  // AMX-TILE, AMX-BF16
  return tiles && request_amx_tiles();
}
#endif

int detect_isa() {
#if JS_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq"))
#if JAXSERVE_CAN_AMX
    return !has_avx512bf16() ? kAvx512 : has_amx_bf16() ? kAmx : kAvx512Bf16;
#else
    return kAvx512;
#endif
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  return kGeneric;
}

// JAXSERVE_CPU_ISA=generic|avx2|avx512|avx512bf16|amx lowers the best the host has (avx512 turns
// the bfloat16 matmul off, avx512bf16 the AMX tiles).
int initial_isa() {
  int isa = detect_isa();
  if (const char* env = std::getenv("JAXSERVE_CPU_ISA")) {
    std::string s(env);
    int want = s == "generic"      ? kGeneric
               : s == "avx2"       ? kAvx2
               : s == "avx512"     ? kAvx512
               : s == "avx512bf16" ? kAvx512Bf16
               : s == "amx"        ? kAmx
                                   : isa;
    isa = std::min(isa, want);
  }
  return isa;
}

std::atomic<int>& current_isa() {
  static std::atomic<int> isa{initial_isa()};
  return isa;
}

template <class KT, int HD>
ItemFn pick_isa(int isa) {
#if JS_X86
#if JAXSERVE_CAN_AMX
  if (isa >= kAvx512Bf16) return &item_avx512bf16<KT, HD>;
#endif
  if (isa >= kAvx512) return &item_avx512<KT, HD>;
  if (isa == kAvx2) return &item_avx2<KT, HD>;
#endif
  (void)isa;
  return &item_generic<KT, HD>;
}

template <class KT>
ItemFn pick(int isa, int64_t d) {
  switch (d) {
    case 16: return pick_isa<KT, 16>(isa);
    case 32: return pick_isa<KT, 32>(isa);
    case 64: return pick_isa<KT, 64>(isa);
    case 96: return pick_isa<KT, 96>(isa);
    case 128: return pick_isa<KT, 128>(isa);
    case 256: return pick_isa<KT, 256>(isa);
    default: return pick_isa<KT, 0>(isa);
  }
}

// The checks and fields every handler shares: q and out [..., H, D] of rank q_rank, the pages,
// the scales (null for float pages).  Fills pr's pool fields; `fn` gets the kernel to run.
ffi::Error setup(const char* what, int64_t q_rank, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                 const ffi::AnyBuffer* k_scales, const ffi::AnyBuffer* v_scales, ffi::Result<ffi::AnyBuffer>& out,
                 Problem& pr, ItemFn& fn) {
  const std::string w(what);
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), od = out->dimensions();
  if (int64_t(qd.size()) != q_rank || od.size() != qd.size())
    return ffi::Error::InvalidArgument(w + ": q and output must be rank " + std::to_string(q_rank) + ", got " +
                                       jaxserve_cpu::dims_str(qd));
  if (kd.size() != 4 || vd.size() != 4) return ffi::Error::InvalidArgument(w + ": pages must be rank 4");
  for (size_t i = 0; i < qd.size(); ++i)
    if (qd[i] != od[i]) return ffi::Error::InvalidArgument(w + ": output shape");
  for (int i = 0; i < 4; ++i)
    if (kd[i] != vd[i])
      return ffi::Error::InvalidArgument(w + ": k pages " + jaxserve_cpu::dims_str(kd) + " and v pages " +
                                         jaxserve_cpu::dims_str(vd) + " differ");
  const auto kt = k.element_type(), qt = q.element_type();
  const bool q8 = k_scales != nullptr;
  if (q8) {
    if (kt != ffi::S8 || v.element_type() != ffi::S8)
      return ffi::Error::InvalidArgument(w + ": quantized pages must both be int8");
    for (const ffi::AnyBuffer* sb : {k_scales, v_scales}) {
      auto sd = sb->dimensions();
      if (sb->element_type() != ffi::BF16 || sd.size() != 3 || sd[0] != kd[0] || sd[1] != kd[1] || sd[2] != kd[2])
        return ffi::Error::InvalidArgument(w + ": scales must be bfloat16 [num_pages, page_size, KVH], got " +
                                           jaxserve_cpu::dims_str(sd) + " for pages " + jaxserve_cpu::dims_str(kd));
    }
  } else if (kt != v.element_type() || (kt != ffi::F32 && kt != ffi::BF16 && kt != ffi::U16)) {
    // U16: bfloat16 bits (a bfloat16 pool XLA:CPU scatters into in place; see reference.py)
    return ffi::Error::InvalidArgument(w + ": pages must both be float32 or bfloat16");
  }
  if ((qt != ffi::F32 && qt != ffi::BF16) || out->element_type() != qt)
    return ffi::Error::InvalidArgument(w + ": q must be float32 or bfloat16, output the same");
  pr.H = qd[q_rank - 2];
  pr.D = qd[q_rank - 1];
  pr.num_pages = kd[0];
  pr.ps = kd[1];
  pr.KVH = kd[2];
  if (kd[3] != pr.D)
    return ffi::Error::InvalidArgument(w + ": head dims of q " + jaxserve_cpu::dims_str(qd) + " and pages " +
                                       jaxserve_cpu::dims_str(kd) + " differ");
  if (pr.KVH <= 0 || pr.H % pr.KVH != 0)
    return ffi::Error::InvalidArgument(w + ": query heads must be a multiple of KV heads");
  pr.G = pr.H / pr.KVH;
  pr.q_bf16 = qt == ffi::BF16;
  pr.q = q.untyped_data();
  pr.k = k.untyped_data();
  pr.v = v.untyped_data();
  pr.out = out->untyped_data();
  pr.ks = q8 ? static_cast<const uint16_t*>(k_scales->untyped_data()) : nullptr;
  pr.vs = q8 ? static_cast<const uint16_t*>(v_scales->untyped_data()) : nullptr;
  const int isa = current_isa().load(std::memory_order_relaxed);
  fn = q8 ? pick<int8_t>(isa, pr.D) : kt == ffi::F32 ? pick<float>(isa, pr.D) : pick<uint16_t>(isa, pr.D);
  return ffi::Error::Success();
}

// Runs the kernel over pr (set up, with R, N, P and the index arrays) for the rows starting at
// starts [R + 1] (clamped: nondecreasing, within [0, N]); zeroes the tokens outside every row.
ffi::Error run(const char* what, ffi::ThreadPool pool, Problem& pr, ItemFn fn, std::vector<int64_t>& starts,
               int64_t kv_heads_per_item) {
  if (pr.N == 0 || pr.H == 0 || pr.D == 0) return ffi::Error::Success();
  const int64_t tok_bytes = pr.H * pr.D * (pr.q_bf16 ? 2 : 4);
  char* out = static_cast<char*>(pr.out);
  if (pr.R == 0 || pr.num_pages == 0 || pr.ps == 0 || pr.P == 0) {  // nothing to attend to
    std::memset(out, 0, size_t(pr.N * tok_bytes));
    return ffi::Error::Success();
  }
  for (int64_t r = 0; r <= pr.R; ++r) starts[r] = std::clamp<int64_t>(starts[r], r ? starts[r - 1] : 0, pr.N);
  std::memset(out, 0, size_t(starts[0] * tok_bytes));  // tokens before the first row, past the last
  std::memset(out + starts[pr.R] * tok_bytes, 0, size_t((pr.N - starts[pr.R]) * tok_bytes));
  // As many workers as XLA's pool has threads (one per core by default): the caller and one
  // pool task fewer than that, so that the workers do not outnumber the cores.
  const int64_t workers = std::max<int64_t>(1, pool.num_threads());
  std::vector<WorkItem> items;
  std::vector<SplitGroup> groups;
  plan(pr, starts, workers, kv_heads_per_item, items, groups);
  // Partials: per slot, the item's rows (its KV heads x queries x G) of D + 2 floats.
  std::vector<int64_t> part_off;
  int64_t total = 0;
  for (const SplitGroup& g : groups)
    for (int64_t q = 0; q < g.parts; ++q) {
      part_off.push_back(total);
      total += std::min(pr.khi, pr.KVH - g.it.kh0) * g.it.nt * pr.G * (pr.D + 2);
    }
  std::vector<float> partials(static_cast<size_t>(total));
  pr.partials = partials.data();
  pr.part_off = part_off.data();
  const bool ok = jaxserve_cpu::run_items(
      pool, pr.n_items, [pr] { return Scratch(pr); },
      [pr, fn](Scratch& sc, int64_t i, int64_t next) {
        if (!sc.base) return false;
        fn(pr, i, next, sc);
        return true;
      });
  if (!ok) return ffi::Error::Internal(std::string(what) + ": out of memory for scratch");
  for (const SplitGroup& g : groups) merge_partitions(pr, g);
  return ffi::Error::Success();
}

// The ragged handlers: q [N, H, D], query_start_loc [R + 1], seq_lens [R], block_tables [R, P],
// positions [N].
ffi::Error RaggedCore(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                      const ffi::AnyBuffer* k_scales, const ffi::AnyBuffer* v_scales, ffi::BufferR1<ffi::S32> qsl,
                      ffi::BufferR1<ffi::S32> lens, ffi::BufferR2<ffi::S32> bt, ffi::BufferR1<ffi::S32> pos,
                      ffi::Result<ffi::AnyBuffer> out, float scale, int64_t kv_heads_per_item, int64_t window) {
  Problem pr{};
  ItemFn fn = nullptr;
  if (auto e = setup("ragged_paged_attention", 3, q, k, v, k_scales, v_scales, out, pr, fn); e.failure()) return e;
  const int64_t N = q.dimensions()[0], R = lens.dimensions()[0];
  auto btd = bt.dimensions();
  if (qsl.dimensions()[0] != R + 1 || btd[0] != R || pos.dimensions()[0] != N)
    return ffi::Error::InvalidArgument(
        "ragged_paged_attention: query_start_loc [R+1], seq_lens [R], block_tables [R,P], positions [N], got " +
        jaxserve_cpu::dims_str(qsl.dimensions()) + ", " + jaxserve_cpu::dims_str(lens.dimensions()) + ", " +
        jaxserve_cpu::dims_str(btd) + ", " + jaxserve_cpu::dims_str(pos.dimensions()) + " for q " +
        jaxserve_cpu::dims_str(q.dimensions()));
  pr.R = R;
  pr.N = N;
  pr.P = btd[1];
  pr.scale = scale;
  pr.window = window;
  pr.bt = bt.typed_data();
  pr.lens = lens.typed_data();
  pr.pos = pos.typed_data();
  const int32_t* s = qsl.typed_data();
  std::vector<int64_t> starts(s, s + R + 1);
  return run("ragged_paged_attention", pool, pr, fn, starts, kv_heads_per_item);
}

ffi::Error RaggedImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                      ffi::BufferR1<ffi::S32> qsl, ffi::BufferR1<ffi::S32> lens, ffi::BufferR2<ffi::S32> bt,
                      ffi::BufferR1<ffi::S32> pos, ffi::Result<ffi::AnyBuffer> out, float scale,
                      int64_t kv_heads_per_item, int64_t window) {
  return RaggedCore(pool, q, k, v, nullptr, nullptr, qsl, lens, bt, pos, out, scale, kv_heads_per_item, window);
}

ffi::Error RaggedQ8Impl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer k_scales, ffi::AnyBuffer v_scales, ffi::BufferR1<ffi::S32> qsl,
                        ffi::BufferR1<ffi::S32> lens, ffi::BufferR2<ffi::S32> bt, ffi::BufferR1<ffi::S32> pos,
                        ffi::Result<ffi::AnyBuffer> out, float scale, int64_t kv_heads_per_item, int64_t window) {
  return RaggedCore(pool, q, k, v, &k_scales, &v_scales, qsl, lens, bt, pos, out, scale, kv_heads_per_item,
                    window);
}

}  // namespace

// The ragged layout: one flat array of query tokens, rows of any length (decode, prefill chunks,
// speculative verification in one call).
JS_EXPORT XLA_FFI_Error* JaxserveRaggedPagedAttention(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRaggedPagedAttention, RaggedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()               // q [N, H, D]
                                  .Arg<ffi::AnyBuffer>()               // k pages
                                  .Arg<ffi::AnyBuffer>()               // v pages
                                  .Arg<ffi::BufferR1<ffi::S32>>()      // query_start_loc [R + 1]
                                  .Arg<ffi::BufferR1<ffi::S32>>()      // seq_lens [R]
                                  .Arg<ffi::BufferR2<ffi::S32>>()      // block_tables [R, P]
                                  .Arg<ffi::BufferR1<ffi::S32>>()      // positions [N]
                                  .Ret<ffi::AnyBuffer>()               // out [N, H, D]
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("kv_heads_per_item")
                                  .Attr<int64_t>("window"));

JS_EXPORT XLA_FFI_Error* JaxserveRaggedPagedAttentionQ8(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRaggedPagedAttentionQ8, RaggedQ8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()               // q [N, H, D]
                                  .Arg<ffi::AnyBuffer>()               // k pages (int8)
                                  .Arg<ffi::AnyBuffer>()               // v pages (int8)
                                  .Arg<ffi::AnyBuffer>()               // k scales [num_pages, ps, KVH] bf16
                                  .Arg<ffi::AnyBuffer>()               // v scales
                                  .Arg<ffi::BufferR1<ffi::S32>>()      // query_start_loc [R + 1]
                                  .Arg<ffi::BufferR1<ffi::S32>>()      // seq_lens [R]
                                  .Arg<ffi::BufferR2<ffi::S32>>()      // block_tables [R, P]
                                  .Arg<ffi::BufferR1<ffi::S32>>()      // positions [N]
                                  .Ret<ffi::AnyBuffer>()               // out [N, H, D]
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("kv_heads_per_item")
                                  .Attr<int64_t>("window"));

// Which vector code runs: 0 baseline, 1 AVX2+FMA, 2 AVX-512, 3 AVX-512 + AVX512-BF16, 4 that + AMX.
JS_EXPORT int jaxserve_cpu_isa() { return current_isa().load(); }
// The best instruction set this host supports.
JS_EXPORT int jaxserve_cpu_best_isa() { return detect_isa(); }
// Use at most `isa` (for tests of every variant on one host); returns the one now in use.
JS_EXPORT int jaxserve_cpu_set_isa(int isa) {
  current_isa().store(std::clamp(isa, 0, detect_isa()));
  return current_isa().load();
}
// Bumped whenever the FFI signature changes, so a stale library is not used (3: the int8 pages'
// scales are bfloat16, float32 before; 4: the ragged handlers; 5: the avx512bf16 level, amx is 4;
// 6: the sliding `window` attribute).
JS_EXPORT int jaxserve_cpu_abi_version() { return 6; }

// The sha256 of the source this library was built from (native.py passes it), so that a source
// checkout rebuilds a library made from another version of this file.
#ifndef JAXSERVE_SOURCE_SHA256
#define JAXSERVE_SOURCE_SHA256 "unknown"
#endif
JS_EXPORT __attribute__((used)) const char jaxserve_cpu_source[] =
    "jaxserve-source-sha256:" JAXSERVE_SOURCE_SHA256;
