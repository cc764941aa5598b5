// Greedy sampling's argmax on the CPU, called from jitted JAX through XLA FFI:
//
//   ids[s] = the first j with x[s, j] == max_j x[s, j]        x [S, V] float32, ids [S] int32
//
// Why a kernel for this: XLA:CPU lowers the two-pass argmax of runner/sampling.py to two
// reductions over the logits (the block maxima, then a full-row max that XLA merges into a
// second pass), 0.27 ms at 8 rows x 32,000 and 0.35-0.45 ms at 32 on the development machine,
// 1.5-2% of a decode step, for 1-4 MB that the LM head has just left in cache.  One pass here
// keeps per lane the largest value and where it was first seen, then picks among the lanes the
// largest value and, of equal ones, the smallest index: the first index of the row maximum,
// exactly.  NaN never compares greater, so a NaN is skipped unless a lane starts on one (a row
// holding a NaN gets an unspecified id, as in sampling.argmax, but always one in [0, V)).
//
// Rows are the work items, shared with XLA's CPU thread pool (work_pool.h).  Vector code:
// GCC/Clang vector extensions for N float lanes, compiled as baseline (N = 4), AVX2 (N = 8) and
// AVX-512 (N = 16), chosen by the attention kernel's switch (jaxserve_cpu_isa()).

#include <cstdint>
#include <cstring>
#include <limits>

#include "xla/ffi/api/ffi.h"
#include "work_pool.h"

namespace ffi = xla::ffi;

#define JA_INLINE inline __attribute__((always_inline))
#define JA_EXPORT extern "C" __attribute__((visibility("default")))

// Defined in paged_attention.cc (same library): 0 baseline, 1 AVX2+FMA, 2 AVX-512.
extern "C" int jaxserve_cpu_isa();

namespace {

template <int N>
struct AV {
  typedef float F __attribute__((vector_size(4 * N)));
  typedef int32_t I __attribute__((vector_size(4 * N)));
};

// Keeps (a, ia) if a is larger, or equal with an index no later; else (b, ib): merging two
// partial results this way keeps the first index of the maximum.
template <int N>
JA_INLINE void keep_first_max(typename AV<N>::F& a, typename AV<N>::I& ia, typename AV<N>::F b, typename AV<N>::I ib) {
  using F = typename AV<N>::F;
  using I = typename AV<N>::I;
  const I take = (b > a) | ((b == a) & (ib < ia));
  a = (F)(((I)b & take) | ((I)a & ~take));
  ia = (ib & take) | (ia & ~take);
}

template <int N>
JA_INLINE int32_t row_argmax(const float* x, int64_t v) {
  using F = typename AV<N>::F;
  using I = typename AV<N>::I;
  constexpr int U = 4;  // independent running maxima, so the compares do not wait on each other
  float m = -std::numeric_limits<float>::infinity();
  int64_t at = 0;
  int64_t j = 0;
  if (v >= U * N) {
    F best[U];
    I where[U], idx[U];
    for (int u = 0; u < U; ++u) {
      std::memcpy(&best[u], x + u * N, sizeof(F));
      for (int i = 0; i < N; ++i) idx[u][i] = u * N + i;
      where[u] = idx[u];
    }
    // Lane i of set u walks positions u*N + i, then U*N further each step: in order, so strict >
    // keeps each lane's first occurrence.
    for (j = U * N; j + U * N <= v; j += U * N) {
      for (int u = 0; u < U; ++u) {
        F cur;
        std::memcpy(&cur, x + j + u * N, sizeof cur);
        idx[u] += U * N;
        const I gt = cur > best[u];
        best[u] = (F)(((I)cur & gt) | ((I)best[u] & ~gt));
        where[u] = (idx[u] & gt) | (where[u] & ~gt);
      }
    }
    for (int u = 1; u < U; ++u) keep_first_max<N>(best[0], where[0], best[u], where[u]);
    m = best[0][0];
    at = where[0][0];
    for (int i = 1; i < N; ++i)
      if (best[0][i] > m || (best[0][i] == m && where[0][i] < at) || (m != m && best[0][i] == best[0][i])) {
        m = best[0][i];
        at = where[0][i];
      }
  }
  for (; j < v; ++j)  // the tail, after every index seen so far: strict > keeps the first
    if (x[j] > m) {
      m = x[j];
      at = j;
    }
  return int32_t(at);
}

using RowFn = int32_t (*)(const float*, int64_t);

int32_t row_generic(const float* x, int64_t v) { return row_argmax<4>(x, v); }
#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("avx2,fma"))) int32_t row_avx2(const float* x, int64_t v) { return row_argmax<8>(x, v); }
__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma"))) int32_t row_avx512(const float* x,
                                                                                          int64_t v) {
  return row_argmax<16>(x, v);
}
#endif

RowFn pick(int isa) {
#if defined(__x86_64__) || defined(__i386__)
  if (isa >= 2) return &row_avx512;
  if (isa == 1) return &row_avx2;
#endif
  (void)isa;
  return &row_generic;
}

ffi::Error ArgmaxImpl(ffi::ThreadPool pool, ffi::BufferR2<ffi::F32> x, ffi::Result<ffi::BufferR1<ffi::S32>> ids) {
  const auto d = x.dimensions();
  const int64_t s = d[0], v = d[1];
  if (ids->dimensions()[0] != s) return ffi::Error::InvalidArgument("argmax: ids must be [S] for logits [S, V]");
  if (v <= 0 || v > std::numeric_limits<int32_t>::max())
    return ffi::Error::InvalidArgument("argmax: the vocabulary must hold 1 .. 2^31 - 1 entries");
  const float* xs = x.typed_data();
  int32_t* out = ids->typed_data();
  const RowFn fn = pick(jaxserve_cpu_isa());
  jaxserve_cpu::run_items(
      pool, s, [] { return 0; },
      [xs, out, v, fn](int&, int64_t row) {
        out[row] = fn(xs + row * v, v);
        return true;
      });
  return ffi::Error::Success();
}

}  // namespace

JA_EXPORT XLA_FFI_Error* JaxserveArgmax(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveArgmax, ArgmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR2<ffi::F32>>()   // logits [S, V]
                                  .Ret<ffi::BufferR1<ffi::S32>>());  // ids [S]

// Bumped whenever the FFI signature changes (pallas_kernels/native_argmax.py checks it).
JA_EXPORT int jaxserve_argmax_abi_version() { return 1; }
