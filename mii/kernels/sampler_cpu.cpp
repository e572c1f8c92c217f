// mii::sample_race: the sampled rows of a step on CPU, one pass over each row's logits instead of ~15 full-vocabulary
// tensor ops (and a full sort for top-p / top-k). It draws exactly what mii/engine/sampler.py's torch path draws:
// the exponential race argmax_v p_v / E_v with E_v = -log(u_v) and u_v the same counter-based hash of (seed, step,
// vocabulary id), written here as argmax_v (s_v - m - log E_v) over s = logits / temperature, m = max s. A token
// can only win when s_v - m + max(-log E) > best (u < 1 - 2^-24 bounds the noise), so the noise is computed
// (vectorized) only for blocks of tokens that could. top-k / top-p keep the most likely tokens: the mass is binned
// by s - m and only the bin where the kept mass (or count) crosses its limit is sorted, instead of the
// vocabulary; min-p drops tokens under min_p x the top probability.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
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

// the largest value -log(E) can take (u = 1 - 2^-24), with a margin for the rounding of the logs
const float kMaxGumbel = -std::log(-std::log(1.0f - 0.5f / 8388608.0f)) + 0.01f;

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

struct Row {
  std::vector<float> s, p, g;
  std::vector<int32_t> bin_tokens;
  std::vector<double> bin_mass;
  std::vector<int32_t> bin_count;
};

// The last token kept by top-k / top-p, as (s, index) in the order (s descending, index ascending): a token is kept
// when it comes no later. Tokens are binned by s - m so that only the bin where the kept mass (or count) crosses
// its limit is sorted.
std::pair<float, int64_t> last_kept(Row& w, int64_t V, float m, int64_t top_k, float top_p) {
  const float* s = w.s.data();
  float* p = w.p.data();
#pragma omp simd
  for (int64_t v = 0; v < V; ++v) p[v] = std::exp(s[v] - m);
  double z = 0.0;
  for (int64_t v = 0; v < V; ++v) z += p[v];
  w.bin_mass.assign(kBins, 0.0);
  w.bin_count.assign(kBins, 0);
  // s - m is finite and <= 0 (sample_row clamps s), but a NaN here must still land in a bin, not outside them
  auto bin = [&](float sv) { const float d = m - sv; return d < kRange ? static_cast<int>(d * (kBins / kRange)) : kBins - 1; };
  for (int64_t v = 0; v < V; ++v) {
    const int b = bin(s[v]);
    w.bin_mass[b] += p[v];
    w.bin_count[b] += 1;
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
    w.bin_tokens.clear();  // the crossing bin: its tokens in order, kept while the mass before stays under top_p
    for (int64_t v = 0; v < V; ++v)
      if (bin(s[v]) == b) w.bin_tokens.push_back(static_cast<int32_t>(v));
    std::sort(w.bin_tokens.begin(), w.bin_tokens.end(),
              [&](int32_t a, int32_t c) { return s[a] > s[c] || (s[a] == s[c] && a < c); });
    int64_t last = w.bin_tokens.front();
    for (const int32_t v : w.bin_tokens) {
      if (rank >= limit || (rank > 0 && before >= top_p)) break;
      last = v;
      before += p[v] / z;
      ++rank;
    }
    return {s[last], last};
  }
  return {kMasked, V};  // not reached: the last bin always decides
}

int64_t sample_row(const float* logits, int64_t V, float temperature, int64_t top_k, float top_p, float min_p,
                   uint32_t h, Row& w) {
  const float t = std::max(temperature, 1e-5f);
  float* s = w.s.data();
  for (int64_t v = 0; v < V; ++v) {
    const float x = logits[v];
    s[v] = x > kMasked ? std::min(x / t, kMaxS) : kMasked;  // also maps NaN to masked, and +inf to kMaxS
  }
  float m = kMasked;
  int64_t arg = 0;
  for (int64_t v = 0; v < V; ++v)
    if (s[v] > m) m = s[v], arg = v;
  if (m <= kMasked) return arg;  // every token masked: nothing to draw from
  // s relative to its max from here on, stored: under -ffast-math `s - m + g` may be computed as `(s + g) - m`,
  // which loses the noise where s is large (a penalty near 0 makes it 1e30). A token 1e30 below the max is masked.
  for (int64_t v = 0; v < V; ++v) s[v] = s[v] > kMasked ? s[v] - m : kMasked;
  m = 0.0f;
  // kept: s > cut_s, or s == cut_s and v <= cut_v (top-k / top-p); and s >= min_s (min-p: p < min_p * p_max out)
  float cut_s = kMasked;
  int64_t cut_v = V;
  if (top_k < V || top_p < 1.0f) std::tie(cut_s, cut_v) = last_kept(w, V, m, top_k, top_p);
  const float min_s = std::max(min_p > 0.0f ? m + std::log(min_p) : kMasked, kMasked);
  auto kept = [&](int64_t v) { return s[v] > kMasked && s[v] >= min_s && (s[v] > cut_s || (s[v] == cut_s && v <= cut_v)); };
  float* g = w.g.data();
  gumbel(h, arg, 1, g);  // the likeliest token first: most others are then ruled out without their noise
  float best = g[0];
  int64_t winner = arg;
  for (int64_t v0 = 0; v0 < V; v0 += kBlock) {
    const int64_t n = std::min(kBlock, V - v0);
    float top = kMasked;
    for (int64_t i = 0; i < n; ++i) top = std::max(top, s[v0 + i]);
    if (top - m + kMaxGumbel <= best) continue;  // no token of the block can win
    gumbel(h, v0, n, g);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t v = v0 + i;
      const float score = s[v] - m + g[i];
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

}  // namespace

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

// logits [S, V] (float), per row: temperature, top_k (long), top_p, min_p, seeds (long), steps (long) -> [S] long
at::Tensor sample_race_cpu(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                           const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& seeds,
                           const at::Tensor& steps) {
  TORCH_CHECK(logits.dim() == 2, "sample_race: logits must be [S, V]");
  const at::Tensor l = logits.to(at::kFloat).contiguous();
  const at::Tensor t = temperature.to(at::kFloat).contiguous(), tp = top_p.to(at::kFloat).contiguous();
  const at::Tensor mp = min_p.to(at::kFloat).contiguous();
  const at::Tensor tk = top_k.to(at::kLong).contiguous(), sd = seeds.to(at::kLong).contiguous();
  const at::Tensor st = steps.to(at::kLong).contiguous();
  const int64_t S = l.size(0), V = l.size(1);
  auto out = at::empty({S}, l.options().dtype(at::kLong));
  const float* lp = l.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, S, 1, [&](int64_t b, int64_t e) {
    Row w;
    w.s.resize(V);
    w.p.resize(V);
    w.g.resize(kBlock);
    for (int64_t r = b; r < e; ++r) {
      const int64_t seed = sd.data_ptr<int64_t>()[r];
      const uint32_t lo = static_cast<uint32_t>(seed), hi = static_cast<uint32_t>(seed >> 32);  // arithmetic shift
      const uint32_t h = mix32(lo ^ mix32(hi) ^ mix32(static_cast<uint32_t>(st.data_ptr<int64_t>()[r] + 0x2545F491LL)));
      op[r] = sample_row(lp + r * V, V, t.data_ptr<float>()[r], tk.data_ptr<int64_t>()[r], tp.data_ptr<float>()[r],
                         mp.data_ptr<float>()[r], h, w);
    }
  });
  return out;
}

TORCH_LIBRARY_IMPL(mii, CPU, m) {
  m.impl("sample_race", &sample_race_cpu);
  m.impl("argmax_rows", &argmax_rows_cpu);
}
