// One parallel region for a whole decode step (mii_team::run) in place of one per kernel call. A single-stream
// decode step calls ~150 parallel kernels (4 linears and attention per layer), each of which forked and joined the
// OpenMP team: timed inside a step (int4, 2 threads), the threads started 1.0-1.6 us after the call and the call
// returned ~0.5 us after the last one finished, ~2 us of ~25 us a linear. Under mii_team::run the calling thread
// runs the step as before while the team's other threads wait for work in the same region; a kernel's
// mii_team::parallel_for hands each of them its share through one cache line and waits for them through another.
// Outside a region it is at::parallel_for. The shares are at::parallel_for's (OpenMP backend), so a kernel's
// threads do the same work either way and its results are the same. Alternated every 4 steps in one process (Zen 4,
// 2 threads): single-stream int4 steps 2.3-3.8% faster (6 of 6 rounds), bf16 1.5-3.9%; 4 streams even. Included by
// the kernels' sources; part of the build's hash (mii/kernels/__init__.py).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

namespace mii_team {

inline void relax(int64_t& spins) {  // spin briefly, then give the core away (a shared or oversubscribed machine)
#if defined(__x86_64__)
  _mm_pause();
#endif
  if (++spins > 4096) std::this_thread::yield();
}

struct alignas(64) Flag {
  std::atomic<uint64_t> v{0};
};

struct Team {
  static constexpr uint64_t kExit = ~uint64_t(0);
  int threads = 1;
  Flag go;  // the generation of the job posted last (kExit: the region ends)
  // the job, written before go moves on
  void (*call)(const void*, int64_t, int64_t) = nullptr;
  const void* fn = nullptr;
  int64_t begin = 0, end = 0, chunk = 0;
  std::vector<Flag> done;  // per thread: the last generation it finished
  std::vector<std::exception_ptr> error;
  uint64_t generation = 0;

  explicit Team(int n) : threads(n), done(n), error(n) {}

  void share(int tid) {  // thread tid's share of the posted job
    const int64_t b = begin + tid * chunk;
    if (b >= end) return;
    try {
      call(fn, b, std::min(end, b + chunk));
    } catch (...) {
      error[tid] = std::current_exception();
    }
  }

  void serve(int tid) {  // a thread other than the caller's: take each job until the region ends
    uint64_t seen = 0;
    for (;;) {
      uint64_t g;
      int64_t spins = 0;
      while ((g = go.v.load(std::memory_order_acquire)) == seen) relax(spins);
      if (g == kExit) return;
      seen = g;
      share(tid);
      done[tid].v.store(g, std::memory_order_release);
    }
  }
};

// the region the calling thread runs in, if any (set on that thread alone)
inline Team*& current() {
  static thread_local Team* team = nullptr;
  return team;
}

// at::parallel_for(begin, end, grain, f), the shares handed to the current region's threads when there is one
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  Team* team = current();
  if (team == nullptr) return at::parallel_for(begin, end, grain, f);
  if (begin >= end) return;
  const int64_t n = end - begin;
  if (n <= grain || n == 1 || team->threads == 1) return f(begin, end);
  const int64_t least = std::max<int64_t>(grain, 1), tasks = std::min<int64_t>(team->threads, (n + least - 1) / least);
  team->call = [](const void* fn, int64_t b, int64_t e) { (*static_cast<const F*>(fn))(b, e); };
  team->fn = &f;
  team->begin = begin, team->end = end, team->chunk = (n + tasks - 1) / tasks;
  const uint64_t g = ++team->generation;
  team->go.v.store(g, std::memory_order_release);
  team->share(0);
  for (int t = 1; t < team->threads; ++t) {
    int64_t spins = 0;
    while (team->done[t].v.load(std::memory_order_acquire) != g) relax(spins);
  }
  for (auto& e : team->error)
    if (e) {
      const std::exception_ptr first = e;
      for (auto& x : team->error) x = nullptr;
      std::rethrow_exception(first);
    }
}

// body() on the calling thread, inside one parallel region of at::get_num_threads() threads whose kernels'
// mii_team::parallel_for calls are shared out there; body's exception comes out of run
template <class Body>
void run(const Body& body) {
  const int threads = at::get_num_threads();
#ifdef _OPENMP
  if (threads > 1 && current() == nullptr && !omp_in_parallel()) {
    std::exception_ptr error;
    Team team(threads);
#pragma omp parallel num_threads(threads)
    {
      const int tid = omp_get_thread_num();
      if (tid == 0) {
        team.threads = omp_get_num_threads();
        current() = &team;
        try {
          body();
        } catch (...) {
          error = std::current_exception();
        }
        current() = nullptr;
        team.go.v.store(Team::kExit, std::memory_order_release);
      } else {
        team.serve(tid);
      }
    }
    if (error) std::rethrow_exception(error);
    return;
  }
#endif
  body();
}

}  // namespace mii_team
