// How the native CPU kernels (paged_attention.cc, matmul.cc) share out their work items.
//
// XLA's own CPU thread pool is reachable from an FFI handler (ffi::Ctx<ffi::ThreadPool>, one
// thread per core by default).  A kernel queues one task per extra thread and works on the calling
// thread too, every thread taking items from a shared atomic counter: no second set of threads
// competes with XLA's, nothing deadlocks if the pool never runs a task (the caller then does every
// item), and a task that starts after the last item was taken touches nothing, since the call may
// already have returned.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

// Whether this compiler can build the AMX tile code (matmul.cc; GCC 11 / Clang 12 have the
// intrinsics): where it cannot, the library is built without it and never reports the amx level.
#ifndef JAXSERVE_CAN_AMX  // -DJAXSERVE_CAN_AMX=0 builds without it (the test of that build)
#if (defined(__x86_64__) || defined(__i386__)) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define JAXSERVE_CAN_AMX 1
#else
#define JAXSERVE_CAN_AMX 0
#endif
#endif

namespace jaxserve_cpu {

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

inline std::string dims_str(xla::ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// Runs fn(state, i) for every item i in [0, n_items), on the calling thread and on up to
// pool.num_threads() - 1 pool tasks.  Each thread that gets an item first makes its own state
// with make_state() (a scratch buffer, say) and keeps it for all its items.  Returns false when
// any fn(state, i) returned false (e.g. its scratch could not be allocated); every item still
// counts as done, so the call always returns.
//
// fn may instead take (state, i, next): each thread then claims its next item before it starts
// on the current one and passes it (-1: none left), so a kernel can prefetch the next item's data
// while it works on this one.  The price: at the end one thread may hold an item the other could
// have taken, so such kernels cut the work into more items.
template <class MakeState, class Fn>
bool run_items(xla::ffi::ThreadPool pool, int64_t n_items, MakeState make_state, Fn fn) {
  using State = decltype(make_state());
  constexpr bool kLookahead = std::is_invocable_v<Fn&, State&, int64_t, int64_t>;
  struct Shared {
    MakeState make_state;
    Fn fn;
    int64_t n;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::atomic<bool> ok{true};
    Shared(MakeState m, Fn f, int64_t n) : make_state(std::move(m)), fn(std::move(f)), n(n) {}
    int64_t claim() { return next.fetch_add(1, std::memory_order_relaxed); }
    void work() {
      int64_t i = claim();
      if (i >= n) return;  // nothing left: touch nothing (the call may have returned)
      auto state = make_state();
      while (i < n) {
        bool item_ok;
        int64_t after;
        if constexpr (kLookahead) {
          after = claim();
          item_ok = fn(state, i, after < n ? after : int64_t(-1));
        } else {
          item_ok = fn(state, i);
          after = claim();
        }
        if (!item_ok) ok.store(false, std::memory_order_relaxed);
        done.fetch_add(1, std::memory_order_release);
        i = after;
      }
    }
  };
  if (n_items <= 0) return true;
  auto sh = std::make_shared<Shared>(std::move(make_state), std::move(fn), n_items);
  const int64_t workers = std::max<int64_t>(1, pool.num_threads());
  const int64_t helpers = std::min(workers - 1, n_items - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([sh] { sh->work(); });
  sh->work();
  for (int spins = 0; sh->done.load(std::memory_order_acquire) < n_items; ++spins) {
    if (spins < 256) relax();
    else std::this_thread::yield();
  }
  return sh->ok.load();
}

}  // namespace jaxserve_cpu
