// mii::sample_race: the sampled rows of a step on CPU, one pass over each row's logits instead of ~15 full-vocabulary
// tensor ops (and a full sort for top-p / top-k). It draws exactly what mii/engine/sampler.py's torch path draws:
// the exponential race argmax_v p_v / E_v with E_v = -log(u_v) and u_v the same counter-based hash of (seed, step,
// vocabulary id), written here as argmax_v (s_v - m - log E_v) over s = logits / temperature, m = max s. A block of
// tokens can only hold the winner when its largest s - m plus its largest noise (found from the hash alone) passes
// the best score so far, so the noise is computed (vectorized) only for blocks that could. top-k / top-p keep the
// most likely tokens: the mass is binned by s - m and only the bin where the kept mass (or count) crosses its limit
// is sorted, instead of the vocabulary; min-p drops tokens under min_p x the top probability.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "bf16_vec.h"

namespace {

// the hash of mii/engine/sampler.py's _mix32 (values below 2^32 there, so uint32 arithmetic is the same)
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x346CA68Bu;
  x ^= x >> 16;
  x *= 0x5BD1E995u;
  return x ^ (x >> 13);
}

constexpr float kMasked = -1e30f;  // logits at or below this (masked tokens, -inf) never win
constexpr float kMaxS = 1e30f;     // scaled logits above this (+inf from a penalty near 0) count as this
constexpr int64_t kBlock = 64;     // tokens whose noise is computed together (vectorized)
constexpr int kBins = 2048;        // top-p / top-k: probability mass by bins of s - m over [-kRange, 0]
constexpr float kRange = 64.f;

// -log(E_v) for tokens v0 .. v0+n-1 of a row whose hash is h: the Gumbel form of the exponential race
inline void gumbel(uint32_t h, int64_t v0, int64_t n, float* g) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t x = mix32(h ^ mix32(static_cast<uint32_t>(v0 + i) + 0x61C88647u));
    const float u = (static_cast<float>(x >> 9) + 0.5f) * (1.0f / 8388608.0f);
    g[i] = -std::log(-std::log(u));
  }
}

// the largest `x >> 9` (u's 23 bits) among tokens v0 .. v0+n-1 of a row whose hash is h
inline uint32_t max_u_bits(uint32_t h, int64_t v0, int64_t n) {
  uint32_t top = 0;
#pragma omp simd reduction(max : top)
  for (int64_t i = 0; i < n; ++i)
    top = std::max(top, mix32(h ^ mix32(static_cast<uint32_t>(v0 + i) + 0x61C88647u)) >> 9);
  return top;
}

// -log(E) of the token whose u has these bits (as `gumbel` computes it)
inline float gumbel_of(uint32_t bits) {
  const float u = (static_cast<float>(bits) + 0.5f) * (1.0f / 8388608.0f);
  return -std::log(-std::log(u));
}

constexpr float kSlack = 1e-3f;  // more than the vector and scalar logs can differ by (the noise is below 17)

// One thread's work space for a row of V tokens, kept between calls (sized, never cleared: every use writes first)
struct Row {
  std::vector<float> s, p, g, top, bound;
  std::vector<uint32_t> ubits;
  std::vector<int32_t> bins, bin_tokens;
  std::vector<double> bin_mass;
  std::vector<int32_t> bin_count;

  void fit(int64_t V) {
    if (static_cast<int64_t>(s.size()) >= V) return;
    const int64_t blocks = (V + kBlock - 1) / kBlock;
    s.resize(V), p.resize(V), bins.resize(V), bin_tokens.resize(V + 16);  // + a vector store past the last token
    g.resize(kBlock), top.resize(blocks), bound.resize(blocks), ubits.resize(blocks);
  }
};

constexpr int kWays = 4;  // interleaved histograms: a run of tokens in one bin is 4 chains of adds, not one

// The last token kept by top-k / top-p, as (s, index) in the order (s descending, index ascending): a token is kept
// when it comes no later. s is relative to its max (0). Tokens are binned by s so that only the bin where the kept
// mass (or count) crosses its limit is sorted.
std::pair<float, int64_t> last_kept(Row& w, int64_t V, int64_t top_k, float top_p) {
  const float* s = w.s.data();
  float* p = w.p.data();
  int32_t* bins = w.bins.data();
  double z = 0.0;
#pragma omp simd reduction(+ : z)
  for (int64_t v = 0; v < V; ++v) {
    p[v] = std::exp(s[v]);
    z += p[v];
    // s is finite and <= 0 (sample_row clamps it), but a NaN here must still land in a bin, not outside them
    const float d = -s[v];
    bins[v] = d < kRange ? static_cast<int32_t>(d * (kBins / kRange)) : kBins - 1;
  }
  w.bin_mass.assign(kWays * kBins, 0.0);
  w.bin_count.assign(kWays * kBins, 0);
  double* mass_of = w.bin_mass.data();
  int32_t* count_of = w.bin_count.data();
  int64_t v = 0;
  for (; v + kWays <= V; v += kWays)
    for (int j = 0; j < kWays; ++j) {
      mass_of[j * kBins + bins[v + j]] += p[v + j];
      count_of[j * kBins + bins[v + j]] += 1;
    }
  for (; v < V; ++v) {
    mass_of[bins[v]] += p[v];
    count_of[bins[v]] += 1;
  }
  for (int j = 1; j < kWays; ++j)
    for (int b = 0; b < kBins; ++b) {
      mass_of[b] += mass_of[j * kBins + b];
      count_of[b] += count_of[j * kBins + b];
    }
  const int64_t limit = std::min<int64_t>(std::max<int64_t>(top_k, 1), V);
  double before = 0.0;  // mass of the tokens ranked before, as a fraction of z
  int64_t rank = 0;
  for (int b = 0; b < kBins; ++b) {
    if (!w.bin_count[b]) continue;
    const double mass = w.bin_mass[b] / z;
    if (before + mass < top_p && rank + w.bin_count[b] < limit && b < kBins - 1) {  // the whole bin is kept
      before += mass;
      rank += w.bin_count[b];
      continue;
    }
    // the crossing bin: its tokens in order, kept while the mass before stays under top_p
    int32_t* const tokens = w.bin_tokens.data();
    int64_t k = 0, v = 0;
#if defined(__AVX512F__)
    const __m512i want = _mm512_set1_epi32(b), sixteen = _mm512_set1_epi32(16);
    __m512i ids = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; v + 16 <= V; v += 16, ids = _mm512_add_epi32(ids, sixteen)) {
      const __mmask16 hit = _mm512_cmpeq_epi32_mask(_mm512_loadu_si512(bins + v), want);
      if (hit) {  // compressed in a register, then stored whole (a compressing store is slow on Zen 4)
        _mm512_storeu_si512(tokens + k, _mm512_maskz_compress_epi32(hit, ids));
        k += __builtin_popcount(hit);
      }
    }
#endif
    for (; v < V; ++v)
      if (bins[v] == b) tokens[k++] = static_cast<int32_t>(v);
    std::sort(tokens, tokens + k, [&](int32_t a, int32_t c) { return s[a] > s[c] || (s[a] == s[c] && a < c); });
    int64_t last = tokens[0];
    for (int64_t i = 0; i < k; ++i) {
      if (rank >= limit || (rank > 0 && before >= top_p)) break;
      last = tokens[i];
      before += p[last] / z;
      ++rank;
    }
    return {s[last], last};
  }
  return {kMasked, V};  // not reached: the last bin always decides
}

template <typename T>  // float, or bf16 read as it is (no float copy of the logits)
int64_t sample_row(const T* logits, int64_t V, float temperature, int64_t top_k, float top_p, float min_p,
                   uint32_t h, Row& w) {
  const float t = std::max(temperature, 1e-5f);
  float* s = w.s.data();
  const float rt = 1.0f / t;
#pragma omp simd
  for (int64_t v = 0; v < V; ++v) {
    const float x = static_cast<float>(logits[v]);
    s[v] = x > kMasked ? std::min(x * rt, kMaxS) : kMasked;  // also maps NaN to masked, and +inf to kMaxS
  }
  float m = kMasked;
#pragma omp simd reduction(max : m)
  for (int64_t v = 0; v < V; ++v) m = s[v] > m ? s[v] : m;  // (GCC leaves std::max here scalar)
  if (m <= kMasked) return 0;  // every token masked: nothing to draw from
  int64_t arg = 0;  // the first of the largest
  while (s[arg] != m) ++arg;
  // s relative to its max from here on, stored: under -ffast-math `s - m + g` may be computed as `(s + g) - m`,
  // which loses the noise where s is large (a penalty near 0 makes it 1e30). A token 1e30 below the max is masked.
#pragma omp simd
  for (int64_t v = 0; v < V; ++v) s[v] = s[v] > kMasked ? s[v] - m : kMasked;
  // kept: s > cut_s, or s == cut_s and v <= cut_v (top-k / top-p); and s >= min_s (min-p: p < min_p * p_max out)
  float cut_s = kMasked;
  int64_t cut_v = V;
  if (top_k < V || top_p < 1.0f) std::tie(cut_s, cut_v) = last_kept(w, V, top_k, top_p);
  const float min_s = std::max(min_p > 0.0f ? std::log(min_p) : kMasked, kMasked);
  auto kept = [&](int64_t v) { return s[v] > kMasked && s[v] >= min_s && (s[v] > cut_s || (s[v] == cut_s && v <= cut_v)); };
  // every block's largest s and the bound on its tokens' scores: that s plus the block's largest noise (from its
  // largest u, one log pair per block instead of one per token, the blocks' logs vectorized)
  const int64_t blocks = (V + kBlock - 1) / kBlock;
  float* top = w.top.data();
  float* bound = w.bound.data();
  uint32_t* ubits = w.ubits.data();
  for (int64_t j = 0; j < blocks; ++j) {
    const int64_t v0 = j * kBlock, n = std::min(kBlock, V - v0);
    float most = kMasked;
#pragma omp simd reduction(max : most)
    for (int64_t i = 0; i < n; ++i) most = s[v0 + i] > most ? s[v0 + i] : most;
    top[j] = most;
    ubits[j] = max_u_bits(h, v0, n);
  }
#pragma omp simd
  for (int64_t j = 0; j < blocks; ++j) bound[j] = top[j] + gumbel_of(ubits[j]);
  float* g = w.g.data();
  gumbel(h, arg, 1, g);  // the likeliest token first: most others are then ruled out without their noise
  float best = g[0];
  int64_t winner = arg;
  for (int64_t j = 0; j < blocks; ++j) {
    // no token of the block can win: none is kept (top-k / top-p, min-p), or even its largest noise cannot lift
    // its best one past `best` (kSlack covers the vector and scalar logs' rounding)
    if (top[j] < cut_s || top[j] < min_s || bound[j] + kSlack <= best) continue;
    const int64_t v0 = j * kBlock, n = std::min(kBlock, V - v0);
    gumbel(h, v0, n, g);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t v = v0 + i;
      const float score = s[v] + g[i];
      if ((score > best || (score == best && v < winner)) && kept(v)) best = score, winner = v;
    }
  }
  return winner;
}

// NaN tests on the bits: the kernels are built with -ffast-math, under which std::isnan and unordered compares
// may fold to false
inline bool nan_bits(float a) {
  uint32_t u;
  std::memcpy(&u, &a, 4);
  return (u & 0x7FFFFFFFu) > 0x7F800000u;
}

// The first index of a row's largest value, as torch.argmax picks it (a NaN counts as the largest: the first NaN's
// index). Two passes over the row: its max (and whether it holds a NaN), then the first index holding it.
template <typename T>
int64_t argmax_row(const T* x, int64_t V) {
  int64_t v = 0;
  float m = -INFINITY;
  bool nan = false;
#ifdef MII_BF16_VEC
  if constexpr (std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, float>) {
    const auto load = [&](int64_t i) {
      if constexpr (std::is_same_v<T, float>) return _mm512_loadu_ps(x + i);
      else return mii_vec::bf16_load(x + i);
    };
    const __m512i abs = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
    const auto nans = [&](__m512 a) { return _mm512_cmpgt_epu32_mask(_mm512_and_si512(_mm512_castps_si512(a), abs), inf); };
    __m512 mv = _mm512_set1_ps(-INFINITY);
    __mmask16 any = 0;
    for (; v + 16 <= V; v += 16) {
      const __m512 a = load(v);
      any |= nans(a);
      mv = _mm512_max_ps(mv, a);
    }
    nan = any != 0;
    m = _mm512_reduce_max_ps(mv);
    const int64_t tail = v;
    for (; v < V; ++v) {
      const float a = static_cast<float>(x[v]);
      nan = nan || nan_bits(a);
      m = std::max(m, a);
    }
    const __m512 target = _mm512_set1_ps(m);
    for (v = 0; v < tail; v += 16) {
      const __m512 a = load(v);
      const __mmask16 hit = nan ? nans(a) : _mm512_cmp_ps_mask(a, target, _CMP_EQ_OQ);
      if (hit) return v + __builtin_ctz(hit);
    }
    for (; v < V; ++v) {
      const float a = static_cast<float>(x[v]);
      if (nan ? nan_bits(a) : a == m) return v;
    }
    return 0;  // not reached
  }
#endif
  int64_t arg = 0;
  for (; v < V; ++v) {
    const float a = static_cast<float>(x[v]);
    if (nan_bits(a)) return v;
    if (a > m || v == 0) m = a, arg = v;
  }
  return arg;
}

// One row's log-probabilities: of `target`, and the k largest (value descending, index ascending) into top_v /
// top_i, from x [V] float. Three passes: the max, the sum of exp(x - max) in 8 double lanes, then the k largest by
// a threshold that 16 values at a time are compared with (a block with none above it costs one compare).
void logprobs_row(const float* x, int64_t V, int64_t target, int64_t k, float* chosen, float* top_v, int64_t* top_i) {
  float m = -INFINITY;
#pragma omp simd reduction(max : m)
  for (int64_t v = 0; v < V; ++v) m = x[v] > m ? x[v] : m;
  double z = 0.0;
#pragma omp simd reduction(+ : z)
  for (int64_t v = 0; v < V; ++v) z += std::exp(x[v] - m);
  const float lse = m + static_cast<float>(std::log(z));
  *chosen = x[target] - lse;
  if (k <= 0) return;
  int64_t n = 0;  // entries held (up to k), top_v descending
  const auto offer = [&](int64_t v) {
    const float xv = x[v];
    if (n == k && !(xv > top_v[k - 1])) return;
    int64_t j = n < k ? n++ : k - 1;
    while (j > 0 && xv > top_v[j - 1]) top_v[j] = top_v[j - 1], top_i[j] = top_i[j - 1], --j;
    top_v[j] = xv, top_i[j] = v;
  };
  int64_t v = 0;
  for (; v < V && n < k; ++v) offer(v);
#if defined(__AVX512F__)
  for (; v + 16 <= V; v += 16) {
    __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + v), _mm512_set1_ps(top_v[k - 1]), _CMP_GT_OQ);
    while (hit) {
      offer(v + __builtin_ctz(hit));
      hit &= hit - 1;
    }
  }
#endif
  for (; v < V; ++v) offer(v);
  for (int64_t j = 0; j < n; ++j) top_v[j] -= lse;
}

// A row of V logits as float: itself when it is, else converted into `row`
template <typename T>
const float* as_float(const T* x, int64_t V, std::vector<float>& row) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    row.resize(V);
    float* out = row.data();
#pragma omp simd
    for (int64_t v = 0; v < V; ++v) out[v] = static_cast<float>(x[v]);
    return out;
  }
}

}  // namespace

// logits [N, V] (float, bf16 or fp16), targets [N] long, k -> (chosen [N], top [N, k]) float log-probabilities and the
// top ids [N, k] long: log_softmax's value at each target and its k largest (ties: the lower id first), without the
// [N, V] log_softmax (one row of 49152: ~30 us through torch, and its topk(5) ~85 us)
std::tuple<at::Tensor, at::Tensor, at::Tensor> logprobs_rows_cpu(const at::Tensor& logits, const at::Tensor& targets,
                                                                 int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logprobs_rows: logits must be [N, V] with V > 0");
  const at::Tensor l = logits.contiguous(), t = targets.to(at::kLong).contiguous();
  const int64_t N = l.size(0), V = l.size(1);
  TORCH_CHECK(t.dim() == 1 && t.size(0) == N, "logprobs_rows: targets must be [N]");
  TORCH_CHECK(k >= 0 && k <= V, "logprobs_rows: k must be in [0, V]");
  const int64_t* tp = t.data_ptr<int64_t>();
  for (int64_t r = 0; r < N; ++r) TORCH_CHECK(tp[r] >= 0 && tp[r] < V, "logprobs_rows: a target is outside [0, V)");
  auto chosen = at::empty({N}, l.options().dtype(at::kFloat));
  auto top = at::empty({N, k}, l.options().dtype(at::kFloat));
  auto ids = at::empty({N, k}, l.options().dtype(at::kLong));
  float* cp = chosen.data_ptr<float>();
  float* vp = top.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, l.scalar_type(), "logprobs_rows", [&] {
    const scalar_t* lp = l.data_ptr<scalar_t>();
    at::parallel_for(0, N, 1, [&](int64_t b, int64_t e) {
      thread_local std::vector<float> row;
      for (int64_t r = b; r < e; ++r)
        logprobs_row(as_float(lp + r * V, V, row), V, tp[r], k, cp + r, vp + r * k, ip + r * k);
    });
  });
  return {chosen, top, ids};
}

// logits [S, V] (float, bf16 or fp16) -> [S] long: torch.argmax(logits, -1), without the float copy of bf16 logits
// or TensorIterator's reduction (1 x 49152 bf16: ~180 us through torch, ~90 as float()+argmax)
at::Tensor argmax_rows_cpu(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "argmax_rows: logits must be [S, V] with V > 0");
  const at::Tensor l = logits.contiguous();
  const int64_t S = l.size(0), V = l.size(1);
  auto out = at::empty({S}, l.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, l.scalar_type(), "argmax_rows", [&] {
    const scalar_t* lp = l.data_ptr<scalar_t>();
    at::parallel_for(0, S, 4, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) op[r] = argmax_row(lp + r * V, V);
    });
  });
  return out;
}

// logits [S, V] (float or bf16, others as float), per row: temperature, top_k (long), top_p, min_p, seeds (long),
// steps (long) -> [S] long
at::Tensor sample_race_cpu(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                           const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& seeds,
                           const at::Tensor& steps) {
  TORCH_CHECK(logits.dim() == 2, "sample_race: logits must be [S, V]");
  const bool bf16 = logits.scalar_type() == at::kBFloat16;
  const at::Tensor l = bf16 ? logits.contiguous() : logits.to(at::kFloat).contiguous();
  const at::Tensor t = temperature.to(at::kFloat).contiguous(), tp = top_p.to(at::kFloat).contiguous();
  const at::Tensor mp = min_p.to(at::kFloat).contiguous();
  const at::Tensor tk = top_k.to(at::kLong).contiguous(), sd = seeds.to(at::kLong).contiguous();
  const at::Tensor st = steps.to(at::kLong).contiguous();
  const int64_t S = l.size(0), V = l.size(1);
  auto out = at::empty({S}, l.options().dtype(at::kLong));
  const float* lp = bf16 ? nullptr : l.data_ptr<float>();
  const c10::BFloat16* lb = bf16 ? l.data_ptr<c10::BFloat16>() : nullptr;
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, S, 1, [&](int64_t b, int64_t e) {
    thread_local Row w;
    w.fit(V);
    for (int64_t r = b; r < e; ++r) {
      const int64_t seed = sd.data_ptr<int64_t>()[r];
      const uint32_t lo = static_cast<uint32_t>(seed), hi = static_cast<uint32_t>(seed >> 32);  // arithmetic shift
      const uint32_t h = mix32(lo ^ mix32(hi) ^ mix32(static_cast<uint32_t>(st.data_ptr<int64_t>()[r] + 0x2545F491LL)));
      const float temp = t.data_ptr<float>()[r], top_p_r = tp.data_ptr<float>()[r], min_p_r = mp.data_ptr<float>()[r];
      const int64_t top_k_r = tk.data_ptr<int64_t>()[r];
      op[r] = bf16 ? sample_row(lb + r * V, V, temp, top_k_r, top_p_r, min_p_r, h, w)
                   : sample_row(lp + r * V, V, temp, top_k_r, top_p_r, min_p_r, h, w);
    }
  });
  return out;
}

// A penalized logit computed as torch computes it (a true division, no fused multiply-add): the file is built with
// -ffast-math, which would turn x / k into x * (1 / k) and fuse the subtractions.
__attribute__((optimize("no-fast-math"), noinline)) float repeated(float x, float k) {
  return x > 0 ? std::min(x / k, FLT_MAX) : x * k;
}
__attribute__((optimize("no-fast-math", "fp-contract=off"), noinline)) float counted(float x, float f, float n,
                                                                                      float p) {
  return x - f * n - p;
}

// logits [S, V] float, in place; per row: rep, presence, frequency; prompt_ids [S, P] and output_ids [S, O] (long,
// -1 padding). vLLM's repetition penalty once on every distinct id of the prompt and the output (a positive logit
// divided by it, up to the largest float; the others multiplied), then OpenAI's frequency (× the id's count in the
// output) and presence penalties subtracted: what sampler.py's dense form computes, O(ids) per row, not O(V).
void penalize_cpu(at::Tensor& logits, const at::Tensor& rep, const at::Tensor& presence, const at::Tensor& frequency,
                  const at::Tensor& prompt_ids, const at::Tensor& output_ids) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "penalize_: logits must be contiguous float [S, V]");
  const int64_t S = logits.size(0), V = logits.size(1);
  TORCH_CHECK(prompt_ids.dim() == 2 && output_ids.dim() == 2 && prompt_ids.size(0) == S && output_ids.size(0) == S,
              "penalize_: ids must be [S, n]");
  const at::Tensor rp = rep.to(at::kFloat).contiguous(), pp = presence.to(at::kFloat).contiguous();
  const at::Tensor fp = frequency.to(at::kFloat).contiguous();
  const at::Tensor pi = prompt_ids.to(at::kLong).contiguous(), oi = output_ids.to(at::kLong).contiguous();
  const int64_t P = pi.size(1), O = oi.size(1);
  float* const lp = logits.data_ptr<float>();
  at::parallel_for(0, S, 1, [&](int64_t b, int64_t e) {
    thread_local std::vector<int32_t> count;  // per id: its count in the output (back to 0 after each row)
    thread_local std::vector<uint8_t> seen;   // per id: penalized already in this row (likewise)
    if (static_cast<int64_t>(count.size()) < V) count.assign(V, 0), seen.assign(V, 0);
    for (int64_t r = b; r < e; ++r) {
      float* const l = lp + r * V;
      const int64_t* const prompt = pi.data_ptr<int64_t>() + r * P;
      const int64_t* const output = oi.data_ptr<int64_t>() + r * O;
      const float k = rp.data_ptr<float>()[r], f = fp.data_ptr<float>()[r], pr = pp.data_ptr<float>()[r];
      const auto repeat = [&](int64_t id) {
        if (id < 0 || id >= V || seen[id]) return;
        seen[id] = 1;
        l[id] = repeated(l[id], k);
      };
      for (int64_t i = 0; i < P; ++i) repeat(prompt[i]);
      for (int64_t i = 0; i < O; ++i) repeat(output[i]);
      for (int64_t i = 0; i < O; ++i)
        if (output[i] >= 0 && output[i] < V) ++count[output[i]];
      for (int64_t i = 0; i < O; ++i) {
        const int64_t id = output[i];
        if (id < 0 || id >= V || !count[id]) continue;
        l[id] = counted(l[id], f, static_cast<float>(count[id]), pr);
        count[id] = 0;
      }
      for (int64_t i = 0; i < P; ++i)
        if (prompt[i] >= 0 && prompt[i] < V) seen[prompt[i]] = 0;
      for (int64_t i = 0; i < O; ++i)
        if (output[i] >= 0 && output[i] < V) seen[output[i]] = 0;
    }
  });
}

TORCH_LIBRARY_IMPL(mii, CPU, m) {
  m.impl("sample_race", &sample_race_cpu);
  m.impl("argmax_rows", &argmax_rows_cpu);
  m.impl("penalize_", &penalize_cpu);
  m.impl("logprobs_rows", &logprobs_rows_cpu);
}
