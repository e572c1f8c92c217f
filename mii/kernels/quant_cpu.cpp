// y = x @ dequantize(w).T + bias for weight-only quantized w: mii::linear_quant. The layouts are
// mii/layers/quant.py's: a pair of output rows at a time, group after group, each group led by its fp16 scales
// (int4 also offsets), so the whole matrix is one sequential stream.
// - Up to kGemvRows rows of x (decode; up to 8 on CPUs with the tiles below): x is rounded to int16 per 32 columns (scale = max |x| / 32767, an error
//   under 2^-15 of the chunk's largest value: far below bf16's 2^-9), so that the weights are multiplied as
//   integers: `vpmaddwd` does 16 multiply-adds in one instruction where widening every weight to fp32 takes three
//   instructions per 8. int4: one mask and one shift give a row pair's 64 nibbles as bytes (row a in the low 128
//   bits, row b in the high, as GGUF stores them: byte b is column b and column b + 16), and byte-to-int16
//   unpacks feed `vpmaddwd` against x's 8 columns repeated twice; int8: 16 columns of a row per sign-extending
//   load. Each chunk's int32 sums are scaled once (x's scale, then the group's weight scale), and int4's offsets
//   add m * sum(x) per group. On CPUs with AVX-512 VNNI, int4 takes `vpdpbusd` instead, on the nibbles as they are
//   against x's bytes (int4_rows_pairs): the same exact integers with no unpacking, 1.1-1.2x at one row.
// - `act8` (int4 only, opt-in: `quantize_activations`): x rounded to int8 instead (scale = max |x| / 127), as
//   llama.cpp's Q8 activations for its 4-bit dot products, so that `vpmaddubsw` multiplies 32 unsigned nibbles by
//   32 signed bytes in one instruction (x's columns 0-15 and 16-31 each repeated twice). Faster, but an error up
//   to 1/254 of the chunk's largest |x|: results are close, no longer exact, and a row's result can move with
//   fp32-level differences upstream (its batch), where 16-bit rounding keeps them below bf16's precision.
// - More rows (prompt chunks, big batches; from 9 rows on CPUs with AVX-512 VNNI and VBMI): 16-row tiles of the weights'
//   integers unpacked into L2, one `vdpbf16ps` (bf16 x) or `vpdpwssd` (x rounded as above) a 16-row pair of
//   columns, or with `act8` one `vpdpbusd` a 16-row quad of columns: see vnni_gemm below. Elsewhere each task
//   dequantizes a block of rows into an fp32 buffer that stays in cache and multiplies it with ATen's fp32 GEMM, x
//   rounded the same way first. Either way a row's result does not depend on how many rows share its step beyond
//   fp32 summation order and, for bf16 x, the int16 rounding of decode rows (batch invariance, prefix caching:
//   differences far below the bf16 result's own rounding).
// - 5-16 rows of bf16 x on CPUs with AVX512-BF16 (decode steps of 5-16 streams, short prompts; not act8): the
//   tiles' arithmetic, bit for bit, each 16-row tile's chunk unpacked in registers and taken by every row at once
//   (rows_tile), where the decode kernels cost a row's share each; not where AMX runs.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include "bf16_vec.h"
#define MII_QAVX2 1
#endif
#include "team.h"
#if defined(MII_QAVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define MII_QVNNI 1  // vpdpwssd: 32 int16 multiply-adds into 16 int32 sums an instruction
#endif
#if defined(MII_QVNNI) && defined(__AVX512BF16__)
#define MII_QBF16 1  // vdpbf16ps: 32 bf16 multiply-adds into 16 fp32 sums an instruction
#endif

// linear_cpu.cpp's: x as the kernels read it, and y with bias in x's dtype and shape
at::Tensor linear_input(const at::Tensor& x, int64_t K);
at::Tensor linear_output(at::Tensor y, const at::Tensor& x, const c10::optional<at::Tensor>& bias);

namespace {

constexpr int64_t kGemvRows = 32;    // rows of x handled by the streaming kernel; more go through blocked GEMM
constexpr int64_t kGemmPairs = 64;   // row pairs dequantized at a time for the GEMM path
constexpr int64_t kPrefetch = 1024;  // bytes ahead
// more rows of x than this take the tiles rather than the streaming kernel. Measured on a Zen 4 EPYC, 2 threads,
// bf16 x: even at 8 rows, ahead from 12 (`[3072, 576]` 16 rows 562-688 → 305-495 µs, 32 rows 1,467-1,531 → 580-629;
// the int8 LM head `[49152, 576]` 32 rows 14.0-15.1 → 7.6-8.8 ms); behind at 4 (the weights are unpacked for few rows)
constexpr int64_t kTileMinRows = 9;
// rows_tile takes 5-16 rows of bf16 x. Measured on a Zen 4 EPYC (2 threads, weights streamed, alternated in one
// process): a decode step's 120 int4 linears against the decode kernel at 4 rows 1.00-1.15x, 5 rows 1.01-1.10x, 6
// rows 1.03-1.07x, 7 rows 1.27-1.41x, 8 rows 1.38-1.52x, and against the tiles (vnni_gemm's bf16_tiles: the same
// arithmetic in the same order) at 9 rows 1.25x, 10 rows 1.18x, 12 rows 1.19x, 14 rows 1.12x, 16 rows 1.08x; the int8
// LM head [49152, 576] at 5 / 6 / 8 / 12 / 16 rows 1.02 / 1.16 / 1.32 / 1.17 / 1.10x (4 rows 0.99x).
constexpr int64_t kRowsTileMinRows = 5, kRowsTileMaxRows = 16;

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

struct Layout {
  bool int4;
  int64_t pairs, groups, G, block;  // block: bytes per (pair, group)
  int64_t N() const { return pairs * 2; }
  int64_t K() const { return groups * G; }
};

Layout layout_of(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 3 && (w.scalar_type() == at::kByte || w.scalar_type() == at::kChar),
              "linear_quant: the weight must be packed int4 (uint8 [N/2, K/G, 8 + G]) or int8 (int8 [N/2, K/G, 8 + 2G])");
  const bool int4 = w.scalar_type() == at::kByte;
  const int64_t block = w.size(2), G = int4 ? block - 8 : (block - 8) / 2;
  TORCH_CHECK(G > 0 && G % 32 == 0 && (int4 || block == 8 + 2 * G), "linear_quant: bad group size in the layout");
  return {int4, w.size(0), w.size(1), G, block};
}

// --- one weight element, for CPUs without AVX2 (where every row count takes the GEMM path) -----------------------

// scale * q rounded before the offset is added (no fused multiply-add), as mii/layers/quant.py's dequantize
inline float int4_weight(const uint8_t* blk, int64_t G, int row, int64_t col) {
  const float s = half_to_float(blk + 2 * row), m = half_to_float(blk + 4 + 2 * row);
  const uint8_t byte = blk[8 + (col / 32) * 32 + row * 16 + col % 16];
  const int q = (col % 32 >= 16) ? byte >> 4 : byte & 15;
  const volatile float scaled = s * static_cast<float>(q);
  return scaled + m;
}

inline float int8_weight(const uint8_t* blk, int64_t G, int row, int64_t col) {
  const float s = half_to_float(blk + 2 * row);
  return s * static_cast<float>(reinterpret_cast<const int8_t*>(blk + 8 + row * G)[col]);
}

// x's chunk of 32 columns rounded to int16 (int8 weights) or int8 (int4 weights): v = round(x * (1 / s)) with
// s = max |x| * (1 / 32767) or (1 / 127); returns s. mii/layers/quant.py's round_activations is the same
// arithmetic, operation for operation, so the reference rounds exactly as the kernel does.
template <typename Q>
inline float round_chunk(const float* xc, Q* v) {
  constexpr float kInvMax = std::is_same_v<Q, int8_t> ? 1.f / 127.f : 1.f / 32767.f;
  float amax = 0.f;
  for (int k = 0; k < 32; ++k) amax = std::max(amax, std::abs(xc[k]));
  const float s = amax > 0.f ? amax * kInvMax : 1.f, inv = 1.f / s;
  for (int k = 0; k < 32; ++k) v[k] = static_cast<Q>(std::nearbyint(xc[k] * inv));
  return s;
}

// x as the decode path sees it (every chunk rounded, times its scale), for the GEMM path: a row's result then
// does not depend on how many rows share its step (up to the GEMM's fp32 summation order)
template <typename Q>
at::Tensor round_x(const at::Tensor& x) {
  auto out = at::empty_like(x);
  const float* src = x.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t chunks = x.numel() / 32;
  mii_team::parallel_for(0, chunks, 256, [&](int64_t b, int64_t e) {
    Q v[32];
    for (int64_t c = b; c < e; ++c) {
      const float s = round_chunk(src + c * 32, v);
      for (int k = 0; k < 32; ++k) dst[c * 32 + k] = static_cast<float>(v[k]) * s;
    }
  });
  return out;
}

// rows of pairs p0 .. p0+count-1 -> row-major fp32 [2 * count, K]
void dequant_pairs(const uint8_t* w, const Layout& L, int64_t p0, int64_t count, float* dst) {
  const int64_t K = L.K();
  for (int64_t p = p0; p < p0 + count; ++p) {
    for (int64_t g = 0; g < L.groups; ++g) {
      const uint8_t* blk = w + (p * L.groups + g) * L.block;
      for (int row = 0; row < 2; ++row) {
        float* out = dst + ((p - p0) * 2 + row) * K + g * L.G;
#ifdef MII_QAVX2
        const __m256 s = _mm256_set1_ps(half_to_float(blk + 2 * row));
        if (L.int4) {
          const __m256 m = _mm256_set1_ps(half_to_float(blk + 4 + 2 * row));
          for (int64_t c = 0; c < L.G / 32; ++c) {
            const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 8 + c * 32 + row * 16));
            const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(15)), hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
            const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};  // columns 0, 8, 16, 24
            for (int j = 0; j < 4; ++j)
              _mm256_storeu_ps(out + c * 32 + 8 * j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j])), s, m));
          }
        } else {
          const int8_t* q = reinterpret_cast<const int8_t*>(blk + 8 + row * L.G);
          for (int64_t k = 0; k < L.G; k += 8) {
            const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k))));
            _mm256_storeu_ps(out + k, _mm256_mul_ps(v, s));
          }
        }
#else
        for (int64_t k = 0; k < L.G; ++k)
          out[k] = L.int4 ? int4_weight(blk, L.G, row, k) : int8_weight(blk, L.G, row, k);
#endif
      }
    }
  }
}

#ifdef MII_QAVX2
inline float hsum128(__m128 s) {
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}


// x rounded per chunk of 32 columns: `scale` per (row, chunk); `q` per (row, chunk) — int4 (Q = int8_t): 64
// bytes, columns 0-15 twice then 16-31 twice (the two rows of a weight pair sit in the two 128-bit halves); int8
// (Q = int16_t): columns 0-31. `gsum` per (row, weight group): the sum of the rounded x over the group / 4 (int4's
// offsets, added in 4 lanes a row; the rounded x, as the GEMM path multiplies the offsets with).
template <typename Q, bool kInt4 = std::is_same_v<Q, int8_t>>
struct XQ {
  static constexpr int64_t kStride = kInt4 ? 64 : 32;
  static constexpr int kRun = std::is_same_v<Q, int8_t> ? 16 : 8;  // columns in a run repeated twice (int4)
  std::vector<Q> q;
  std::vector<float> scale, gsum;
  int64_t chunks, groups;
  XQ(const float* x, int64_t M, int64_t K, int64_t G) : chunks(K / 32), groups(K / G) {
    q.resize(M * chunks * kStride);
    scale.resize(M * chunks);
    gsum.assign(M * groups, 0.f);
    const int64_t per_group = G / 32;
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t c = 0; c < chunks; ++c) {
        Q v[32];
        const float s = round_chunk(x + m * K + c * 32, v);
        int32_t vsum = 0;  // exact
        for (int k = 0; k < 32; ++k) vsum += v[k];
        gsum[m * groups + c / per_group] += static_cast<float>(vsum) * s * 0.25f;
        Q* out = &q[(m * chunks + c) * kStride];
        if constexpr (kStride == 64) {
          for (int h = 0; h < 64 / kRun; ++h) std::memcpy(out + h * kRun, v + (h / 2) * kRun, kRun * sizeof(Q));
        } else {
          std::memcpy(out, v, sizeof(v));
        }
        scale[m * chunks + c] = s;
      }
    }
  }
  const Q* at(int64_t m, int64_t chunk) const { return &q[(m * chunks + chunk) * kStride]; }
};

// A chunk of a row pair's int4 weights (32 bytes: 64 nibbles) against 32 columns of one row of x, as 8 int32
// lanes (row a's partial sums in the low 4, row b's in the high). With x in int8 (`act8`), `vpmaddubsw` takes the
// nibbles as they are: |nibble * x| <= 15 * 127, so a pair's sum and the two halves' fit int16 (no saturation).
struct Nibbles8 {
  __m256i lo, hi;
  Nibbles8(__m256i l, __m256i h) : lo(l), hi(h) {}
  __m256i dot(const int8_t* q) const {
    const __m256i prod = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))),
                                          _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32))));
    return _mm256_madd_epi16(prod, _mm256_set1_epi16(1));
  }
};
// With x in int16, the nibbles widened to int16 once per chunk (shared by the rows of x) for `vpmaddwd`.
struct Nibbles16 {
  __m256i w[4];
  Nibbles16(__m256i lo, __m256i hi) {
    const __m256i zero = _mm256_setzero_si256();
    w[0] = _mm256_unpacklo_epi8(lo, zero), w[1] = _mm256_unpackhi_epi8(lo, zero);
    w[2] = _mm256_unpacklo_epi8(hi, zero), w[3] = _mm256_unpackhi_epi8(hi, zero);
  }
  __m256i dot(const int16_t* x) const {
    const __m256i* q = reinterpret_cast<const __m256i*>(x);
    return _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(w[0], _mm256_loadu_si256(q)),
                                             _mm256_madd_epi16(w[1], _mm256_loadu_si256(q + 1))),
                            _mm256_add_epi32(_mm256_madd_epi16(w[2], _mm256_loadu_si256(q + 2)),
                                             _mm256_madd_epi16(w[3], _mm256_loadu_si256(q + 3))));
  }
};

// R rows of x (R <= 4), rounded to Q (int16, or int8 with `act8`), against row pair p: y[m, 2p], y[m, 2p + 1].
// Consecutive groups alternate between two sets of accumulators, and the offsets have their own: a single chain
// of dependent FMAs (4 cycles each) would otherwise set the pace of a single row, not the instructions (1.2x on a
// decode step's linears). The rows' data sit in locals: through X the compiler reloads them every chunk.
template <int R, typename Q>
inline void int4_pair(const uint8_t* pw, const Layout& L, const XQ<Q, true>& X, int64_t m0, float* y, int64_t N,
                      int64_t p) {
  using Nibbles = std::conditional_t<std::is_same_v<Q, int8_t>, Nibbles8, Nibbles16>;
  const __m256i low4 = _mm256_set1_epi8(15);
  const __m256i s_idx = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), m_idx = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
  const int64_t cpg = L.G / 32, groups = L.groups, block = L.block;  // cpg: chunks per group
  const Q* xq[R];
  const float *xs[R], *gs[R];
  for (int r = 0; r < R; ++r)
    xq[r] = X.at(m0 + r, 0), xs[r] = &X.scale[(m0 + r) * X.chunks], gs[r] = &X.gsum[(m0 + r) * groups];
  __m256 tot[2][R], off[2][R];
  for (int j = 0; j < 2; ++j)
    for (int r = 0; r < R; ++r) tot[j][r] = off[j][r] = _mm256_setzero_ps();
  for (int64_t g0 = 0; g0 < groups; g0 += 2) {
#pragma GCC unroll 2
    for (int j = 0; j < 2; ++j) {
      const int64_t g = g0 + j;
      if (g >= groups) break;
      const uint8_t* blk = pw + g * block;
      _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetch), _MM_HINT_T0);
      // s_a s_b m_a m_b -> [s_a x4, s_b x4] and [m_a x4, m_b x4]
      const __m256 h = _mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk))));
      const __m256 sv = _mm256_permutevar8x32_ps(h, s_idx), mv = _mm256_permutevar8x32_ps(h, m_idx);
      for (int64_t c = 0; c < cpg; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 8 + c * 32));
        const Nibbles w(_mm256_and_si256(v, low4), _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
        const int64_t chunk = g * cpg + c;
        for (int r = 0; r < R; ++r)  // x's scale times the group's weight scales, then one FMA into the total
          tot[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(w.dot(xq[r] + chunk * 64)),
                                      _mm256_mul_ps(sv, _mm256_set1_ps(xs[r][chunk])), tot[j][r]);
      }
      for (int r = 0; r < R; ++r) off[j][r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(gs[r][g]), off[j][r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256 sum = _mm256_add_ps(_mm256_add_ps(tot[0][r], tot[1][r]), _mm256_add_ps(off[0][r], off[1][r]));
    y[(m0 + r) * N + 2 * p] = hsum128(_mm256_castps256_ps128(sum));
    y[(m0 + r) * N + 2 * p + 1] = hsum128(_mm256_extractf128_ps(sum, 1));
  }
}

inline __m256i widen16(const int8_t* q) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
}

template <int R>
inline void int8_pair(const uint8_t* pw, const Layout& L, const XQ<int16_t>& X, int64_t m0, float* y, int64_t N, int64_t p) {
  const int64_t cpg = L.G / 32;
  __m256 ta[R], tb[R];
  for (int r = 0; r < R; ++r) ta[r] = tb[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < L.groups; ++g) {
    const uint8_t* blk = pw + g * L.block;
    const float sa = half_to_float(blk), sb = half_to_float(blk + 2);
    const int8_t* qa = reinterpret_cast<const int8_t*>(blk + 8);
    const int8_t* qb = qa + L.G;
    for (int64_t c = 0; c < cpg; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(qa + c * 32 + kPrefetch), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(qb + c * 32 + kPrefetch), _MM_HINT_T0);
      const __m256i a0 = widen16(qa + c * 32), a1 = widen16(qa + c * 32 + 16);
      const __m256i b0 = widen16(qb + c * 32), b1 = widen16(qb + c * 32 + 16);
      const int64_t chunk = g * cpg + c;
      for (int r = 0; r < R; ++r) {
        const int16_t* xq = X.at(m0 + r, chunk);
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16));
        const __m256i ia = _mm256_add_epi32(_mm256_madd_epi16(a0, x0), _mm256_madd_epi16(a1, x1));
        const __m256i ib = _mm256_add_epi32(_mm256_madd_epi16(b0, x0), _mm256_madd_epi16(b1, x1));
        const float sx = X.scale[(m0 + r) * X.chunks + chunk];
        ta[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), _mm256_set1_ps(sx * sa), ta[r]);
        tb[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ib), _mm256_set1_ps(sx * sb), tb[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    y[(m0 + r) * N + 2 * p] = hsum128(_mm_add_ps(_mm256_castps256_ps128(ta[r]), _mm256_extractf128_ps(ta[r], 1)));
    y[(m0 + r) * N + 2 * p + 1] = hsum128(_mm_add_ps(_mm256_castps256_ps128(tb[r]), _mm256_extractf128_ps(tb[r], 1)));
  }
}

template <class F>
inline void by_quads(int64_t M, F&& f) {  // f(m0, R) over rows of x in groups of up to 4
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) f(m, 4);
  if (M - m) f(m, static_cast<int>(M - m));
}

// every row pair's rows of y, in tasks of about 64 KB of weights: pair(R, pw, m0, p) computes rows m0 .. m0+R-1
// of pair p, R (1-4) a std::integral_constant, so that each row count is its own instantiation
template <class Pair>
void for_pairs(const uint8_t* w, int64_t M, const Layout& L, Pair&& pair) {
  const int64_t pair_bytes = L.groups * L.block;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(pair_bytes, 1));
  mii_team::parallel_for(0, L.pairs, grain, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) {
      const uint8_t* pw = w + p * pair_bytes;
      by_quads(M, [&](int64_t m0, int R) {
        switch (R) {
          case 4: pair(std::integral_constant<int, 4>{}, pw, m0, p); break;
          case 3: pair(std::integral_constant<int, 3>{}, pw, m0, p); break;
          case 2: pair(std::integral_constant<int, 2>{}, pw, m0, p); break;
          default: pair(std::integral_constant<int, 1>{}, pw, m0, p);
        }
      });
    }
  });
}

#ifdef MII_QVNNI
// --- int4 decode rows on CPUs with AVX-512 VNNI: the nibbles against x's bytes, no unpacking -----------------------
// x rounded per chunk as above. A 16-bit x is split into its low byte (unsigned) and high byte (signed), x = 256 hi
// + lo, so that nibble * x = nibble * lo + 256 * nibble * hi: each half is a `vpdpbusd` (64 products of unsigned by
// signed bytes, 4 into each of 16 int32 lanes) on the nibbles as they are, with the high half's sums shifted by 8
// before the low half's are added. A chunk's int32 sums are the exact integers `vpmaddwd` gives, in other lanes;
// `act8`'s int8 x needs one `vpdpbusd` a nibble vector. Two chunks a 512-bit vector: chunk c of the row pair in the
// low 256 bits (row a's 16 bytes, then row b's), chunk c + 1 in the high.

// tied accumulator (GCC 12's pattern for _mm512_dpbusd_epi32 copies it, as for vpdpwssd below); u: unsigned bytes
inline void dot_bytes(__m512i& acc, __m512i u, __m512i s) { __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "vm"(s)); }

// x per row and pair of chunks (2p, 2p + 1; the second zero past the last chunk): kVecs vectors of 64 bytes, each
// columns 0-15 (or 16-31) of chunk 2p twice, then of chunk 2p + 1 twice (the two rows of a weight pair): int16 x's
// low bytes of columns 0-15, of 16-31, then its high bytes of 0-15, of 16-31; act8: the int8 x of 0-15, of 16-31.
// scale: x's scale, 8 lanes a chunk; sum: the chunk's sum of the rounded x times its scale / 4 (int4's offsets,
// added in 4 lanes a row).
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const at::BFloat16* x) { return mii_vec::bf16_load(x); }

// n elements of this thread's buffer `slot`, kept from call to call and not cleared (XPairs writes every element it
// reads: its arrays were vectors, zeroed as they were allocated, for a W64 prompt step's x a serial memset of a few
// MB a linear, 2.5% of W64's samples on a Zen 4 EPYC). One user of a buffer at a time: each linear_quant call builds
// one XBytes, XBytes16 or XPairs and drops it before returning.
template <typename V, int slot>
V* reused(int64_t n) {
  static thread_local std::vector<V> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

template <bool kAct8>
struct XBytes {
  static constexpr int kVecs = kAct8 ? 2 : 4;
  int64_t cpairs;
  __m512i* q;
  __m512 *scale, *sum;
  template <typename T>  // float, or bf16 (widened exactly: the same values as its fp32 copy)
  XBytes(const T* x, int64_t M, int64_t K)
      : cpairs((K / 32 + 1) / 2), q(reused<__m512i, 0>(M * cpairs * kVecs)),
        scale(reused<__m512, 0>(M * cpairs)), sum(reused<__m512, 1>(M * cpairs)) {
    constexpr float kInvMax = kAct8 ? 1.f / 127.f : 1.f / 32767.f;
    const __m512 sign = _mm512_set1_ps(-0.f);
    for (int64_t m = 0; m < M; ++m) {
      // every chunk's half of the buffers is written below; an odd last chunk's pair has a second half, zero (no
      // memset of the whole: these buffers are rebuilt for each of a decode step's 120 linears, in cold caches)
      if ((K / 32) % 2) {
        const int64_t last = m * cpairs + cpairs - 1;
        for (int j = 0; j < kVecs; ++j) q[last * kVecs + j] = _mm512_setzero_si512();
        scale[last] = sum[last] = _mm512_setzero_ps();
      }
      for (int64_t c = 0; c < K / 32; ++c) {
        // round_chunk's arithmetic in vectors: the same amax, s, inv and products; cvtps rounds half to even
        // (nearbyint under the default rounding mode); the int16/int8 values fit, so their low bytes are theirs
        const T* xc = x + m * K + c * 32;
        const __m512 x0 = load16(xc), x1 = load16(xc + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, x0), _mm512_andnot_ps(sign, x1)));
        const float s = amax > 0.f ? amax * kInvMax : 1.f, inv = 1.f / s;
        const __m512i v0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(inv)));
        const __m512i v1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(inv)));
        const int32_t vsum = _mm512_reduce_add_epi32(_mm512_add_epi32(v0, v1));  // exact
        const int64_t at = m * cpairs + c / 2, half = c % 2;
        auto* out = reinterpret_cast<uint8_t*>(&q[at * kVecs]) + half * 32;
        for (int j = 0; j < kVecs; ++j, out += 64) {  // vectors 2 and 3: the high bytes of int16 x
          const __m512i cols = j % 2 ? v1 : v0;
          const __m128i b = _mm512_cvtepi32_epi8(j / 2 ? _mm512_srai_epi32(cols, 8) : cols);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_broadcastsi128_si256(b));
        }
        _mm256_storeu_ps(reinterpret_cast<float*>(&scale[at]) + half * 8, _mm256_set1_ps(s));
        _mm256_storeu_ps(reinterpret_cast<float*>(&sum[at]) + half * 8,
                         _mm256_set1_ps(static_cast<float>(vsum) * s * 0.25f));
      }
    }
  }
};

// a row pair's stream chunk by chunk: where the chunk's group header starts (head) and its data (int4: row a's 16
// bytes, then row b's; int8: row a's 32 bytes, row b's G further on)
struct ChunkWalk {
  int64_t cpg, block, head = 0, in = 0;
  explicit ChunkWalk(const Layout& L) : cpg(L.G / 32), block(L.block) {}
  int64_t data() const { return head + 8 + in * 32; }
  void next() {
    if (++in == cpg) in = 0, head += block;
  }
};

inline __m512i load_halves(const uint8_t* a, const uint8_t* b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}

// the headers [s_a s_b m_a m_b] of two chunks' groups -> each row's and chunk's scale (sv) and offset (mv), 4 lanes each
inline void pair_scales(const uint8_t* h0, const uint8_t* h1, __m512& sv, __m512& mv) {
  const __m512i s_idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 4, 4, 4, 4, 5, 5, 5, 5);
  const __m512i m_idx = _mm512_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3, 6, 6, 6, 6, 7, 7, 7, 7);
  const __m128i hh = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(h0)),
                                        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(h1)));
  const __m512 hf = _mm512_castps256_ps512(_mm256_cvtph_ps(hh));
  sv = _mm512_permutexvar_ps(s_idx, hf), mv = _mm512_permutexvar_ps(m_idx, hf);
}

// two chunks' nibbles (lo: columns 0-15, hi: 16-31) against x's bytes (XBytes' vectors): the exact int32 sums
template <bool kAct8>
inline __m512i nibble_dots(__m512i lo, __m512i hi, const __m512i* xv) {
  __m512i acc = _mm512_setzero_si512();
  if constexpr (kAct8) {
    dot_bytes(acc, lo, xv[0]), dot_bytes(acc, hi, xv[1]);
  } else {
    dot_bytes(acc, lo, xv[2]), dot_bytes(acc, hi, xv[3]);
    acc = _mm512_slli_epi32(acc, 8);
    dot_bytes(acc, xv[0], lo), dot_bytes(acc, xv[1], hi);
  }
  return acc;
}

// --- decode rows (1-8) on CPUs with AVX-512 VNNI: runs of row pairs far apart, in one pass ------------------------
// A thread reads its row pairs as kRuns runs in step, pairs p, p + S, p + 2S, p + 3S in one pass over x: four
// sequential streams in flight, and four independent sets of sums (two runs from 5 rows of x, for registers). Measured on a Zen 4 EPYC (2 threads, weights
// streamed, alternated in one process): a decode step's 120 int4 linears 5.2-5.6 → 4.8-5.2 ms; single-stream int4
// decode 4-7% faster a step (6 of 8 alternated pairs), int8 weights 5-10% (4 of 4). The same order without the
// joint pass (one pair at a time, four runs interleaved) was slower, and four adjacent pairs (p .. p + 3) were 2x
// slower streamed, though 1.2x faster in L2: the prefetchers follow runs far apart, not one run read out of step.
constexpr int kRuns = 4;

// R rows of x (1-8: decode) against row pairs q = 0 .. P-1 at pw + q * stride: each pair's nibbles and scales
// prepared once for all R rows, in one pass (one accumulator a row and run: the scale's and the offset's FMAs in
// turn). y[r * N + q * ystride], y[r * N + q * ystride + 1].
// The weights ahead are prefetched into L2 for one row (single-stream decode: its 120 linears streamed 1-1.5% faster
// in one process, its steps 16 of 16 alternated rounds faster, by 0.3-2.6%) and into L1 for 2-8 rows (into L2 there
// 2-5% slower; the int8 rows' kernel below too, 9-11% slower a single-stream int8 step).
template <int P, int R, bool kAct8, typename Out>
inline void int4_rows_pairs(const uint8_t* pw, int64_t stride, const Layout& L, const XBytes<kAct8>& X, Out* y,
                            int64_t ystride, int64_t N) {
  constexpr int V = XBytes<kAct8>::kVecs;
  const __m512i low4 = _mm512_set1_epi8(15);
  const int64_t chunks = L.K() / 32, cpairs = X.cpairs;
  __m512 tot[P][R];
  for (int q = 0; q < P; ++q)
    for (int r = 0; r < R; ++r) tot[q][r] = _mm512_setzero_ps();
  ChunkWalk walk(L);
  for (int64_t cp = 0; cp < cpairs; ++cp) {
    int64_t h0 = walk.head, d0 = walk.data(), h1 = h0, d1 = d0;  // a last odd chunk twice: x's half is zero
    walk.next();
    if (2 * cp + 1 < chunks) h1 = walk.head, d1 = walk.data(), walk.next();
#pragma GCC unroll 4
    for (int q = 0; q < P; ++q) {
      const uint8_t* b = pw + q * stride;
      _mm_prefetch(reinterpret_cast<const char*>(b + d0 + kPrefetch), R == 1 ? _MM_HINT_T1 : _MM_HINT_T0);
      const __m512i v = load_halves(b + d0, b + d1);
      const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      __m512 sv, mv;
      pair_scales(b + h0, b + h1, sv, mv);
      for (int r = 0; r < R; ++r) {
        const int64_t at = r * cpairs + cp;
        const __m512i acc = nibble_dots<kAct8>(lo, hi, &X.q[at * V]);
        tot[q][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(sv, X.scale[at]), tot[q][r]);
        tot[q][r] = _mm512_fmadd_ps(mv, X.sum[at], tot[q][r]);
      }
    }
  }
  for (int q = 0; q < P; ++q)
    for (int r = 0; r < R; ++r) {
      const __m512 s = tot[q][r];
      const __m256 ab = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
      y[r * N + q * ystride] = Out(hsum128(_mm256_castps256_ps128(ab)));
      y[r * N + q * ystride + 1] = Out(hsum128(_mm256_extractf128_ps(ab, 1)));
    }
}

// int8 weights against x's one row by bytes. x rounded per chunk to int16 as for int8_pair, split as for int4: x =
// 256 hi + lo, lo unsigned and hi signed. The weights are signed, so sum(w lo) is a `vpdpbusd` with lo as its
// unsigned operand, and sum(w hi) takes w + 128 (w ^ 0x80, unsigned) against hi: sum((w + 128) hi) - 128 sum(hi),
// the correction x's own (the accumulator starts there). The exact int32 sums of int8_pair's `vpmaddwd`, in lanes
// of 4 columns. Per row and chunk: x's low bytes, high bytes, and -128 times each 4 columns' sum of high bytes; its
// scale.
struct XBytes16 {
  int64_t chunks;
  __m512i* q;  // [rows, chunks, 3], each 256 bits twice (rows a and b of a weight pair)
  float* scale;  // [rows, chunks]
  template <typename T>  // float, or bf16 (widened exactly first)
  XBytes16(const T* x, int64_t M, int64_t K)
      : chunks(K / 32), q(reused<__m512i, 0>(M * chunks * 3)), scale(reused<float, 0>(M * chunks)) {
    for (int64_t c = 0; c < M * chunks; ++c) {
      float xc[32];
      _mm512_storeu_ps(xc, load16(x + c * 32)), _mm512_storeu_ps(xc + 16, load16(x + c * 32 + 16));
      int16_t v[32];
      scale[c] = round_chunk(xc, v);
      alignas(32) uint8_t lo[32], hi[32];
      alignas(32) int32_t init[8] = {};
      for (int k = 0; k < 32; ++k) {
        lo[k] = static_cast<uint8_t>(v[k] & 255), hi[k] = static_cast<uint8_t>(v[k] >> 8);
        init[k / 4] -= 128 * (v[k] >> 8);
      }
      q[3 * c] = _mm512_broadcast_i64x4(_mm256_load_si256(reinterpret_cast<const __m256i*>(lo)));
      q[3 * c + 1] = _mm512_broadcast_i64x4(_mm256_load_si256(reinterpret_cast<const __m256i*>(hi)));
      q[3 * c + 2] = _mm512_broadcast_i64x4(_mm256_load_si256(reinterpret_cast<const __m256i*>(init)));
    }
  }
};

// R rows of x (1-8) against row pairs q = 0 .. P-1 at pw + q * stride, as int4_rows_pairs: a chunk's 32 columns of
// rows a and b in one vector, its bytes and scales read once for all R rows. y[r * N + q * ystride], y[... + 1].
template <int P, int R, typename Out>
inline void int8_rows_pairs(const uint8_t* pw, int64_t stride, const Layout& L, const XBytes16& X, Out* y,
                            int64_t ystride, int64_t N) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i s_idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  __m512 tot[P][R];
  for (int q = 0; q < P; ++q)
    for (int r = 0; r < R; ++r) tot[q][r] = _mm512_setzero_ps();
  ChunkWalk walk(L);
  for (int64_t c = 0; c < X.chunks; ++c, walk.next()) {
    const int64_t d = walk.data(), h = walk.head;
#pragma GCC unroll 4
    for (int q = 0; q < P; ++q) {
      const uint8_t* b = pw + q * stride;
      _mm_prefetch(reinterpret_cast<const char*>(b + d + kPrefetch), _MM_HINT_T0);
      const __m512i v = load_halves(b + d, b + d + L.G), vf = _mm512_xor_si512(v, flip);
      int32_t hs;  // s_a, s_b -> [s_a x 8, s_b x 8]
      std::memcpy(&hs, b + h, 4);
      const __m512 sv = _mm512_permutexvar_ps(s_idx, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(hs))));
      for (int r = 0; r < R; ++r) {
        const int64_t at = r * X.chunks + c;
        __m512i acc = X.q[3 * at + 2], lo = _mm512_setzero_si512();
        dot_bytes(acc, vf, X.q[3 * at + 1]);
        dot_bytes(lo, X.q[3 * at], v);
        acc = _mm512_add_epi32(_mm512_slli_epi32(acc, 8), lo);
        tot[q][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(sv, _mm512_set1_ps(X.scale[at])), tot[q][r]);
      }
    }
  }
  for (int q = 0; q < P; ++q)
    for (int r = 0; r < R; ++r) {
      const __m512 t = tot[q][r];
      y[r * N + q * ystride] = Out(hsum128(_mm_add_ps(_mm512_castps512_ps128(t), _mm512_extractf32x4_ps(t, 1))));
      y[r * N + q * ystride + 1] = Out(hsum128(_mm_add_ps(_mm512_extractf32x4_ps(t, 2), _mm512_extractf32x4_ps(t, 3))));
    }
}

// every row pair against x's one row: each thread's pairs in kRuns runs read in step, the rest one at a time
template <int Runs = kRuns, typename Out, class RowPairs>
void far_pairs(const uint8_t* w, const Layout& L, Out* y, RowPairs&& row_pairs) {
  const int64_t pair_bytes = L.groups * L.block;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(pair_bytes, 1));
  mii_team::parallel_for(0, L.pairs, grain, [&](int64_t b, int64_t e) {
    const int64_t S = (e - b) / Runs;
    for (int64_t p = b; p < b + S; ++p)
      row_pairs(std::integral_constant<int, Runs>{}, w + p * pair_bytes, S * pair_bytes, y + 2 * p, 2 * S);
    for (int64_t p = b + Runs * S; p < e; ++p)
      row_pairs(std::integral_constant<int, 1>{}, w + p * pair_bytes, 0, y + 2 * p, 0);
  });
}
#endif  // MII_QVNNI

#ifdef MII_QVNNI
// R rows of x (1-8, float or bf16: decode) against every row pair in one pass over the weights, each thread's pairs
// as runs far apart (four up to 4 rows, two from 5: at most 16 accumulators). y: fp32, or bf16 rounded as torch
// rounds (to nearest even: linear_output's rounding, without its pass over an fp32 copy). Alternated in one process,
// a decode step's 120 int4 linears streamed (2 threads): 2 rows 6.4-6.9 → 5.6-6.3 ms, 3 rows 11.4-11.8 → 9.2-9.6,
// 8 rows 18.6-26.3 → 16.2-22.3 (one pair and four rows at a time before); the int8 LM head [49152, 576] at 2-3 rows
// 2.1-2.9 → 1.8-2.0 ms.
template <int R, typename T, typename Out>
void decode_rows(const T* x, const uint8_t* w, const Layout& L, Out* y, bool act8) {
  constexpr int kP = R <= 4 ? kRuns : 2;
  const int64_t N = L.N(), K = L.K();
  const auto run = [&](const auto& X) {
    far_pairs<kP>(w, L, y, [&](auto P, const uint8_t* pw, int64_t stride, Out* yp, int64_t ystride) {
      if constexpr (std::is_same_v<std::decay_t<decltype(X)>, XBytes16>)
        int8_rows_pairs<decltype(P)::value, R>(pw, stride, L, X, yp, ystride, N);
      else
        int4_rows_pairs<decltype(P)::value, R>(pw, stride, L, X, yp, ystride, N);
    });
  };
  if (!L.int4) run(XBytes16(x, R, K));
  else if (act8) run(XBytes<true>(x, R, K));
  else run(XBytes<false>(x, R, K));
}
#endif

#ifdef MII_QVNNI
// decode_rows for M = 1-8 rows
template <typename T, typename Out>
void decode_any(const T* x, int64_t M, const uint8_t* w, const Layout& L, Out* y, bool act8) {
  TORCH_CHECK(M >= 1 && M < kTileMinRows, "linear_quant: ", M, " rows in the decode kernel");
  switch (M) {  // (from 9 rows on: vnni_gemm)
    case 1: return decode_rows<1>(x, w, L, y, act8);
    case 2: return decode_rows<2>(x, w, L, y, act8);
    case 3: return decode_rows<3>(x, w, L, y, act8);
    case 4: return decode_rows<4>(x, w, L, y, act8);
    case 5: return decode_rows<5>(x, w, L, y, act8);
    case 6: return decode_rows<6>(x, w, L, y, act8);
    case 7: return decode_rows<7>(x, w, L, y, act8);
    default: return decode_rows<8>(x, w, L, y, act8);
  }
}
#endif

#ifndef MII_QVNNI
// rows of x (up to kGemvRows) on CPUs with AVX2 but not AVX512-VNNI (there: decode_any)
void gemv(const float* x, int64_t M, const uint8_t* w, const Layout& L, float* y, bool act8) {
  const int64_t N = L.N(), K = L.K();
  if (L.int4 && act8) {
    const XQ<int8_t> X(x, M, K, L.G);
    for_pairs(w, M, L, [&](auto R, const uint8_t* pw, int64_t m0, int64_t p) {
      int4_pair<decltype(R)::value>(pw, L, X, m0, y, N, p);
    });
  } else if (L.int4) {
    const XQ<int16_t, true> X(x, M, K, L.G);
    for_pairs(w, M, L, [&](auto R, const uint8_t* pw, int64_t m0, int64_t p) {
      int4_pair<decltype(R)::value>(pw, L, X, m0, y, N, p);
    });
  } else {
    const XQ<int16_t> X(x, M, K, L.G);
    for_pairs(w, M, L, [&](auto R, const uint8_t* pw, int64_t m0, int64_t p) {
      int8_pair<decltype(R)::value>(pw, L, X, m0, y, N, p);
    });
  }
}
#endif
#endif  // MII_QAVX2

#ifdef MII_QVNNI
// --- more rows on CPUs with AVX-512: GEMM on unpacked 16-row tiles, exact per chunk --------------------------------
// Each task unpacks up to kVnniTiles tiles of 16 weight rows into L2. Word pair (chunk c, b) of a tile holds, for
// each of its 16 rows, the integer weights 32c + b and 32c + b + 16 (the two nibbles of an int4 byte), so that one
// instruction multiplies all 16 rows by x's pair of those columns (broadcast), each row into its own lane:
// - bf16 x (CPUs with AVX512-BF16, where the plan computes in bf16): the integers as bf16, which holds them exactly
//   (int4: 128 + q, whose bf16 bits 0x4300 | q the unpacking's byte permutation writes directly), and `vdpbf16ps`:
//   bf16 products are exact in fp32, so a group's sum is x times the weights' integers up to fp32 summation, scaled
//   once by the group's weight scale; int4's offsets add (m - 128 s) * sum(x) per group. No rounding of the weights
//   or of x: the values the file holds, times x. Blocks of 4 rows by 2 tiles keep both the group's sums and the
//   running sums in registers (bf16_block).
// - fp32 x: x rounded per chunk to int16 as the decode path rounds it, the integers as int16, and `vpdpwssd`: a
//   chunk's sums are exact int32, scaled once (x's scale times the weight scale), the decode path's arithmetic up
//   to fp32 summation order. `act8`: x rounded to int8, the int4 integers as bytes, `vpdpbusd` (int_block): the
//   same arithmetic with half the instructions.
// Measured on a Zen 4 EPYC, SmolLM2's shapes at 33-256 rows: vpdpwssd runs at about half vdpbf16ps's rate.
constexpr int64_t kVnniTiles = 4;  // 64 weight rows a task holds in L2 (K * 128 bytes)

// GCC 12 copies the accumulator around every _mm512_dpwssd_epi32 (its pattern does not tie it to the output),
// which halves the rate: the instructions are spelled out, with the accumulator tied
inline void dot(__m512i& acc, __m512i w, __m512i x) { __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x)); }
#ifdef MII_QBF16
inline void dot(__m512& acc, __m512i w, __m512i x) { __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x)); }
// the same with x's pair broadcast from memory by the instruction itself ({1to16}) where a broadcast into a register
// and the product took two instructions: rows_tile, where each broadcast serves one product (the same bits; a layer's
// four int4 linears at 5-8 rows 1.00-1.08x, alternated in one process, 9-16 rows even). The tiles' blocks, whose
// broadcast serves two tiles, were even to 2% slower with it.
inline void dot_at(__m512& acc, __m512i w, const int32_t* x) {
  __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
}
#endif

// x as the blocks read it: per row, K/2 pairs (chunk c, b) = columns 32c + b (low 16 bits) and 32c + b + 16; with
// `act8`, quads of int8 instead: (chunk c, j < 8) = columns 32c + 2j, 2j + 16, 2j + 1, 2j + 17, at (c, j) of the
// pairs' places (the byte tiles' order, unpack_tile). One XPairs a thread at a time (its arrays are the thread's
// reused buffers).
struct XPairs {
  bool bf16;       // pairs of bf16 (x exact); otherwise of int16, rounded per chunk
  bool bytes;      // act8: quads of int8 (int_block)
  int32_t* q;      // [rows, K/2]
  float* scale;    // [M, chunks]: int16 or int8 x only
  float* gsum;     // [rows, groups]: the sum of x (as multiplied) over each weight group, for int4's offsets
  int64_t chunks, groups;

  static int32_t pair(uint16_t lo, uint16_t hi) {
    return static_cast<int32_t>(static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16));
  }
  // whether x is multiplied as bf16 (vdpbf16ps: CPUs with AVX512-BF16, bf16 x, not act8)
  static bool takes_bf16(const at::Tensor& x, bool act8) {
#ifdef MII_QBF16
    return x.scalar_type() == at::kBFloat16 && !act8;
#else
    return false;
#endif
  }

  // a chunk of bf16 x (32 columns) -> its 16 pairs; returns its sum. Columns 0-15 and 16-31 widened to 32-bit
  // lanes: the pairs, and (shifted) their fp32 values
  static float bf16_chunk(const uint16_t* xc, int32_t* out) {
    const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc)));
    const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc + 16)));
    _mm512_storeu_si512(out, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(lo, 16)),
                                              _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16))));
  }

#ifdef MII_QBF16
  // M rows of bf16 x [M, K], contiguous (rows_tile: a few rows, on the calling thread)
  XPairs(const at::BFloat16* x, int64_t M, int64_t K, int64_t G) : bf16(true), bytes(false) {
    const int64_t cpg = G / 32;
    chunks = K / 32, groups = K / G;
    q = reused<int32_t, 0>(M * K / 2);
    gsum = reused<float, 1>(M * groups);
    scale = nullptr;
    std::fill(gsum, gsum + M * groups, 0.f);
    const auto* xh = reinterpret_cast<const uint16_t*>(x);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = 0; c < chunks; ++c)
        gsum[m * groups + c / cpg] += bf16_chunk(xh + m * K + c * 32, q + m * (K / 2) + c * 16);
  }
#endif

  // rows >= M: the rows past M are zero (AMX's tiles of 32 rows)
  XPairs(const at::Tensor& x, int64_t G, bool act8, int64_t rows) : bf16(takes_bf16(x, act8)), bytes(act8) {
    const int64_t M = x.size(0), K = x.size(1), cpg = G / 32;
    chunks = K / 32, groups = K / G;
    q = reused<int32_t, 0>(rows * K / 2);
    gsum = reused<float, 1>(rows * groups);
    scale = bf16 ? nullptr : reused<float, 2>(M * chunks);
    std::memset(static_cast<void*>(q + M * K / 2), 0, (rows - M) * (K / 2) * sizeof(int32_t));
    std::fill(gsum, gsum + rows * groups, 0.f);
    const at::Tensor xf = bf16 ? x : x.to(at::kFloat).contiguous();
    // (the data pointers taken once: data_ptr's checks a chunk were 3% of a [576, 1536] linear's samples at 256 rows)
    const uint16_t* xh = bf16 ? reinterpret_cast<const uint16_t*>(xf.data_ptr<at::BFloat16>()) : nullptr;
    const float* xs = bf16 ? nullptr : xf.data_ptr<float>();
    mii_team::parallel_for(0, M, 32, [&](int64_t b, int64_t e) {
      for (int64_t m = b; m < e; ++m) {
        int32_t* out = &q[m * (K / 2)];
        for (int64_t c = 0; c < chunks; ++c, out += 16) {
          float sum;
          if (bf16) {
            sum = bf16_chunk(xh + m * K + c * 32, out);
          } else {
            const float* xc = xs + m * K + c * 32;
            int16_t v[32];
            float s;
            if (act8) {
              int8_t v8[32];
              s = round_chunk(xc, v8);
              for (int k = 0; k < 32; ++k) v[k] = v8[k];
            } else {
              s = round_chunk(xc, v);
            }
            int32_t vsum = 0;  // exact
            for (int k = 0; k < 32; ++k) vsum += v[k];
            sum = static_cast<float>(vsum) * s;
            if (act8) {
              for (int j = 0; j < 8; ++j) {
                const uint8_t b[4] = {uint8_t(v[2 * j]), uint8_t(v[2 * j + 16]), uint8_t(v[2 * j + 1]),
                                      uint8_t(v[2 * j + 17])};
                std::memcpy(&out[j], b, 4);
              }
            } else {
              for (int k = 0; k < 16; ++k) out[k] = pair(static_cast<uint16_t>(v[k]), static_cast<uint16_t>(v[k + 16]));
            }
            scale[m * chunks + c] = s;
          }
          gsum[m * groups + c / cpg] += sum;
        }
      }
    });
  }
};

// byte permutations for int4 chunks (vpermt2b indexes): see unpack_int4
struct Int4Perm {
  alignas(64) uint8_t a[2][64], o[2][64], p[4][64], pb[4][64];
  Int4Perm() {
    for (int h = 0; h < 2; ++h)
      for (int e = 0; e < 64; ++e) {
        const int b = e / 8, n = e % 8;  // 4 rows a register -> 8 rows, 8 columns (b + 8h) a register
        a[h][e] = static_cast<uint8_t>((n < 4 ? 0 : 64) + (n % 4) * 16 + b + 8 * h);
        const int bb = e / 16, r = e % 16;  // -> 16 rows, 4 columns (bb + 4h of the 8) a register
        o[h][e] = static_cast<uint8_t>((r < 8 ? 0 : 64) + (bb + 4 * h) * 8 + r % 8);
      }
    for (int j = 0; j < 4; ++j)
      for (int e = 0; e < 64; ++e) {  // lane n: [low nibble of row n, 0, high nibble, 0]; pb: 0x43 for the zeros
        p[j][e] = static_cast<uint8_t>(e % 4 == 0 ? j * 16 + e / 4 : e % 4 == 2 ? 64 + j * 16 + e / 4 : 0);
        pb[j][e] = e % 2 ? 0x43 : p[j][e];
      }
  }
};

// one int4 chunk of 16 rows (8 pairs: 32 bytes each, row a then row b, byte b = column b in the low nibble and
// column b + 16 in the high; nullptr: zero rows) -> out[b], lane n = row n's weights b (low 16 bits) and b + 16
// (high), as int16 or bf16. A byte transpose in two rounds of `vpermt2b`, then each column's pair of nibbles.
inline void unpack_int4(const uint8_t* const* src, bool bf16, __m512i* out) {
  static const Int4Perm P;
  auto ld = [](const uint8_t* q) {
    return q ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)) : _mm256_setzero_si256();
  };
  __m512i z[4], a[4], o[4];
  for (int i = 0; i < 4; ++i) z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(ld(src[2 * i])), ld(src[2 * i + 1]), 1);
  for (int h = 0; h < 2; ++h) {
    const __m512i ia = _mm512_load_si512(P.a[h]);
    a[h] = _mm512_permutex2var_epi8(z[0], ia, z[1]);      // rows 0-7, columns 8h .. 8h+7
    a[2 + h] = _mm512_permutex2var_epi8(z[2], ia, z[3]);  // rows 8-15
  }
  for (int h = 0; h < 2; ++h) {
    const __m512i io = _mm512_load_si512(P.o[h]);
    o[h] = _mm512_permutex2var_epi8(a[0], io, a[2]);      // columns 4h .. 4h+3, rows 0-15
    o[2 + h] = _mm512_permutex2var_epi8(a[1], io, a[3]);  // columns 8 + 4h ..
  }
  const __m512i low4 = _mm512_set1_epi8(15);
  for (int q = 0; q < 4; ++q) {
    const __m512i lo = _mm512_and_si512(o[q], low4), hi = _mm512_and_si512(_mm512_srli_epi16(o[q], 4), low4);
    for (int j = 0; j < 4; ++j) {
      // bf16: 0x4300 | n is the bf16 of 128 + n (exact: 8 bits), its high byte kept from the index where the
      // mask leaves it; the tile's offsets take the 128 back (unpack_tile)
      const __m512i v = bf16 ? _mm512_mask2_permutex2var_epi8(lo, _mm512_load_si512(P.pb[j]), 0x5555555555555555ULL, hi)
                             : _mm512_maskz_permutex2var_epi8(0x5555555555555555ULL, lo, _mm512_load_si512(P.p[j]), hi);
      _mm512_store_si512(out + 4 * q + j, v);
    }
  }
}

// one int8 row's chunk (32 bytes) as 16 lanes, lane b = weights b (low 16 bits) and b + 16 (high), int16 or bf16
inline __m512i int8_lanes(const uint8_t* src, bool bf16) {
  const __m512i lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  const __m512i hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16)));
  if (!bf16) return _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(hi, 16));
  // an int8 is exact in bf16: its fp32 bits' upper half
  const __m512i flo = _mm512_castps_si512(_mm512_cvtepi32_ps(lo)), fhi = _mm512_castps_si512(_mm512_cvtepi32_ps(hi));
  return _mm512_or_si512(_mm512_srli_epi32(flo, 16), _mm512_and_si512(fhi, _mm512_set1_epi32(int32_t(0xFFFF0000))));
}

// chunk c of 16 int8 rows (8 pairs' groups at blk[p]; nullptr: zero rows) -> out[b], lane n = row n's weights
// 32c + b (low 16 bits) and 32c + b + 16 (high), as int16 or bf16
inline void unpack_int8(const uint8_t* const* blk, const Layout& L, int64_t c, bool bf16, __m512i* out) {
  __m512i r[16];
  for (int n = 0; n < 16; ++n) {
    const uint8_t* b = blk[n / 2];
    r[n] = b ? int8_lanes(b + 8 + (n % 2) * L.G + c * 32, bf16) : _mm512_setzero_si512();
  }
  mii_vec::transpose16(r, out);
}

// unpacked tiles: tile t's pair (chunk, b) at data[t * stride + chunk * 16 + b]; its rows' weight scales and
// offsets (fp32, 0 past the last row) at sw / mw[t * sstride + group * 16 + row]
struct Tiles {
  __m512i* data;
  float *sw, *mw;
  int64_t stride, sstride;
};

// 16-bit element indexes of a tile's 16 rows' scales (s) and offsets (m) in its 8 pairs' headers (unpack_tile)
struct HeaderPerm {
  alignas(64) uint16_t s[32], m[32];
  HeaderPerm() {
    for (int n = 0; n < 32; ++n) {
      s[n] = static_cast<uint16_t>(n < 16 ? 4 * (n / 2) + n % 2 : 0);
      m[n] = static_cast<uint16_t>(n < 16 ? 4 * (n / 2) + 2 + n % 2 : 0);
    }
  }
};

#if defined(MII_QBF16) && defined(MII_AMX)
// MII_QUANT_TILES=bf16 (opt-in, read per call as MII_AMX is): the AMX path multiplies the weights rounded to bf16
// (amx_rounded) rather than their exact integers with a scaling per group (amx_tiles)
inline bool bf16_tiles_chosen() {
  const char* v = std::getenv("MII_QUANT_TILES");
  return v && std::strcmp(v, "bf16") == 0;
}

// 16-bit element indexes that interleave two vectors' halves into pairs (round_weights)
struct RoundPerm {
  alignas(64) uint16_t idx[32];
  RoundPerm() {
    for (int e = 0; e < 32; ++e) idx[e] = static_cast<uint16_t>(e / 2 + (e % 2) * 16);
  }
};

// a chunk's 16 unpacked vectors (bf16 bits of q, or of 128 + q for int4) -> the bf16 of each weight s q + m (int4)
// or s q (int8), computed as mii/layers/quant.py's dequantize computes it (s q rounded, then + m, in fp32), then
// rounded to nearest even: the AMX path's weights (amx_rounded)
inline void round_weights(__m512i* out, __m512 sv, __m512 mv, bool int4) {
  constexpr int R = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;  // (explicit rounding: never a fused multiply-add)
  static const RoundPerm P;
  const __m512i order = _mm512_load_si512(P.idx);
  const __m512 off = _mm512_set1_ps(int4 ? 128.f : 0.f);
  for (int i = 0; i < 16; ++i) {
    const __m512i v = _mm512_load_si512(out + i);
    __m512 lo = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), off);
    __m512 hi = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int32_t(0xFFFF0000)))), off);
    lo = _mm512_mul_round_ps(lo, sv, R);
    hi = _mm512_mul_round_ps(hi, sv, R);
    if (int4) lo = _mm512_add_round_ps(lo, mv, R), hi = _mm512_add_round_ps(hi, mv, R);
    // (to nearest even, both halves at once: lo's 16 then hi's, interleaved back into pairs; the instruction reads
    // fp32 subnormals as zero, which fp16 scales and offsets times 4-8 bit integers never are)
    const __m512i b = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
    _mm512_store_si512(out + i, _mm512_permutexvar_epi16(order, b));
  }
}
#endif

// the int16 word pairs of an int4 chunk (unpack_int4: lane n of out[b] = row n's weights b and b + 16) as byte quads
// in out[0 .. 7]: lane n of out[j] = row n's weights 2j, 2j + 16, 2j + 1, 2j + 17 (XPairs' quads of x)
inline void int4_quads(__m512i* out) {
  const __m512i order = _mm512_set4_epi32(0x0f0e0706, 0x0d0c0504, 0x0b0a0302, 0x09080100);
  for (int j = 0; j < 8; ++j)  // (packed within 128-bit lanes: rows 4k .. 4k+3's pairs from out[2j], then out[2j+1])
    out[j] = _mm512_shuffle_epi8(_mm512_packus_epi16(out[2 * j], out[2 * j + 1]), order);
}

// the fp16 headers (s_a, s_b, m_a, m_b) of a tile's np pairs at one group (blk[p]) -> its 16 rows' weight scales (sv)
// and offsets (mv: int4's; zero for int8), zero past the last pair
inline void tile_headers(const uint8_t* const* blk, int64_t np, bool int4, __m512& sv, __m512& mv) {
  static const HeaderPerm H;
  __m512i hdr = _mm512_setzero_si512();  // (halves 4p .. 4p+3: pair p's)
  for (int p = 0; p < np; ++p) {
    int64_t h;
    std::memcpy(&h, blk[p], 8);
    hdr = _mm512_mask_set1_epi64(hdr, __mmask8(1u << p), h);
  }
  sv = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(_mm512_load_si512(H.s), hdr)));
  mv = int4 ? _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(_mm512_load_si512(H.m), hdr)))
            : _mm512_setzero_ps();
}

// the 16 rows of pairs p0 .. p0+7 (those past L.pairs are zero) -> tile t: the weights' integers (int16, or bf16
// under bf16 x; int4 as byte quads with `bytes`) with their scales and offsets in sw / mw; `rounded` (AMX,
// MII_QUANT_TILES=bf16): the weights themselves in bf16 (round_weights), no scales
void unpack_tile(const uint8_t* w, const Layout& L, int64_t p0, bool bf16, const Tiles& T, int64_t t,
                 bool rounded = false, bool bytes = false) {
  const int64_t pair_bytes = L.groups * L.block, cpg = L.G / 32, np = std::min<int64_t>(8, L.pairs - p0);
  __m512i* tile = T.data + t * T.stride;
  for (int64_t g = 0; g < L.groups; ++g) {
    const uint8_t* blk[8];
    for (int p = 0; p < 8; ++p) blk[p] = p < np ? w + (p0 + p) * pair_bytes + g * L.block : nullptr;
    __m512 sv, mv;
    tile_headers(blk, np, L.int4, sv, mv);
    // bf16 int4 tiles hold 128 + q (unpack_int4): s (128 + q) + (m - 128 s) = s q + m; m - 128 s is exact in fp32
    // while |m| is within 2^13 of 128 s (a file's groups: |m| ~ 8 s), else rounded at 2^-24 of 128 s
    if (!rounded) {
      if (bf16 && L.int4) mv = _mm512_sub_ps(mv, _mm512_mul_ps(_mm512_set1_ps(128.f), sv));
      _mm512_storeu_ps(T.sw + t * T.sstride + g * 16, sv);
      _mm512_storeu_ps(T.mw + t * T.sstride + g * 16, mv);
    }
    for (int64_t c = 0; c < cpg; ++c) {
      __m512i* out = tile + (g * cpg + c) * 16;
      if (L.int4) {
        const uint8_t* src[8];
        for (int p = 0; p < 8; ++p) src[p] = blk[p] ? blk[p] + 8 + c * 32 : nullptr;
        unpack_int4(src, bf16, out);
        if (bytes) int4_quads(out);
      } else {
        unpack_int8(blk, L, c, bf16, out);
      }
#if defined(MII_QBF16) && defined(MII_AMX)
      if (rounded) round_weights(out, sv, mv, L.int4);  // (bf16 is true: the AMX path)
#endif
    }
  }
}

// part[r][t] += chunk ch of tiles t (16 word pairs) times x's pairs of rows r: one dot product a row, tile and pair
// (Acc: __m512i for int16 x, __m512 for bf16 x)
template <int MR, int NT, typename Acc>
__attribute__((always_inline)) inline void chunk_dots(Acc (&part)[MR][NT], const __m512i* tiles, int64_t stride,
                                                      const int32_t* const* xq, int64_t ch) {
  for (int b = 0; b < 16; ++b) {
    __m512i wv[NT];
    for (int t = 0; t < NT; ++t) wv[t] = _mm512_load_si512(tiles + t * stride + ch * 16 + b);
    for (int r = 0; r < MR; ++r) {
      const __m512i xb = _mm512_set1_epi32(xq[r][ch * 16 + b]);
      for (int t = 0; t < NT; ++t) dot(part[r][t], wv[t], xb);
    }
  }
}

#ifdef MII_QBF16
// a row's 16 sums into y (fp32) or yb (bf16, rounded to nearest even), the columns `valid` only
inline void store_sums(float* y, at::BFloat16* yb, int64_t at, __mmask16 valid, __m512 v) {
  if (yb) _mm256_mask_storeu_epi16(yb + at, valid, mii_vec::bf16_round(v));
  else _mm512_mask_storeu_ps(y + at, valid, v);
}
#endif

// `bytes` at p brought into L2 over `steps` calls of step(), a few lines each (amx_tiles, bf16_tiles, int_tiles:
// the next task's weights, whose unpacking reads 8 places pair_bytes apart, which the hardware prefetcher does not
// follow)
struct Ahead {
  const uint8_t* p;
  int64_t lines, per_step, done = 0;
  Ahead(const uint8_t* p, int64_t bytes, int64_t steps)
      : p(p), lines((bytes + 63) / 64), per_step(((bytes + 63) / 64 + steps - 1) / std::max<int64_t>(1, steps)) {}
  void step() {
    for (const int64_t e = std::min(lines, done + per_step); done < e; ++done)
      _mm_prefetch(reinterpret_cast<const char*>(p + 64 * done), _MM_HINT_T1);
  }
};

#ifdef MII_QBF16
// --- how many rows of x bf16_block takes at a time ------------------------------------------------------------------
// A block's sums are rows x 2 tiles chains of dependent `vdpbf16ps`, each ~6 cycles long. Zen 4 runs one 512-bit dot
// product a cycle, which 8 chains (4 rows, their running sums in registers beside them) keep busy. Zen 5 runs two:
// 8 chains reach 2/3 of its rate (one core, registers only: 4.8 against 7.1 G dot products a second with 12), so
// there blocks of 6 rows (12 chains; their running sums in L1 between groups, as 24 of them do not fit beside the
// chains in 32 registers). Chosen once per process by timing 8 and 12 chains (< 2 ms); MII_TILE_ROWS=4|6 overrides
// (read per call, as MII_AMX is). A row's arithmetic is the same in either block.
template <int C>
__attribute__((noinline)) double dot_chains_ns(int64_t iters) {
  __m512 acc[C];
  for (int i = 0; i < C; ++i) acc[i] = _mm512_setzero_ps();
  __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x3c003c00);
  const auto start = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < C; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    __asm__ volatile("" : "+v"(a), "+v"(b));  // (no hoisting: each round depends on the last)
  }
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
  __m512 sum = acc[0];
  for (int i = 1; i < C; ++i) sum = _mm512_add_ps(sum, acc[i]);
  volatile float sink = _mm512_reduce_add_ps(sum);
  (void)sink;
  return ns / (static_cast<double>(iters) * C);
}

// 12 chains' rate over 8 chains' (best of 3 alternated timings of ~0.2 ms each)
double twelve_over_eight_chains() {
  double t8 = 1e30, t12 = 1e30;
  for (int round = 0; round < 3; ++round) {
    t8 = std::min(t8, dot_chains_ns<8>(20000));
    t12 = std::min(t12, dot_chains_ns<12>(15000));
  }
  return t8 / t12;
}

int64_t tile_block_rows() {
  if (const char* v = std::getenv("MII_TILE_ROWS")) {
    if (std::strcmp(v, "4") == 0) return 4;
    if (std::strcmp(v, "6") == 0) return 6;
  }
  static const int64_t measured = twelve_over_eight_chains() > 1.15 ? 6 : 4;
  return measured;
}
#endif

#ifdef MII_QBF16
// bf16 x: rows m0 .. m0+MR-1 of x against tiles t0 .. t0+NT-1 (MR <= 6, NT <= 2), the group's sums and (up to 8 of
// them) the running sums both in registers (2 x 8 accumulators): each group's sums times the weight scale, plus
// offset x sum(x), with no round trip through L1; blocks of 5-6 rows (tile_block_rows) keep their running sums in
// `held` (L1) between groups. Where the running sums of 4 x 4 blocks lived in L1 (16 accumulators and 16 sums do
// not fit 32 registers), a layer's four int4 linears ran 5-8% slower (alternated in one process, 64 and 256
// rows); the same arithmetic in the same order, so the same results bit for bit.
template <int MR, int NT>
__attribute__((noinline)) void bf16_block(const XPairs& X, int64_t m0, int64_t K, const Layout& L, const Tiles& T,
                                          int64_t t0, float* y, at::BFloat16* yb, int64_t N, int64_t n0,
                                          float* held) {
  const int64_t cpg = L.G / 32;
  const int32_t* xq[MR];
  const float* gs[MR];
  for (int r = 0; r < MR; ++r) xq[r] = &X.q[(m0 + r) * (K / 2)], gs[r] = &X.gsum[(m0 + r) * X.groups];
  const int64_t stride = T.stride, sstride = T.sstride;
  const __m512i* tiles = T.data + t0 * stride;
  const float* sw = T.sw + t0 * sstride;
  const float* mw = T.mw + t0 * sstride;
  constexpr bool kInRegisters = MR * NT <= 8;
  __m512 acc[MR][NT];
  for (int r = 0; r < MR; ++r)
    for (int t = 0; t < NT; ++t) {
      acc[r][t] = _mm512_setzero_ps();
      if constexpr (!kInRegisters) _mm512_store_ps(held + (r * NT + t) * 16, acc[r][t]);
    }
  for (int64_t g = 0; g < L.groups; ++g) {
    __m512 part[MR][NT];
    for (int r = 0; r < MR; ++r)
      for (int t = 0; t < NT; ++t) part[r][t] = _mm512_setzero_ps();
    for (int64_t c = 0; c < cpg; ++c) {
      const int64_t ch = g * cpg + c;
      chunk_dots<MR, NT>(part, tiles, stride, xq, ch);
    }
    for (int t = 0; t < NT; ++t) {
      const __m512 sv = _mm512_loadu_ps(sw + t * sstride + g * 16);
      const __m512 mv = _mm512_loadu_ps(mw + t * sstride + g * 16);
      for (int r = 0; r < MR; ++r) {
        __m512 a = kInRegisters ? acc[r][t] : _mm512_load_ps(held + (r * NT + t) * 16);
        a = _mm512_fmadd_ps(part[r][t], sv, a);
        if (L.int4) a = _mm512_fmadd_ps(mv, _mm512_set1_ps(gs[r][g]), a);
        if constexpr (kInRegisters) acc[r][t] = a;
        else _mm512_store_ps(held + (r * NT + t) * 16, a);
      }
    }
  }
  for (int t = 0; t < NT; ++t) {
    const int64_t n = n0 + (t0 + t) * 16;
    const __mmask16 valid = N - n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (N - n)) - 1);
    for (int r = 0; r < MR; ++r)
      store_sums(y, yb, (m0 + r) * N + n, valid, kInRegisters ? acc[r][t] : _mm512_load_ps(held + (r * NT + t) * 16));
  }
}
#endif

// int16 x (fp32 x; bf16 x on CPUs without AVX512-BF16) or, `kBytes`, act8's int8 x (int4 weights): rows m0 ..
// m0+MR-1 of x against tiles t0 .. t0+NT-1 (MR <= 4, NT <= 2). int16: one `vpdpwssd` a word pair (chunk_dots);
// int8: the byte quads of both multiplied by `vpdpbusd` (the weights' nibbles unsigned, x signed: 4 products into
// each lane, 64 an instruction). A chunk's int32 sums are exact, then scaled (x's scale times the weight scale) into
// running sums in registers; int4's offsets add m sum(x) per group.
template <int MR, int NT, bool kBytes>
__attribute__((noinline)) void int_block(const XPairs& X, int64_t m0, int64_t K, const Layout& L, const Tiles& T,
                                         int64_t t0, float* y, int64_t N, int64_t n0) {
  const int64_t cpg = L.G / 32;
  const int32_t* xq[MR];
  const float *xs[MR], *gs[MR];
  for (int r = 0; r < MR; ++r) {
    xq[r] = &X.q[(m0 + r) * (K / 2)], gs[r] = &X.gsum[(m0 + r) * X.groups];
    xs[r] = &X.scale[(m0 + r) * X.chunks];
  }
  const int64_t stride = T.stride, sstride = T.sstride;
  const __m512i* tiles = T.data + t0 * stride;
  const float* sw = T.sw + t0 * sstride;
  const float* mw = T.mw + t0 * sstride;
  __m512 acc[MR][NT];
  for (int r = 0; r < MR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < L.groups; ++g) {
    for (int64_t c = 0; c < cpg; ++c) {
      const int64_t ch = g * cpg + c;
      __m512i part[MR][NT];
      for (int r = 0; r < MR; ++r)
        for (int t = 0; t < NT; ++t) part[r][t] = _mm512_setzero_si512();
      if constexpr (kBytes) {
        for (int j = 0; j < 8; ++j) {
          __m512i wv[NT];
          for (int t = 0; t < NT; ++t) wv[t] = _mm512_load_si512(tiles + t * stride + ch * 16 + j);
          for (int r = 0; r < MR; ++r) {
            const __m512i xb = _mm512_set1_epi32(xq[r][ch * 16 + j]);
            for (int t = 0; t < NT; ++t) dot_bytes(part[r][t], wv[t], xb);
          }
        }
      } else {
        chunk_dots<MR, NT>(part, tiles, stride, xq, ch);
      }
      for (int t = 0; t < NT; ++t) {
        const __m512 sv = _mm512_loadu_ps(sw + t * sstride + g * 16);
        for (int r = 0; r < MR; ++r)
          acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(part[r][t]), _mm512_mul_ps(sv, _mm512_set1_ps(xs[r][ch])),
                                      acc[r][t]);
      }
    }
    if (L.int4) {
      for (int t = 0; t < NT; ++t) {
        const __m512 mv = _mm512_loadu_ps(mw + t * sstride + g * 16);
        for (int r = 0; r < MR; ++r) acc[r][t] = _mm512_fmadd_ps(mv, _mm512_set1_ps(gs[r][g]), acc[r][t]);
      }
    }
  }
  for (int t = 0; t < NT; ++t) {
    const int64_t n = n0 + (t0 + t) * 16;
    const __mmask16 valid = N - n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (N - n)) - 1);
    for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + (m0 + r) * N + n, valid, acc[r][t]);
  }
}

// a task's nt tiles two at a time (they stay in L1/L2 while every row of x passes), the rows in blocks of Most and
// Most - 1 (4 and 3, or 6 and 5: mii_vec::by_blocks):
// block(R, NT, m, t) (R, NT as std::integral_constant) for bf16_block and int_block; each block brings its share of
// `ahead` (the thread's next task's weight bytes) into L2 first
template <int Most = 4, class Block>
void two_tiles_at_a_time(int64_t M, int64_t nt, const uint8_t* ahead, int64_t ahead_bytes, Block&& block) {
  Ahead next(ahead, ahead_bytes, (nt + 1) / 2 * ((M + Most - 1) / Most));
  const auto rows = [&](auto NT, int64_t t) {
    mii_vec::by_blocks<Most>(M, [&](int64_t m, int R) {
      next.step();
      switch (R) {
        case 6: if constexpr (Most >= 6) block(std::integral_constant<int, 6>{}, NT, m, t); break;
        case 5: if constexpr (Most >= 5) block(std::integral_constant<int, 5>{}, NT, m, t); break;
        case 4: block(std::integral_constant<int, 4>{}, NT, m, t); break;
        case 3: block(std::integral_constant<int, 3>{}, NT, m, t); break;
        case 2: block(std::integral_constant<int, 2>{}, NT, m, t); break;
        default: block(std::integral_constant<int, 1>{}, NT, m, t);
      }
    });
  };
  int64_t t = 0;
  for (; t + 2 <= nt; t += 2) rows(std::integral_constant<int, 2>{}, t);
  if (t < nt) rows(std::integral_constant<int, 1>{}, t);
}

// int16 or (kBytes) int8 x against a task's nt tiles, as bf16_tiles. act8's bytes against its former int16 pairs
// in 4 x 4 blocks with the running sums in L1 (`vpdpwssd`), a layer's four int4 linears (SmolLM2's shapes, bf16 x,
// 2 threads, Zen 4 EPYC, alternated processes): 16 rows 0.55 → 0.41 ms, 64 rows 1.64 → 1.09, 128 rows 3.16 →
// 2.00, 256 rows 6.15 → 3.92 (bit-identical outputs); 1.07-1.43x the exact bf16 x path (bf16_block) there.
// (ahead: the thread's next task's weight bytes, brought into L2 over this task's blocks, as bf16_tiles does)
template <bool kBytes>
void int_tiles(const XPairs& X, int64_t M, int64_t K, const Layout& L, const Tiles& T, int64_t nt, float* y,
               int64_t N, int64_t n0, const uint8_t* ahead, int64_t ahead_bytes) {
  two_tiles_at_a_time(M, nt, ahead, ahead_bytes, [&](auto R, auto NT, int64_t m, int64_t t) {
    int_block<decltype(R)::value, decltype(NT)::value, kBytes>(X, m, K, L, T, t, y, N, n0);
  });
}

#ifdef MII_QBF16
// bf16 x against a task's nt tiles: two tiles at a time (they stay in L1/L2 while every row of x passes), the rows
// in blocks of 4 and 3; the next task's weights brought into L2 a few lines a block (`ahead`). That prefetch,
// alternated in one process on a Zen 4 EPYC (2 threads, a layer's four int4 linears x 30 layers, streamed): 16 rows
// 20.2 → 18.0 ms, 32 rows 32.4 → 29.9, 64 rows 56.8 → 53.7, 128-256 rows 2% (7 of 7 pairs faster at 16 and 32)
void bf16_tiles(const XPairs& X, int64_t M, int64_t K, const Layout& L, const Tiles& T, int64_t nt, float* y,
                at::BFloat16* yb, int64_t N, int64_t n0, const uint8_t* ahead, int64_t ahead_bytes) {
  alignas(64) float held[6 * 2 * 16];  // the running sums of blocks of more than 8 (bf16_block)
  const auto block = [&](auto R, auto NT, int64_t m, int64_t t) {
    bf16_block<decltype(R)::value, decltype(NT)::value>(X, m, K, L, T, t, y, yb, N, n0, held);
  };
  if (tile_block_rows() == 6)
    two_tiles_at_a_time<6>(M, nt, ahead, ahead_bytes, block);
  else
    two_tiles_at_a_time<4>(M, nt, ahead, ahead_bytes, block);
}
#endif

#if defined(MII_QBF16) && defined(MII_AMX)
// bf16 x against a task's nt tiles with AMX: an unpacked tile's chunk (16 word pairs of 16 rows) is an AMX B tile
// as it lies, and x's pairs of a chunk for 16 rows an A tile (X.q, its rows padded with zeros to a multiple of 32).
// 32 rows of x by 2 tiles a block: tiles 0-3 a group's sums, 4-5 x, 6-7 the weights; each group's sums then
// times the weight scale, plus offset x sum(x), into running sums in L1 (bf16_block's arithmetic, in its order;
// a group's sums are AMX's, in other fp32 order than vdpbf16ps's).
//
// `ahead`: the weight bytes of the thread's next task, brought into L2 a few lines every group, over the whole of
// this one: a task's unpacking reads its pairs a group at a time, 8 places pair_bytes apart, which the hardware
// prefetcher does not follow, and a decode step streams every weight from memory once (at 16 rows, the unpacking's
// loads waited for memory; prefetched during the unpacking instead, the prefetches themselves waited).
//
// yb: y in bf16 instead (rounded to nearest even as linear_output rounds, without its pass over an fp32 copy), or null.
void amx_tiles(const XPairs& X, int64_t M, int64_t K, const Layout& L, const Tiles& T, int64_t nt, float* y,
               at::BFloat16* yb, int64_t N, int64_t n0, const uint8_t* ahead, int64_t ahead_bytes) {
  const int64_t cpg = L.G / 32, Mp = (M + 31) / 32 * 32, xstride = K / 2 * 4;
  alignas(64) float part[4][256], acc[4][256];  // C tile i: tile i / 2 of the pair, rows 16 (i % 2) ..
  Ahead next(ahead, ahead_bytes, (nt + 1) / 2 * (Mp / 32) * L.groups);
  for (int64_t t0 = 0; t0 < nt; t0 += 2) {
    const int tn = t0 + 1 < nt ? 2 : 1;
    const __m512i* w0 = T.data + t0 * T.stride;
    const __m512i* w1 = w0 + (tn == 2 ? T.stride : 0);
    for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
      const int32_t* x0 = &X.q[m0 * (K / 2)];
      const int32_t* x1 = x0 + 16 * (K / 2);
      for (int64_t g = 0; g < L.groups; ++g) {
        next.step();
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t ch = g * cpg; ch < (g + 1) * cpg; ++ch)
          mii_vec::amx_dots_2x2(x0 + ch * 16, x1 + ch * 16, xstride, w0 + ch * 16, w1 + ch * 16);
        _tile_stored(0, part[0], 64);
        _tile_stored(1, part[1], 64);
        _tile_stored(2, part[2], 64);
        _tile_stored(3, part[3], 64);
        for (int i = 0; i < 2 * tn; ++i) {
          const __m512 sv = _mm512_loadu_ps(T.sw + (t0 + i / 2) * T.sstride + g * 16);
          const __m512 mv = _mm512_loadu_ps(T.mw + (t0 + i / 2) * T.sstride + g * 16);
          const float* gs = &X.gsum[(m0 + 16 * (i % 2)) * X.groups + g];
          for (int r = 0; r < 16; ++r) {  // (the first group starts the running sums)
            const __m512 pv = _mm512_load_ps(part[i] + 16 * r);
            __m512 a = g ? _mm512_fmadd_ps(pv, sv, _mm512_load_ps(acc[i] + 16 * r)) : _mm512_mul_ps(pv, sv);
            if (L.int4) a = _mm512_fmadd_ps(mv, _mm512_set1_ps(gs[r * X.groups]), a);
            _mm512_store_ps(acc[i] + 16 * r, a);
          }
        }
      }
      for (int i = 0; i < 2 * tn; ++i) {
        const int64_t n = n0 + (t0 + i / 2) * 16;
        const __mmask16 valid = N - n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (N - n)) - 1);
        for (int r = 0; r < 16 && m0 + 16 * (i % 2) + r < M; ++r)
          store_sums(y, yb, (m0 + 16 * (i % 2) + r) * N + n, valid, _mm512_load_ps(acc[i] + 16 * r));
      }
    }
  }
}

// MII_QUANT_TILES=bf16: bf16 x against a task's nt tiles of weights already rounded to bf16 (unpack_tile's
// `rounded`): one tile product per chunk of 32 inputs over the whole of K, stored once, where amx_tiles stores every
// group's sums and scales them (at 256 rows its tile stores and scaling cost about what its products do). 32 rows
// of x by 2 tiles a block (tiles 0-3 the sums, 4-5 x, 6-7 the weights); a last block of 16 rows takes one A tile (0
// and 2 the sums). A row's sums are the same products in the same order whichever block it lands in. The price:
// each weight rounded to bf16 (as a bf16 model's are), an error near 2^-9 / sqrt(K) of sum |x * w| where the exact
// path's is fp32 summation's. 120 int4 linears of a step (AMX Xeon, 2 threads): 256 rows 81 -> 54 ms, 512 rows
// 156 -> 96, 64 rows 26 -> 22; 9-16 rows ~1.5 ms slower (the rounding in the unpacking).
void amx_rounded(const XPairs& X, int64_t M, int64_t K, const Tiles& T, int64_t nt, float* y, at::BFloat16* yb,
                 int64_t N, int64_t n0, const uint8_t* ahead, int64_t ahead_bytes) {
  const int64_t chunks = K / 32, xstride = K / 2 * 4;
  alignas(64) float part[4][256];  // C tile i: tile i / 2 of the pair, rows 16 (i % 2) ..
  const int64_t Mp = (M + 15) / 16 * 16;
  Ahead next(ahead, ahead_bytes, (nt + 1) / 2 * ((Mp + 31) / 32) * chunks);
  for (int64_t t0 = 0; t0 < nt; t0 += 2) {
    const int tn = t0 + 1 < nt ? 2 : 1;
    const __m512i* w0 = T.data + t0 * T.stride;
    const __m512i* w1 = w0 + (tn == 2 ? T.stride : 0);
    for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
      const int32_t* x0 = &X.q[m0 * (K / 2)];
      const bool two = Mp - m0 >= 32;
      if (two) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        const int32_t* x1 = x0 + 16 * (K / 2);
        for (int64_t ch = 0; ch < chunks; ++ch) {
          next.step();
          mii_vec::amx_dots_2x2(x0 + ch * 16, x1 + ch * 16, xstride, w0 + ch * 16, w1 + ch * 16);
        }
        _tile_stored(1, part[1], 64);
        _tile_stored(3, part[3], 64);
      } else {
        _tile_zero(0); _tile_zero(2);
        for (int64_t ch = 0; ch < chunks; ++ch) {
          next.step();
          _tile_loadd(4, x0 + ch * 16, xstride);
          _tile_loadd(6, w0 + ch * 16, 64);
          _tile_loadd(7, w1 + ch * 16, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(2, 4, 7);
        }
      }
      _tile_stored(0, part[0], 64);
      _tile_stored(2, part[2], 64);
      for (int i = 0; i < 2 * tn; ++i) {
        if (i % 2 && !two) continue;
        const int64_t n = n0 + (t0 + i / 2) * 16;
        const __mmask16 valid = N - n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (N - n)) - 1);
        for (int r = 0; r < 16 && m0 + 16 * (i % 2) + r < M; ++r)
          store_sums(y, yb, (m0 + 16 * (i % 2) + r) * N + n, valid, _mm512_load_ps(part[i] + 16 * r));
      }
    }
  }
}

// Up to 16 rows of x (a few decode streams, where amx_tiles would pad them to 32): one 16 x 16 C tile at a time, its
// running sums in registers, group g + 1's tile product issued before group g's sums are scaled (C tiles 0 and 1,
// A 2 and 3, B 4 and 5 alternate). The same products, sums and scaling order as amx_tiles: the same bits. A step's
// 120 int4 linears (weights from memory, 2 threads, AMX Xeon) at 9 rows 13.3-13.7 -> 9.6-10.1 ms, 16 rows 13.3-15.0
// -> 10.2-11.2; from 24 rows on it was 4-20% slower than amx_tiles (two tile loads a product, where 2 x 2 blocks
// load one).
// (the tile intrinsics stringify their tile numbers: a macro, not a template)
#define MII_GROUP_PRODUCT(C, A, B, x0, xstride, w, g, cpg)          \
  do {                                                              \
    _tile_zero(C);                                                  \
    for (int64_t ch_ = (g) * (cpg); ch_ < ((g) + 1) * (cpg); ++ch_) { \
      _tile_loadd(A, (x0) + ch_ * 16, xstride);                     \
      _tile_loadd(B, (w) + ch_ * 16, 64);                           \
      _tile_dpbf16ps(C, A, B);                                      \
    }                                                               \
  } while (0)

void amx_tiles16(const XPairs& X, int64_t M, int64_t K, const Layout& L, const Tiles& T, int64_t nt, float* y,
                 at::BFloat16* yb, int64_t N, int64_t n0, const uint8_t* ahead, int64_t ahead_bytes) {
  const int64_t cpg = L.G / 32, Mp = (M + 15) / 16 * 16, xstride = K / 2 * 4, G = L.groups;
  alignas(64) float part[2][256];
  Ahead next(ahead, ahead_bytes, nt * (Mp / 16) * G);
  for (int64_t t = 0; t < nt; ++t) {
    const __m512i* w = T.data + t * T.stride;
    const float* sw = T.sw + t * T.sstride;
    const float* mw = T.mw + t * T.sstride;
    const int64_t n = n0 + t * 16;
    const __mmask16 valid = N - n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (N - n)) - 1);
    for (int64_t m0 = 0; m0 < Mp; m0 += 16) {
      const int32_t* x0 = &X.q[m0 * (K / 2)];
      const float* gs = &X.gsum[m0 * X.groups];
      __m512 acc[16];
      MII_GROUP_PRODUCT(0, 2, 4, x0, xstride, w, 0, cpg);
      for (int64_t g = 0; g < G; ++g) {
        next.step();
        if (g % 2 == 0) {
          if (g + 1 < G) MII_GROUP_PRODUCT(1, 3, 5, x0, xstride, w, g + 1, cpg);
          _tile_stored(0, part[0], 64);
        } else {
          if (g + 1 < G) MII_GROUP_PRODUCT(0, 2, 4, x0, xstride, w, g + 1, cpg);
          _tile_stored(1, part[1], 64);
        }
        const float* pp = part[g % 2];
        const __m512 sv = _mm512_loadu_ps(sw + g * 16), mv = _mm512_loadu_ps(mw + g * 16);
        for (int r = 0; r < 16; ++r) {
          const __m512 pv = _mm512_load_ps(pp + 16 * r);
          acc[r] = g ? _mm512_fmadd_ps(pv, sv, acc[r]) : _mm512_mul_ps(pv, sv);
          if (L.int4) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(gs[r * X.groups + g]), acc[r]);
        }
      }
      for (int r = 0; r < 16 && m0 + r < M; ++r) store_sums(y, yb, (m0 + r) * N + n, valid, acc[r]);
    }
  }
}

#endif

// y: fp32 [M, N]; yb: bf16 instead, on the AMX path only (bf16 x on a CPU with AMX)
void vnni_gemm(const at::Tensor& x, const uint8_t* w, const Layout& L, float* y, bool act8,
               at::BFloat16* yb = nullptr) {
  const int64_t M = x.size(0), N = L.N(), K = L.K();
#if defined(MII_QBF16) && defined(MII_AMX)
  const bool amx = XPairs::takes_bf16(x, act8 && L.int4) && mii_vec::amx_usable();
  const bool rounded = amx && bf16_tiles_chosen();  // (MII_QUANT_TILES=bf16: amx_rounded)
  const XPairs X(x, L.G, act8 && L.int4, amx ? (M + 31) / 32 * 32 : M);  // AMX: whole tiles of 32 rows
#else
  const XPairs X(x, L.G, act8 && L.int4, M);
#endif
  TORCH_CHECK(!yb || X.bf16, "linear_quant: bf16 output is written for bf16 x only");
  // tasks of kVnniTiles 16-row tiles, taken one at a time from a shared counter: threads that run at different
  // speeds (a shared machine) end together, where even shares of the tiles left one waiting at the barrier
  const int64_t tiles = (N + 15) / 16;
  // (or half as many, where that evens out the threads' shares: a [576, K] weight's 36 tiles as 18 tasks, not 9)
  const int64_t per_task = mii_vec::balanced_share(tiles, at::get_num_threads(), kVnniTiles);
  const int64_t tasks = (tiles + per_task - 1) / per_task;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tasks);
  std::atomic<int64_t> next_task{0};
  mii_team::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    // per thread, kept between calls: freed, glibc would hand the pages back and fault them in again every call
    thread_local std::vector<__m512i> data;
    thread_local std::vector<float> sw, mw;
    data.resize(std::max<size_t>(data.size(), kVnniTiles * K / 2));
    sw.resize(std::max<size_t>(sw.size(), kVnniTiles * L.groups * 16));
    mw.resize(sw.size());
    const Tiles T{data.data(), sw.data(), mw.data(), K / 2, L.groups * 16};
#if defined(MII_QBF16) && defined(MII_AMX)
    if (amx) mii_vec::amx_configure();
#endif
    // a thread claims its next task as it starts one (amx_tiles prefetches its weights)
    for (int64_t task = next_task.fetch_add(1, std::memory_order_relaxed), upcoming; task < tasks; task = upcoming) {
      upcoming = next_task.fetch_add(1, std::memory_order_relaxed);
      const int64_t t0 = task * per_task, nt = std::min(per_task, tiles - t0);
      // the next task's weight bytes, brought into L2 over this task's blocks
      const int64_t p_next = upcoming * per_task * 8, pair_bytes = L.groups * L.block;
      const int64_t next_bytes =
          upcoming < tasks ? (std::min(p_next + per_task * 8, L.pairs) - p_next) * pair_bytes : 0;
      const uint8_t* next_w = next_bytes ? w + p_next * pair_bytes : nullptr;
#if defined(MII_QBF16) && defined(MII_AMX)
      for (int64_t t = 0; t < nt; ++t) unpack_tile(w, L, (t0 + t) * 8, X.bf16, T, t, rounded, X.bytes);
      if (amx) {
        if (rounded) {
          amx_rounded(X, M, K, T, nt, y, yb, N, t0 * 16, next_w, next_bytes);
          continue;
        }
        (M <= 16 ? amx_tiles16 : amx_tiles)(X, M, K, L, T, nt, y, yb, N, t0 * 16,
                                            next_w, next_bytes);
        continue;
      }
#else
      for (int64_t t = 0; t < nt; ++t) unpack_tile(w, L, (t0 + t) * 8, X.bf16, T, t, false, X.bytes);
#endif
      if (X.bytes) {
        int_tiles<true>(X, M, K, L, T, nt, y, N, t0 * 16, next_w, next_bytes);
        continue;
      }
#ifdef MII_QBF16
      if (X.bf16) {
        bf16_tiles(X, M, K, L, T, nt, y, yb, N, t0 * 16, next_w, next_bytes);
        continue;
      }
#endif
      int_tiles<false>(X, M, K, L, T, nt, y, N, t0 * 16, next_w, next_bytes);
    }
#if defined(MII_QBF16) && defined(MII_AMX)
    if (amx) _tile_release();
#endif
  });
}
#endif  // MII_QVNNI

#ifdef MII_QBF16
// --- 5-16 rows of bf16 x: each chunk of a 16-row tile unpacked once, in registers, for every row -----------------
// The decode kernels (int4_rows_pairs, int8_rows_pairs) multiply every row of x by a pair's bytes as they lie (int4:
// four `vpdpbusd` on x's int16 bytes) and scale each chunk's sums a row at a time: int4 ~9 instructions a row for
// 128 weights, so that from 4 rows on a decode step's 120 int4 linears grow by ~1.2 ms a row here. Instead, a tile's
// 16 rows are unpacked once per chunk (unpack_int4 / unpack_int8, the tiles' unpacking: int4 ~100 cycles for 512
// weights) into 16 word-pair vectors that every row of x takes with one `vdpbf16ps` each (x's pair broadcast), and
// each group's sums are scaled once for the tile's 16 rows: ~4.5 instructions a row for 128 weights. bf16_block's
// arithmetic in its order (bf16 x exact, the integers exact, a group's fp32 sums times the weight scale, plus int4's
// offset times sum(x)), without its tiles held in L2 for many rows. The next tile's bytes are brought into L2 over
// this one's groups (a tile's 8 pairs are 8 streams pair_bytes apart). Measured: see kRowsTileMinRows.
template <int R, typename Out>
__attribute__((noinline)) void rows_tile(const XPairs& X, const Layout& L, const uint8_t* w, int64_t p0, Out* y,
                                         int64_t N, const uint8_t* next, int64_t next_bytes) {
  const int64_t K = L.K(), pair_bytes = L.groups * L.block, cpg = L.G / 32, np = std::min<int64_t>(8, L.pairs - p0);
  Ahead ahead(next, next_bytes, L.groups);
  __m512 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < L.groups; ++g) {
    ahead.step();
    const uint8_t* blk[8];
    for (int p = 0; p < 8; ++p) blk[p] = p < np ? w + (p0 + p) * pair_bytes + g * L.block : nullptr;
    __m512 sv, mv;
    tile_headers(blk, np, L.int4, sv, mv);
    if (L.int4) mv = _mm512_sub_ps(mv, _mm512_mul_ps(_mm512_set1_ps(128.f), sv));  // the unpacked integers: 128 + q
    __m512 part[R];  // the group's sums
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) part[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < cpg; ++c) {
      const uint8_t* src[8];
      for (int p = 0; p < 8; ++p) src[p] = blk[p] ? blk[p] + 8 + c * 32 : nullptr;
      alignas(64) __m512i unpacked[16];
      if (L.int4) unpack_int4(src, true, unpacked);
      else unpack_int8(blk, L, c, true, unpacked);
      const int64_t ch = g * cpg + c;
#pragma GCC unroll 16
      for (int b = 0; b < 16; ++b) {
        const __m512i wv = _mm512_load_si512(unpacked + b);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) dot_at(part[r], wv, &X.q[r * (K / 2) + ch * 16 + b]);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(part[r], sv, acc[r]);
      if (L.int4) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(X.gsum[r * X.groups + g]), acc[r]);
    }
  }
  const int64_t n = 2 * p0;
  const __mmask16 valid = N - n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (N - n)) - 1);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    if constexpr (std::is_same_v<Out, float>) _mm512_mask_storeu_ps(y + r * N + n, valid, acc[r]);
    else _mm256_mask_storeu_epi16(y + r * N + n, valid, mii_vec::bf16_round(acc[r]));
  }
}

// whether vnni_gemm multiplies bf16 x with AMX (a CPU with AMX, MII_AMX not 0)
inline bool amx_runs() {
#ifdef MII_AMX
  return mii_vec::amx_usable();
#else
  return false;
#endif
}

// R rows of bf16 x through rows_tile, a thread's tiles in turn
template <int R, typename Out>
void rows_tiles(const at::BFloat16* x, const uint8_t* w, const Layout& L, Out* y) {
  const XPairs X(x, R, L.K(), L.G);
  const int64_t tiles = (L.N() + 15) / 16, tile_bytes = 8 * L.groups * L.block;
  mii_team::parallel_for(0, tiles, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t next_bytes = t + 1 < e ? std::min<int64_t>(8, L.pairs - 8 * (t + 1)) * tile_bytes / 8 : 0;
      rows_tile<R>(X, L, w, 8 * t, y, L.N(), w + (t + 1) * tile_bytes, next_bytes);
    }
  });
}

#endif

#ifdef MII_QVNNI
// whether rows_tile takes M rows of bf16 x: from kRowsTileMinRows rows, not with act8, nor where AMX runs (the AMX
// Xeon keeps the decode kernels up to 8 rows and AMX's tiles from 9, as measured there; rows_tile was not)
inline bool rows_tile_takes(int64_t M, const Layout& L, bool act8) {
#ifdef MII_QBF16
  return (!L.int4 || !act8) && M >= kRowsTileMinRows && M <= kRowsTileMaxRows && !amx_runs();
#else
  return false;
#endif
}

// whether few_rows takes M rows of bf16 x (else vnni_gemm does)
inline bool few_rows_take(int64_t M, const Layout& L, bool act8) {
  return (M >= 1 && M < kTileMinRows) || rows_tile_takes(M, L, act8);
}

// rows of x few_rows_take takes (fp32 x: 1-8): rows_tile, or the decode kernels
template <typename T, typename Out>
void few_rows(const T* x, int64_t M, const uint8_t* w, const Layout& L, Out* y, bool act8) {
#ifdef MII_QBF16
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (rows_tile_takes(M, L, act8)) {
      switch (M) {
        case 5: return rows_tiles<5>(x, w, L, y);
        case 6: return rows_tiles<6>(x, w, L, y);
        case 7: return rows_tiles<7>(x, w, L, y);
        case 8: return rows_tiles<8>(x, w, L, y);
        case 9: return rows_tiles<9>(x, w, L, y);
        case 10: return rows_tiles<10>(x, w, L, y);
        case 11: return rows_tiles<11>(x, w, L, y);
        case 12: return rows_tiles<12>(x, w, L, y);
        case 13: return rows_tiles<13>(x, w, L, y);
        case 14: return rows_tiles<14>(x, w, L, y);
        case 15: return rows_tiles<15>(x, w, L, y);
        default: return rows_tiles<16>(x, w, L, y);
      }
    }
  }
#endif
  decode_any(x, M, w, L, y, act8);
}
#endif

// Blocks of kGemmPairs row pairs in parallel: dequantize into a per-task buffer, then y[:, block] = x @ block.T.
void blocked_gemm(const at::Tensor& x, const uint8_t* w, const Layout& L, at::Tensor& y) {
  const int64_t threads = at::get_num_threads(), K = L.K();
  const int64_t blocks = ((L.pairs + kGemmPairs - 1) / kGemmPairs + threads - 1) / threads * threads;
  const int64_t pairs = (L.pairs + blocks - 1) / blocks;
  const bool inference = c10::InferenceMode::is_enabled();  // OpenMP threads do not inherit it
  mii_team::parallel_for(0, blocks, 1, [&](int64_t b, int64_t e) {
    c10::InferenceMode guard(inference);
    std::vector<float> buf(2 * pairs * K);
    auto wt = at::from_blob(buf.data(), {2 * pairs, K}, at::TensorOptions().dtype(at::kFloat));
    for (int64_t blk = b; blk < e; ++blk) {
      const int64_t p0 = blk * pairs, np = std::min(pairs, L.pairs - p0);
      if (np <= 0) continue;
      dequant_pairs(w, L, p0, np, buf.data());
      auto out = y.narrow(1, 2 * p0, 2 * np);
      at::mm_out(out, x, wt.narrow(0, 0, 2 * np).t());
    }
  });
}

}  // namespace

// M = 1-8 bf16 rows x [M, K] through a packed weight [N rows, K] (contiguous) plus a bias (bf16 [N], or none) into
// y [M, N], bf16: linear_quant_cpu's decode rows without its tensors (mii::decoder_stack's few-row steps), the same
// values (bf16 x widened exactly; y rounded as linear_output rounds, the bias added to the fp32 sums first). False
// where this CPU has no such path; x == nullptr: only whether it would take the weight (its shape checked).
bool linear_quant_rows(const at::BFloat16* x, int64_t M, int64_t K, const at::Tensor& weight, const at::BFloat16* bias,
                       at::BFloat16* y, int64_t N, bool act8) {
#ifdef MII_QVNNI
  const Layout L = layout_of(weight);
  TORCH_CHECK(L.N() == N && L.K() == K && weight.is_contiguous(), "decoder_stack: a weight of ", L.N(), " x ", L.K(),
              " where ", N, " x ", K, " was expected");
  if (x == nullptr) return true;
  const auto* wp = static_cast<const uint8_t*>(weight.data_ptr());
  if (bias == nullptr) {
    few_rows(x, M, wp, L, y, act8);
  } else {
    float* acc = reused<float, 3>(M * N);
    few_rows(x, M, wp, L, acc, act8);
    mii_vec::round_rows(acc, bias, y, M, N);
  }
  return true;
#else
  return false;
#endif
}

at::Tensor linear_quant_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                            bool act8) {
  const Layout L = layout_of(weight);
  const int64_t N = L.N(), K = L.K();
  TORCH_CHECK(x.size(-1) == K, "linear_quant: x has ", x.size(-1), " features, the weight ", K);
  const at::Tensor x2 = x.reshape({-1, K});
  const int64_t M = x2.size(0);
  const at::Tensor w = weight.is_contiguous() ? weight : weight.contiguous();
  const auto* wp = static_cast<const uint8_t*>(w.data_ptr());
#ifdef MII_QVNNI
  // 1-8 bf16 rows without a bias (decode; up to kRowsTileMaxRows through rows_tile): y written in bf16 by the kernel,
  // no fp32 copy of x or y (the LM head of 2-8 streams: 8 streams' int4 steps ~1% faster, alternated; 4 even)
  if (few_rows_take(M, L, act8) && N > 0 && x2.scalar_type() == at::kBFloat16 && x2.is_contiguous()
      && !(bias.has_value() && bias->defined())) {
    auto sizes = x.sizes().vec();
    sizes.back() = N;
    at::Tensor out = at::empty(sizes, x.options());
    few_rows(x2.data_ptr<at::BFloat16>(), M, wp, L, out.data_ptr<at::BFloat16>(), act8);
    return out;
  }
#endif
#ifdef MII_QBF16
  // bf16 x through the bf16 tiles (AMX or vdpbf16ps) without a bias: y written in bf16 by the kernel (linear_output's
  // pass over an fp32 copy was 5% of a W64 prompt step with AMX, 2.7% of W64's samples on a Zen 4 EPYC)
  if (M >= kTileMinRows && N > 0 && XPairs::takes_bf16(x2, act8 && L.int4) && !(bias.has_value() && bias->defined())) {
    auto sizes = x.sizes().vec();
    sizes.back() = N;
    at::Tensor out = at::empty(sizes, x.options());
    vnni_gemm(x2.contiguous(), wp, L, nullptr, act8, out.data_ptr<at::BFloat16>());
    return out;
  }
#endif
  auto y = at::empty({M, N}, x2.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return linear_output(y, x, bias);
#ifdef MII_QVNNI
  // few rows (with a bias, or fp32 x): bf16 x read as it is, no fp32 copy (~0.3 µs a row)
  if (x2.scalar_type() == at::kBFloat16 && x2.is_contiguous()) {
    if (few_rows_take(M, L, act8)) {
      few_rows(x2.data_ptr<at::BFloat16>(), M, wp, L, y.data_ptr<float>(), act8);
      return linear_output(y, x, bias);
    }
  } else if (M < kTileMinRows) {
    few_rows(linear_input(x2, K).data_ptr<float>(), M, wp, L, y.data_ptr<float>(), act8);
    return linear_output(y, x, bias);
  }
  // bf16 x is read as it is
  vnni_gemm(x2.scalar_type() == at::kBFloat16 ? x2.contiguous() : linear_input(x2, K), wp, L, y.data_ptr<float>(), act8);
  return linear_output(y, x, bias);
#else
  const at::Tensor xf = linear_input(x2, K);
#ifdef MII_QAVX2
  if (M <= kGemvRows)
    gemv(xf.data_ptr<float>(), M, wp, L, y.data_ptr<float>(), act8);
  else
#endif
    blocked_gemm(L.int4 && act8 ? round_x<int8_t>(xf) : round_x<int16_t>(xf), wp, L, y);
  return linear_output(y, x, bias);
#endif
}

// rows `ids` of a packed weight as fp32 [*ids.shape, K]: the embedding lookup of a tied, quantized LM head, with
// mii/layers/quant.py's dequantize arithmetic (int4_weight, int8_weight). One token's row was ~15 torch ops from
// Python, 0.3 ms of a decode step. dtype bf16: the fp32 values rounded as .to(bf16) rounds them, written so (the
// separate .to took 33-44 us of a single-stream decode step, in caches the weights had just swept).
at::Tensor quant_rows_cpu(const at::Tensor& weight, const at::Tensor& ids, c10::optional<at::ScalarType> dtype) {
  const bool bf16 = dtype.has_value() && *dtype == at::kBFloat16;
  const Layout L = layout_of(weight);
  const int64_t K = L.K(), pair_bytes = L.groups * L.block;
  // (a decode step's ids as they are: each ATen call here costs microseconds in the step's cold caches)
  const bool plain = ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous();
  const at::Tensor w = weight.contiguous(), flat = plain ? ids : ids.reshape(-1).to(at::kLong).contiguous();
  const int64_t T = flat.numel();
  const int64_t* id = flat.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK_INDEX(id[t] >= 0 && id[t] < L.N(), "quant_rows: index ", id[t], " is out of range for ", L.N(), " rows");
  auto out = at::empty({T, K}, weight.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const auto* wp = static_cast<const uint8_t*>(w.data_ptr());
  const auto rows = [&](auto* o) {
    at::parallel_for(0, T, 64, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const uint8_t* pw = wp + (id[t] / 2) * pair_bytes;
        const int row = static_cast<int>(id[t] % 2);
        for (int64_t g = 0; g < L.groups; ++g) {
          const uint8_t* blk = pw + g * L.block;
          auto* dst = o + t * K + g * L.G;
          for (int64_t c = 0; c < L.G; ++c) dst[c] = L.int4 ? int4_weight(blk, L.G, row, c) : int8_weight(blk, L.G, row, c);
        }
      }
    });
  };
  if (bf16) rows(out.data_ptr<at::BFloat16>());
  else rows(out.data_ptr<float>());
  if (ids.dim() != 1) {
    std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
    shape.push_back(K);
    out = out.view(shape);
  }
  return dtype.has_value() && !bf16 && *dtype != at::kFloat ? out.to(*dtype) : out;
}

TORCH_LIBRARY_IMPL(mii, CPU, m) {
  m.impl("linear_quant", &linear_quant_cpu);
  m.impl("quant_rows", &quant_rows_cpu);
}

// mii::tile_block_rows: the rows bf16_block takes at a time on this CPU (4 without AVX512-BF16, where it does not run)
int64_t tile_block_rows_op() {
#ifdef MII_QBF16
  return tile_block_rows();
#else
  return 4;
#endif
}

TORCH_LIBRARY_IMPL(mii, CompositeExplicitAutograd, m) { m.impl("tile_block_rows", &tile_block_rows_op); }
