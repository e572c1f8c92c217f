// One parallel region for a whole decode step (mii_team::run) in place of one per kernel call. A single-stream
// decode step calls ~150 parallel kernels (4 linears and attention per layer), each of which forked and joined the
// OpenMP team: timed inside a step (int4, 2 threads), the threads started 1.0-1.6 us after the call and the call
// returned ~0.5 us after the last one finished, ~2 us of ~25 us a linear. Under mii_team::run the calling thread
// runs the step as before while the team's other threads wait for work in the same region; a kernel's
// mii_team::parallel_for hands each of them its share through one cache line and waits for them through another.
// Outside a region it is at::parallel_for. The shares are at::parallel_for's (OpenMP backend), so a kernel's
// threads do the same work either way and its results are the same. Alternated every 4 steps in one process (Zen 4,
// 2 threads): single-stream int4 steps 2.3-3.8% faster (6 of 6 rounds), bf16 1.5-3.9%; 4 streams even. The calling
// thread's waits at the joins are timed for the region's Pace (below): fewer threads on a busy CPU. Included by
// the kernels' sources; part of the build's hash (mii/kernels/__init__.py).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
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

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Team {
  static constexpr uint64_t kExit = ~uint64_t(0);
  int threads = 1;
  int64_t waited = 0;  // ns the calling thread waited at the joins for the others' shares
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
  int64_t wait_start = 0;
  for (int t = 1; t < team->threads; ++t) {
    int64_t spins = 0;
    while (team->done[t].v.load(std::memory_order_acquire) != g) {
      if (wait_start == 0) wait_start = now_ns();
      relax(spins);
    }
  }
  if (wait_start != 0) team->waited += now_ns() - wait_start;
  for (auto& e : team->error)
    if (e) {
      const std::exception_ptr first = e;
      for (auto& x : team->error) x = nullptr;
      std::rethrow_exception(first);
    }
}

// How many of its configured threads a model's decode steps take, on a CPU that other processes may be using. A
// region's shares are equal and fixed, so a thread that loses its core to another process keeps the calling
// thread waiting at every join (parallel_for times that wait). Measured on a Zen 4 EPYC (2 threads, single-stream
// int4 decode): idle, the calling thread waits 2-12% of a step (the other thread's start, the shares' imbalance,
// now and then the machine's neighbours: up to 58% over 8 steps); beside a CPU-bound process most of it, and one
// thread decoded at 163-170 tok/s where two did 67-71 (bench/shared_cpu.py). So: over each window of kWindow
// regions, a wait above kDrop of their time takes one thread fewer (n - 1 threads beat n once the wait passes 1/n of
// the time: 1/2 at two); below the configured count, every `interval` regions kProbe regions try one thread more,
// which stays if their wait is below kRise; a failed try doubles the interval, up to kMaxInterval. The values never
// depend on the thread count (the kernels' shares split outputs, never a sum): only the time does.
// MII_THREAD_PACE=0: always the configured threads.
class Pace {
 public:
  static constexpr int kWindow = 16, kProbe = 8;
  static constexpr int64_t kFirstInterval = 16, kMaxInterval = 256;
  static constexpr double kDrop = 0.5, kRise = 0.3;

  explicit Pace(int configured = 0, bool enabled = from_env()) : enabled_(enabled), full_(configured), n_(configured) {}

  static bool from_env() {
    const char* v = std::getenv("MII_THREAD_PACE");
    return v == nullptr || !(v[0] == '0' && v[1] == 0);
  }

  // the threads the next region takes, of `configured` (a new configured count starts afresh)
  int threads(int configured) {
    if (configured != full_) *this = Pace(configured, enabled_);
    return probe_left_ > 0 ? n_ + 1 : n_;
  }
  int settled() const { return n_; }  // the count between tries

  // a region of `threads` threads took `ns`, of which the calling thread waited `waited` for the others
  void record(int threads, int64_t ns, int64_t waited) {
    if (!enabled_ || full_ <= 1) return;
    if (probe_left_ > 0) {
      if (threads == n_ + 1) probe_ns_ += ns, probe_wait_ += waited;
      if (--probe_left_ == 0) {
        if (probe_wait_ < kRise * probe_ns_) {
          ++n_, ++rises;
          interval_ = kFirstInterval;
        } else {
          interval_ = std::min(2 * interval_, kMaxInterval);
        }
        probe_ns_ = probe_wait_ = 0, since_ = 0;
      }
      return;
    }
    if (n_ > 1 && threads == n_) {
      window_ns_ += ns, window_wait_ += waited;
      if (++window_ == kWindow) {
        const bool drop = windows_++ > 0 && window_wait_ > kDrop * window_ns_;  // (the first window: a warm-up)
        window_ = 0, window_ns_ = window_wait_ = 0;
        if (drop) {
          --n_, ++drops;
          interval_ = kFirstInterval, since_ = 0;
          return;
        }
      }
    }
    if (n_ < full_ && ++since_ >= interval_) probe_left_ = kProbe, ++probes, since_ = 0;
  }

  int64_t drops = 0, probes = 0, rises = 0;

 private:
  bool enabled_;
  int full_, n_;
  int window_ = 0, probe_left_ = 0;
  int64_t windows_ = 0, since_ = 0, interval_ = kFirstInterval;
  int64_t window_ns_ = 0, window_wait_ = 0, probe_ns_ = 0, probe_wait_ = 0;
};

// body() on the calling thread, inside one parallel region of at::get_num_threads() threads whose kernels'
// mii_team::parallel_for calls are shared out there; body's exception comes out of run. `pace`: told how long the
// region took and how long its calling thread waited at the joins.
template <class Body>
void run(const Body& body, Pace* pace = nullptr) {
  const int threads = at::get_num_threads();
  const int64_t start = pace != nullptr ? now_ns() : 0;
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
    if (pace != nullptr) pace->record(team.threads, now_ns() - start, team.waited);
    return;
  }
#endif
  body();
  if (pace != nullptr) pace->record(1, now_ns() - start, 0);
}

}  // namespace mii_team
