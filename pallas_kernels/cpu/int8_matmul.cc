// Weight-only int8 matmul on the CPU, called from jitted JAX through XLA FFI.
//
//   y[m, n] = scale[n] * sum_k x[m, k] * float(w[n, k])
//
// x [M, K] float32, w [N, K] int8 (one row per output channel: the layout transformers stores and
// the one this kernel streams), scale [N] float32, y [M, N] float32.  The int8 weights are widened
// to float32 in registers as they are read (never a float copy of the weights in memory), the
// products are summed in float32 in a fixed order per output element (independent of the thread
// count and of which work item computes it), and the scale is applied once at the end.
// pallas_kernels/native_matmul.py is the Python side; its jnp reference is the oracle.
//
// Work split: one work item = a block of output channels (whole groups of 4).  Inside an item,
// each group of 4 channels is multiplied with every row of x in tiles of RM rows: 4 x RM vector
// accumulators, each int8 vector widened once per tile and used for RM rows.  With more rows than
// one tile, the group's 4 weight rows are first widened into a small float32 scratch (4 x K floats,
// in L1/L2) so that every further tile reads floats instead of widening again.  Items are taken
// from a shared atomic counter by the calling thread and by tasks queued on XLA's own CPU thread
// pool, as the paged-attention kernel does; a late task finds no item and touches nothing.
//
// Vector code: GCC/Clang vector extensions written once for N float lanes, compiled as baseline
// (N = 4), AVX2+FMA (N = 8) and AVX-512 (N = 16) and chosen at run time by the same switch as the
// attention kernel (jaxserve_cpu_isa() in paged_attention.cc, JAXSERVE_CPU_ISA lowers it).  Any K
// works: the last K % N elements take a scalar tail; any N: the last N % 4 channels take a
// one-channel path.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define JQ_X86 1
#endif

namespace ffi = xla::ffi;

#define JQ_INLINE inline __attribute__((always_inline))
#define JQ_EXPORT extern "C" __attribute__((visibility("default")))

// Defined in paged_attention.cc (same library): which vector code runs, 0 baseline, 1 AVX2+FMA,
// 2 AVX-512.
extern "C" int jaxserve_cpu_isa();

namespace {

template <int N>
struct QV {
  typedef float F __attribute__((vector_size(4 * N)));
  typedef int32_t I __attribute__((vector_size(4 * N)));
};

template <int N>
JQ_INLINE typename QV<N>::F fload(const float* p) {
  typename QV<N>::F v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// 4N int8 weights w[k0, k0 + 4N) as four float vectors: lane i of vector j is w[k0 + 4i + j]
// (N int32 lanes, each holding 4 consecutive weights, sign-extended by shifts; compilers turn this
// into a load, shifts and conversions, where a direct int8 -> float vector conversion does not
// vectorise).  x is permuted the same way once per call (see permute_x), so lanes line up.
template <int N>
JQ_INLINE void widen4(const int8_t* p, typename QV<N>::F (&out)[4]) {
  typename QV<N>::I v;
  std::memcpy(&v, p, sizeof v);
  out[0] = __builtin_convertvector((v << 24) >> 24, typename QV<N>::F);
  out[1] = __builtin_convertvector((v << 16) >> 24, typename QV<N>::F);
  out[2] = __builtin_convertvector((v << 8) >> 24, typename QV<N>::F);
  out[3] = __builtin_convertvector(v >> 24, typename QV<N>::F);
}
template <int N>
JQ_INLINE void widen4(const float* p, typename QV<N>::F (&out)[4]) {  // already widened (scratch)
  for (int j = 0; j < 4; ++j) out[j] = fload<N>(p + j * N);
}
JQ_INLINE float qwiden(float x) { return x; }
JQ_INLINE float qwiden(int8_t x) { return float(x); }

// The order in which the kernel reads a row of x (or of widened weights): within each block of
// 4N elements, element 4i + j goes to j * N + i; the tail (K % 4N) stays in place.
JQ_INLINE int64_t permuted(int64_t k, int64_t K, int n) {
  const int64_t blk = 4 * n, kv = K - K % blk;
  if (k >= kv) return k;
  const int64_t k0 = k - k % blk, o = k % blk;
  return k0 + (o % 4) * n + o / 4;
}

template <int N>
JQ_INLINE float qhsum(typename QV<N>::F v) {
  float lanes[N];
  std::memcpy(lanes, &v, sizeof lanes);
  for (int w = N / 2; w >= 1; w /= 2)  // pairwise, a fixed order
    for (int i = 0; i < w; ++i) lanes[i] += lanes[i + w];
  return lanes[0];
}

// Sums of 4 vectors at once: two rounds of folding halves together (lane shuffles), then the last
// N/4 lanes of each in scalar.  A fixed order, so a result never depends on the other rows.
template <int N>
constexpr int fold1(int i) {  // lanes of a's low half then b's low half (of the pair a, b)
  return i < N / 2 ? i : N + (i - N / 2);
}
template <int N>
constexpr int fold2(int i) {  // quarter g of the result: a, b from the first pair, c, d from the second
  return (i / (N / 4)) / 2 * N + (i / (N / 4)) % 2 * (N / 2) + i % (N / 4);
}
template <int N, int... I>
JQ_INLINE void hsum4(const typename QV<N>::F (&v)[4], float* out, std::integer_sequence<int, I...>) {
  using F = typename QV<N>::F;
  F ab = __builtin_shufflevector(v[0], v[1], fold1<N>(I)...) + __builtin_shufflevector(v[0], v[1], (fold1<N>(I) + N / 2)...);
  F cd = __builtin_shufflevector(v[2], v[3], fold1<N>(I)...) + __builtin_shufflevector(v[2], v[3], (fold1<N>(I) + N / 2)...);
  F s = __builtin_shufflevector(ab, cd, fold2<N>(I)...) + __builtin_shufflevector(ab, cd, (fold2<N>(I) + N / 4)...);
  float lanes[N];
  std::memcpy(lanes, &s, sizeof lanes);
  for (int c = 0; c < 4; ++c) {
    float t = lanes[c * (N / 4)];
    for (int i = 1; i < N / 4; ++i) t += lanes[c * (N / 4) + i];
    out[c] = t;
  }
}

struct Problem {
  const float* x;  // [M, K], permuted for the vector width in use
  const int8_t* w;
  const float* scale;
  float* y;
  int64_t M, K, N;
  int64_t per_item;  // channels per work item, a multiple of 4
  int64_t n_items;
};

// Weight vector j (0..3) of a block: from the block's N int32 lanes (int8 weights), or the j-th
// float vector of its widened copy in scratch.
template <int N>
struct WBlock {
  typename QV<N>::I v;
  JQ_INLINE void load(const int8_t* p) { std::memcpy(&v, p, sizeof v); }
  JQ_INLINE typename QV<N>::F get(int j) const {
    switch (j) {
      case 0: return __builtin_convertvector((v << 24) >> 24, typename QV<N>::F);
      case 1: return __builtin_convertvector((v << 16) >> 24, typename QV<N>::F);
      case 2: return __builtin_convertvector((v << 8) >> 24, typename QV<N>::F);
      default: return __builtin_convertvector(v >> 24, typename QV<N>::F);
    }
  }
};
template <int N>
struct FBlock {
  const float* p;
  JQ_INLINE void load(const float* q) { p = q; }
  JQ_INLINE typename QV<N>::F get(int j) const { return fload<N>(p + j * N); }
};
template <int N, class WT>
using Block = typename std::conditional<std::is_same<WT, float>::value, FBlock<N>, WBlock<N>>::type;

// Rows [m0, m0 + R) x channels [n0, n0 + C) of y, R <= RM, C <= 4, weights from `wsrc` (int8
// rows of the weight matrix, or their widened float32 copy in scratch), row stride K either way.
// Live vectors: RM x C accumulators, C weight blocks, C weight vectors and one of x (AVX-512:
// 6 x 4 + 4 + 4 + 1 of 32 registers).
template <int N, int RM, int C, class WT>
JQ_INLINE void tile(const Problem& pr, const WT* wsrc, int64_t m0, int R, int64_t n0) {
  using F = typename QV<N>::F;
  const int64_t K = pr.K, kv = K - K % (4 * N);
  F acc[RM][C];
  for (int r = 0; r < RM; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = F{};
  const float* x0 = pr.x + m0 * K;
  for (int64_t k = 0; k < kv; k += 4 * N) {
    Block<N, WT> blk[C];
    for (int c = 0; c < C; ++c) blk[c].load(wsrc + c * K + k);
    for (int j = 0; j < 4; ++j) {
      F wv[C];
      for (int c = 0; c < C; ++c) wv[c] = blk[c].get(j);
      for (int r = 0; r < RM; ++r) {
        if (r < R) {
          F xv = fload<N>(x0 + r * K + k + j * N);
          for (int c = 0; c < C; ++c) acc[r][c] += xv * wv[c];
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const float* xr = x0 + r * K;
    float* yr = pr.y + (m0 + r) * pr.N + n0;
    float sums[4];
    if constexpr (C == 4) {
      hsum4<N>(acc[r], sums, std::make_integer_sequence<int, N>{});
    } else {
      for (int c = 0; c < C; ++c) sums[c] = qhsum<N>(acc[r][c]);
    }
    for (int c = 0; c < C; ++c) {
      float s = sums[c];
      for (int64_t k = kv; k < K; ++k) s += xr[k] * qwiden(wsrc[c * K + k]);
      yr[c] = s * pr.scale[n0 + c];
    }
  }
}

template <int N, int RM, int C>
JQ_INLINE void channels(const Problem& pr, int64_t n0, float* scratch) {
  const int8_t* wq = pr.w + n0 * pr.K;
  if (pr.M <= RM) {
    tile<N, RM, C>(pr, wq, 0, int(pr.M), n0);
    return;
  }
  // Widen this group's rows once (in the kernel's lane order); every tile of rows then reads floats.
  using F = typename QV<N>::F;
  const int64_t K = pr.K, kv = K - K % (4 * N);
  for (int c = 0; c < C; ++c) {
    for (int64_t k = 0; k < kv; k += 4 * N) {
      F v[4];
      widen4<N>(wq + c * K + k, v);
      std::memcpy(scratch + c * K + k, v, sizeof v);
    }
    for (int64_t k = kv; k < K; ++k) scratch[c * K + k] = float(wq[c * K + k]);
  }
  int64_t m = 0;
  for (; m + RM <= pr.M; m += RM) tile<N, RM, C>(pr, scratch, m, RM, n0);
  if (m < pr.M) tile<N, RM, C>(pr, scratch, m, int(pr.M - m), n0);
}

template <int N, int RM>
JQ_INLINE void run_item(const Problem& pr, int64_t item, float* scratch) {
  const int64_t n0 = item * pr.per_item, n1 = std::min(pr.N, n0 + pr.per_item);
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) channels<N, RM, 4>(pr, n, scratch);
  for (; n < n1; ++n) channels<N, RM, 1>(pr, n, scratch);
}

using ItemFn = void (*)(const Problem&, int64_t, float*);

void item_generic(const Problem& pr, int64_t i, float* s) { run_item<4, 2>(pr, i, s); }
#if JQ_X86
__attribute__((target("avx2,fma"))) void item_avx2(const Problem& pr, int64_t i, float* s) {
  run_item<8, 2>(pr, i, s);
}
__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma"))) void item_avx512(const Problem& pr,
                                                                                        int64_t i, float* s) {
  run_item<16, 6>(pr, i, s);
}
#endif

ItemFn pick(int isa) {
#if JQ_X86
  if (isa == 2) return &item_avx512;
  if (isa == 1) return &item_avx2;
#endif
  (void)isa;
  return &item_generic;
}

struct Shared {
  Problem pr;
  ItemFn fn;
  int rm;  // rows per tile of the variant in use: a scratch is needed above it
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::atomic<bool> out_of_memory{false};
};

void work(Shared& sh) {
  int64_t i = sh.next.fetch_add(1, std::memory_order_relaxed);
  if (i >= sh.pr.n_items) return;  // nothing left: touch nothing (the call may have returned)
  std::unique_ptr<float[]> scratch;
  if (sh.pr.M > sh.rm) scratch.reset(new (std::nothrow) float[4 * sh.pr.K]);
  for (; i < sh.pr.n_items; i = sh.next.fetch_add(1, std::memory_order_relaxed)) {
    if (sh.pr.M <= sh.rm || scratch) sh.fn(sh.pr, i, scratch.get());
    else sh.out_of_memory.store(true, std::memory_order_relaxed);
    sh.done.fetch_add(1, std::memory_order_release);
  }
}

JQ_INLINE void relax() {
#if JQ_X86
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

std::string shape_str(ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// About this many multiply-adds per work item (so that an item costs well over the ~1 us of
// queueing it), and at most 4 items per worker.
constexpr int64_t kItemWork = 1 << 17;

ffi::Error Int8MatmulImpl(ffi::ThreadPool pool, ffi::BufferR2<ffi::F32> x, ffi::BufferR2<ffi::S8> w,
                          ffi::BufferR1<ffi::F32> scale, ffi::ResultBufferR2<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), sd = scale.dimensions(), yd = y->dimensions();
  if (xd[1] != wd[1] || sd[0] != wd[0] || yd[0] != xd[0] || yd[1] != wd[0])
    return ffi::Error::InvalidArgument("int8_matmul: x [M, K], w [N, K], scale [N] -> y [M, N]; got x " +
                                       shape_str(xd) + ", w " + shape_str(wd) + ", scale " + shape_str(sd) +
                                       ", y " + shape_str(yd));
  Problem pr{};
  pr.M = xd[0];
  pr.K = xd[1];
  pr.N = wd[0];
  pr.x = x.typed_data();
  pr.w = w.typed_data();
  pr.scale = scale.typed_data();
  pr.y = y->typed_data();
  if (pr.M == 0 || pr.N == 0) return ffi::Error::Success();
  if (pr.K == 0) {
    std::memset(pr.y, 0, sizeof(float) * pr.M * pr.N);
    return ffi::Error::Success();
  }
  const int64_t workers = std::max<int64_t>(1, pool.num_threads());
  const int64_t groups = (pr.N + 3) / 4;
  const int64_t work_per_group = 4 * pr.K * pr.M;
  int64_t items = std::max<int64_t>(1, groups * work_per_group / kItemWork);
  items = std::min({items, groups, 4 * workers});
  pr.per_item = 4 * ((groups + items - 1) / items);
  pr.n_items = (pr.N + pr.per_item - 1) / pr.per_item;

  const int isa = jaxserve_cpu_isa();
  const int lanes = isa == 2 ? 16 : isa == 1 ? 8 : 4;
  // x in the kernel's lane order (a copy of M x K floats, small beside the weights)
  std::unique_ptr<float[]> xp(new (std::nothrow) float[pr.M * pr.K]);
  if (!xp) return ffi::Error::Internal("int8_matmul: out of memory for x");
  for (int64_t m = 0; m < pr.M; ++m)
    for (int64_t k = 0; k < pr.K; ++k) xp[m * pr.K + permuted(k, pr.K, lanes)] = pr.x[m * pr.K + k];
  pr.x = xp.get();
  auto sh = std::make_shared<Shared>();
  sh->pr = pr;
  sh->fn = pick(isa);
  sh->rm = isa == 2 ? 6 : 2;  // RM of the variant picked
  const int64_t helpers = std::min(workers - 1, pr.n_items - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([sh] { work(*sh); });
  work(*sh);
  for (int spins = 0; sh->done.load(std::memory_order_acquire) < pr.n_items; ++spins) {
    if (spins < 256) relax();
    else std::this_thread::yield();
  }
  if (sh->out_of_memory.load()) return ffi::Error::Internal("int8_matmul: out of memory for scratch");
  return ffi::Error::Success();
}

}  // namespace

JQ_EXPORT XLA_FFI_Error* JaxserveInt8Matmul(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveInt8Matmul, Int8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR2<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::BufferR2<ffi::S8>>()    // w [N, K]
                                  .Arg<ffi::BufferR1<ffi::F32>>()   // scale [N]
                                  .Ret<ffi::BufferR2<ffi::F32>>());  // y [M, N]

// Bumped whenever this kernel's FFI signature changes, so that a stale library is not used.
JQ_EXPORT int jaxserve_int8_matmul_abi_version() { return 1; }
