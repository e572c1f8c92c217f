// One parallel region for a whole decode step (mii_team::run) in place of one per kernel call. A single-stream
// decode step calls ~150 parallel kernels (4 linears and attention per layer), each of which forked and joined the
// OpenMP team: timed inside a step (int4, 2 threads), the threads started 1.0-1.6 us after the call and the call
// returned ~0.5 us after the last one finished, ~2 us of ~25 us a linear. Under mii_team::run the calling thread
// runs the step as before while the team's other threads wait for work in the same region; a kernel's
// mii_team::parallel_for hands each of them its share through one cache line and waits for them through another.
// Outside a region it is at::parallel_for. The shares are at::parallel_for's (OpenMP backend), so a kernel's
// threads do the same work either way and its results are the same. Alternated every 4 steps in one process (Zen 4,
// 2 threads): single-stream int4 steps 2.3-3.8% faster (6 of 6 rounds), bf16 1.5-3.9%; 4 streams even. The calling
// thread's waits at the joins, and its time off its core, are told to the step's Pace (below): fewer threads on a
// busy CPU. Included by the kernels' sources; part of the build's hash (mii/kernels/__init__.py).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <ctime>
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

inline int64_t thread_cpu_ns() {  // the calling thread's time on a core
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1000000000LL + ts.tv_nsec;
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

// where the calling thread's waits at the joins of at::parallel_for's regions add up while timed() runs (set on that
// thread alone)
inline int64_t*& join_waits() {
  static thread_local int64_t* waits = nullptr;
  return waits;
}

// at::parallel_for(begin, end, grain, f), the shares handed to the current region's threads when there is one.
// Outside a region, under timed(), the calling thread's wait from the end of its own share to the join is added up.
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  Team* team = current();
  if (team == nullptr) {
    int64_t* waits = join_waits();
    if (waits == nullptr || at::get_num_threads() == 1 || at::in_parallel_region())
      return at::parallel_for(begin, end, grain, f);
    int64_t mine = 0;  // when the calling thread (thread 0) finished its share
    at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) {
      f(b, e);
      if (at::get_thread_num() == 0) mine = now_ns();
    });
    if (mine != 0) *waits += now_ns() - mine;
    return;
  }
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

// How many of its configured threads a model's steps take, on a CPU that other processes may be using. A region's
// shares are equal and fixed, so a thread that loses its core to another process keeps the calling thread waiting
// at every join (parallel_for times that wait), and threads that share a core slow each other's shares. So each
// step tells its pace how long it took for how many rows, and how much of its time the calling thread lost:
// waiting at the joins, or off its core (Stopwatch). Measured on a Zen 4 EPYC (2 threads), over windows of 16
// steps: idle, single-stream int4 decode steps lost 2-17% waiting and 0-22% off the core (the machine's
// neighbours), prompt steps and 32 streams' decode steps 5-10% in all; beside one CPU-bound process, 85-100%, and
// one thread decoded at 135-170 tok/s where two did 44-71 (bench/shared_cpu.py). But the loss overstates what one
// thread fewer would win where the calling thread sleeps at a join (a wait off its core counts twice) and where
// the other processes only take part of a core: beside a deployment's own front and its clients, 16-32 streams'
// steps lost 25-55% a window, and one thread served 0.7-0.8x the tokens of two. So, over each window of at least
// kWindow steps and kWindowNs: a loss above kSure (a core taken) takes one thread fewer at once; a loss above kDrop
// only raises the question, and the steps' own speed answers it: a trial of kProbe steps, the first half on one
// thread fewer, the rest on the settled count (neighbouring steps of a batch have the same rows, and the machine's
// minute is the same for both; halves, not every other step: a step on one thread fewer right after one on more
// shares its core with the idle thread's spin), kept if the first half's time a row is under kGain of the second's
// (else the next such windows are skipped, 1, 2, 4 ... up to kMaxSkip, until a trial keeps). Below the configured
// count, every `interval` steps a trial of one thread more, kept if faster; a failed one doubles the interval, up
// to kMaxInterval. The values never depend on the thread count (the kernels' shares split outputs, never a sum):
// only the time does.
// MII_THREAD_PACE=0: always the configured threads.
class Pace {
 public:
  static constexpr int kWindow = 16, kProbe = 8, kMaxSkip = 8;
  static constexpr int64_t kFirstInterval = 16, kMaxInterval = 256, kWindowNs = 200000000;
  static constexpr double kDrop = 0.5, kSure = 0.75, kGain = 0.95;

  explicit Pace(int configured = 0, bool enabled = from_env()) : enabled_(enabled), full_(configured), n_(configured) {}

  static bool from_env() {
    const char* v = std::getenv("MII_THREAD_PACE");
    return v == nullptr || !(v[0] == '0' && v[1] == 0);
  }

  // the threads the next step takes, of `configured` (a new configured count starts afresh)
  int threads(int configured) {
    if (configured != full_) *this = Pace(configured, enabled_);
    return trial_ != 0 && trial_left_ > kProbe / 2 ? n_ + trial_ : n_;
  }
  int settled() const { return n_; }  // the count between trials

  // a step of `threads` threads and `rows` rows took `ns`, of which the calling thread lost `lost`
  void record(int threads, int64_t ns, int64_t lost, int64_t rows = 1) {
    if (!enabled_ || full_ <= 1) return;
    rows = std::max<int64_t>(rows, 1);
    if (trial_ != 0) {
      if (threads == n_ + trial_) trial_time_.add(ns, rows);
      else if (threads == n_) base_time_.add(ns, rows);
      if (--trial_left_ == 0) end_trial();
      return;
    }
    if (threads != n_) return;
    if (n_ > 1) {
      window_.time.add(ns, rows), window_.lost += lost;
      if (++window_.steps >= kWindow && window_.time.ns >= kWindowNs) {
        const bool judged = windows_++ > 0;  // (the first window: a warm-up)
        const double loss = static_cast<double>(window_.lost) / window_.time.ns;
        window_ = Window();
        if (judged && loss > kSure) return one_fewer();
        if (judged && loss > kDrop && skip_ > 0) {
          --skip_;
        } else if (judged && loss > kDrop) {
          return start(-1);
        }
      }
    }
    if (n_ < full_ && ++since_ >= interval_) start(+1);
  }

  int64_t drops = 0, probes = 0, rises = 0;  // probes: trials of either kind

 private:
  struct Time {  // steps' time and rows
    int64_t ns = 0, rows = 0;
    void add(int64_t t, int64_t r) { ns += t, rows += r; }
    bool faster_than(const Time& o, double gain) const {  // less time a row than gain times o's
      return rows > 0 && o.rows > 0 && static_cast<double>(ns) * o.rows < gain * static_cast<double>(o.ns) * rows;
    }
  };
  struct Window {  // the steps at the settled count since the last judgement or trial
    Time time;
    int steps = 0;
    int64_t lost = 0;
  };

  void start(int delta) {
    trial_ = delta, trial_left_ = kProbe, trial_time_ = base_time_ = Time();
    ++probes;
  }

  void one_fewer() { --n_, ++drops, skip_ = 0, skip_next_ = 1, interval_ = kFirstInterval, since_ = 0; }

  void end_trial() {
    if (trial_ < 0) {
      if (trial_time_.faster_than(base_time_, kGain)) {
        one_fewer();
      } else {
        skip_ = skip_next_, skip_next_ = std::min(2 * skip_next_, kMaxSkip);
      }
    } else if (trial_time_.faster_than(base_time_, 1.0)) {
      ++n_, ++rises, interval_ = kFirstInterval;
    } else {
      interval_ = std::min(2 * interval_, kMaxInterval);
    }
    trial_ = 0, since_ = 0, window_ = Window();
  }

  bool enabled_;
  int full_, n_;
  int trial_ = 0;  // during a trial: -1, one thread fewer; +1, one more
  int trial_left_ = 0, skip_ = 0, skip_next_ = 1;
  int64_t windows_ = 0, since_ = 0, interval_ = kFirstInterval;
  Window window_;
  Time trial_time_, base_time_;  // during a trial: its steps on the other count, and on the settled one
};

// A step's time as its Pace hears it: how long it took, and how much of that its calling thread lost, waiting at
// the joins (`waited`) or off its core (another thread, of this process or another, had it)
class Stopwatch {
 public:
  void tell(Pace* pace, int threads, int64_t waited, int64_t rows) const {
    if (pace == nullptr) return;
    const int64_t ns = now_ns() - wall_, off = ns - (thread_cpu_ns() - cpu_);
    pace->record(threads, ns, std::min(ns, waited + std::max<int64_t>(off, 0)), rows);
  }

 private:
  int64_t wall_ = now_ns(), cpu_ = thread_cpu_ns();
};

// body() on the calling thread, inside one parallel region of at::get_num_threads() threads whose kernels'
// mii_team::parallel_for calls are shared out there; body's exception comes out of run. `pace`: told what the
// region's calling thread lost (Stopwatch), in a step of `rows` rows.
template <class Body>
void run(const Body& body, Pace* pace = nullptr, int64_t rows = 1) {
  const int threads = at::get_num_threads();
  const Stopwatch watch;
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
    watch.tell(pace, team.threads, team.waited, rows);
    return;
  }
#endif
  body();
  watch.tell(pace, 1, 0, rows);
}

// body() on the calling thread, each of its kernels' parallel_for calls a region of its own (at::parallel_for: a step
// of many rows, whose kernels may call torch's own, oneDNN's), the calling thread's loss told to `pace`
// (Stopwatch; its waits at those regions' joins summed by parallel_for).
template <class Body>
void timed(const Body& body, Pace* pace, int64_t rows) {
  if (pace == nullptr || join_waits() != nullptr) return body();
  struct Unset {
    ~Unset() { join_waits() = nullptr; }
  };
  const int threads = at::get_num_threads();
  const Stopwatch watch;
  int64_t waits = 0;
  {
    Unset unset;
    join_waits() = &waits;
    body();
  }
  watch.tell(pace, threads, waits, rows);
}

}  // namespace mii_team
