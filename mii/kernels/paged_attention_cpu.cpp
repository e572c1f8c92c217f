// Paged attention on CPU that reads the KV blocks in place (mii::paged_attention, CPU kernel).
//
// One call per layer and step for a whole ragged batch (decode tokens and prompt chunks together): the step's
// new K/V are written into their cache slots, then every query attends to its sequence's keys through the
// block table, with an online softmax (flash-attention style, fp32 accumulation), causal, GQA, an optional
// sliding window. No gathered copy of the blocks, no [S, L] mask. Work items are (sequence, kv head, tile of
// queries, and for a decode row, part of the keys: see kSplitKeys); the query heads that share a kv head are
// processed together, so each key row is loaded once for all of them, and the blocks ahead are prefetched while a
// block is computed (a thread claims its next item as it starts one, so that this runs across items too).
// The cache is head-major, [blocks, kv_heads, block_size, d]: one kv head's keys of a block are one contiguous
// run (4-8 KB) that the hardware prefetcher streams, where slot-major blocks made them 128-256-byte rows strided
// by all the heads' (a single-stream decode step's attention: 28% less thread time, fp32). It may hold bf16 (or
// fp16) under fp32 queries (the plan's KV dtype: half the bytes a step reads), widened once per block. bf16
// queries on a bf16 cache, on CPUs with AVX512-BF16 and head sizes 64/128, read the blocks as they are (see
// scores_bf16): decode attention of 64 sequences x ~400 keys 1.6-1.8x faster than through the widened copies,
// and prompt chunks of every length too (faster there than ATen's SDPA: see kPromptChunk), their keys a span of 256
// at a time (prompt_item_bf16, or prompt_item_amx on CPUs with AMX).
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "team.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include "bf16_vec.h"
#define MII_ATTN_AVX2 1
#endif

namespace {

constexpr int kQueryTile = 16;  // query tokens per work item (prompt chunks)
constexpr int kMaxRows = 128;   // query tokens x heads per kv head in one tile
// built with -ffast-math (vectorized exp and reductions): no infinities anywhere, a finite "minus infinity"
constexpr float kNegBig = -1e30f;
// prompt chunks of at least this many tokens go through a contiguous copy of their sequence's K/V and ATen's
// flash attention (GEMM-based: ~3x this file's fp32 loop at 256+ queries); the copy is O(keys), the work O(queries
// x keys). Not where the loop reads bf16 blocks in place (in_place_bf16): there it is 1.4-2.4x ATen's path at
// every chunk size measured (Zen 4, 2 threads, 30 layers: 128 x 128 keys 17.9 -> 7.6 ms, 256 x 512 89.5 -> 62.0).
constexpr int kPromptChunk = 16;
// a decode row's keys are split into parts of this many (whole blocks), each part its own work item, combined by
// the last one to finish (flash-decoding): one sequence's kv heads alone are too few items for the threads (3 for
// SmolLM2), and a part's keys are read by the thread that computes them. The parts depend on the sequence alone,
// not on the batch around it, so a row's result does not either. Each part ends with a locked hand-off (the
// counter below) and its rows' combination: at 128 keys a part, those took ~20% of a 64-row decode step's attention.
constexpr int64_t kSplitKeys = 256;

template <typename T> inline float to_f(T x) { return static_cast<float>(x); }

// a row of `d` values of type T as float
template <typename T> inline void load_row(const T* src, float* dst, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = to_f(src[i]);
}
template <> inline void load_row<float>(const float* src, float* dst, int64_t d) {
  std::memcpy(dst, src, d * sizeof(float));
}
template <> inline void load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t d) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  int64_t i = 0;
#ifdef MII_ATTN_AVX2
  for (; i + 8 <= d; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
#endif
  uint32_t* o = reinterpret_cast<uint32_t*>(dst);
  for (; i < d; ++i) o[i] = static_cast<uint32_t>(s[i]) << 16;
}

// The two inner loops of a row against one block of keys, over float rows (the fp32 cache in place, or a block
// converted once). With AVX2 and d a multiple of 8: scores 8 keys at a time, their 8 partial sums reduced
// together by a tree of horizontal adds (one reduction per key costs as much as its dot product at d = 64), and
// the weighted sum of values with the row's accumulator held in registers 64 columns at a time. Otherwise the
// plain loops, which the compiler vectorizes less well.
inline void scores(const float* q, const float* k, int64_t stride, int64_t d, int64_t first, int64_t last,
                   float* out) {
  int64_t j = first;
#ifdef MII_ATTN_AVX2
  if (d % 8 == 0) {
    for (; j + 8 <= last; j += 8) {
      __m256 a[8];
      for (int u = 0; u < 8; ++u) a[u] = _mm256_setzero_ps();
      for (int64_t e = 0; e < d; e += 8) {
        const __m256 qv = _mm256_loadu_ps(q + e);
        for (int u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + (j + u) * stride + e), a[u]);
      }
      const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
      const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
      _mm256_storeu_ps(out + j, _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31)));
    }
  }
#endif
  for (; j < last; ++j) {
    const float* kj = k + j * stride;
    float dot = 0.f;
    for (int64_t e = 0; e < d; ++e) dot += q[e] * kj[e];
    out[j] = dot;
  }
}

#ifdef MII_ATTN_AVX2
template <int NV>  // acc[0, 8 NV) += sum_j p[j] v[j][0, 8 NV)
inline void weigh_values(float* acc, const float* p, const float* v, int64_t stride, int64_t first, int64_t last) {
  __m256 a[NV];
  for (int u = 0; u < NV; ++u) a[u] = _mm256_loadu_ps(acc + 8 * u);
  for (int64_t j = first; j < last; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    for (int u = 0; u < NV; ++u) a[u] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + j * stride + 8 * u), a[u]);
  }
  for (int u = 0; u < NV; ++u) _mm256_storeu_ps(acc + 8 * u, a[u]);
}
#endif

inline void values(float* acc, const float* p, const float* v, int64_t stride, int64_t d, int64_t first,
                   int64_t last) {
#ifdef MII_ATTN_AVX2
  if (d % 8 == 0) {
    for (int64_t e = 0; e < d; e += 64) {
      switch (std::min<int64_t>(8, (d - e) / 8)) {
        case 8: weigh_values<8>(acc + e, p, v + e, stride, first, last); break;
        case 7: weigh_values<7>(acc + e, p, v + e, stride, first, last); break;
        case 6: weigh_values<6>(acc + e, p, v + e, stride, first, last); break;
        case 5: weigh_values<5>(acc + e, p, v + e, stride, first, last); break;
        case 4: weigh_values<4>(acc + e, p, v + e, stride, first, last); break;
        case 3: weigh_values<3>(acc + e, p, v + e, stride, first, last); break;
        case 2: weigh_values<2>(acc + e, p, v + e, stride, first, last); break;
        default: weigh_values<1>(acc + e, p, v + e, stride, first, last);
      }
    }
    return;
  }
#endif
  for (int64_t j = first; j < last; ++j) {
    const float pj = p[j];
    const float* vj = v + j * stride;
    for (int64_t e = 0; e < d; ++e) acc[e] += pj * vj[e];
  }
}

// The accumulators of the in-place loop hold a row's D values permuted within each run of 32: a bf16 row's 32
// values in one 512-bit load widen to fp32 by one shift (the even ones: each 32-bit lane's low half moved up) and
// one mask (the odd ones: its high half), two instructions for 32 values where a zero-extension per 16 and a shift
// took four. Position 32h + i holds value 32h + 2i, position 32h + 16 + i value 32h + 2i + 1 (i < 16). Everything
// else on the accumulators is per value (the softmax's rescaling, combining a decode row's parts), so only writing
// the output reads them through this map.
inline int64_t acc_value(int64_t pos) { return (pos & ~int64_t(31)) + 2 * (pos & 15) + ((pos >> 4) & 1); }

// Prompt items take their keys a span at a time (prompt_item_amx, prompt_item_bf16): kSpanKeys keys (whole blocks),
// spans starting at multiples of it from the sequence's first key, so that a row's arithmetic does not depend on
// the rows beside it
constexpr int64_t kSpanKeys = 256;
// keys per span for blocks of B keys: whole blocks, kSpanKeys or the one block
inline int64_t span_keys(int64_t B) { return std::max<int64_t>(B, kSpanKeys / B * B); }
// a span's width in its buffers: its keys rounded up to whole tile steps of 32
inline int64_t span_width(int64_t B) { return (span_keys(B) + 31) / 32 * 32; }

#if defined(MII_ATTN_AVX2) && defined(__AVX512F__) && defined(__AVX512BF16__)
#define MII_ATTN_BF16 1
// bf16 queries on a bf16 cache (the plan's case on CPUs with native bf16): the keys' rows are multiplied in place by
// `vdpbf16ps` (bf16 x bf16 products are exact in fp32; 16 keys' sums reduced together by one transpose of
// shuffles), and the values' rows widened in registers for fp32 FMAs: no block converted to a buffer first (that
// conversion was ~40% of the loop), 512-bit vectors. The softmax, the weights and the fp32 accumulation are the
// generic loop's.

// 16 vectors -> one: lane u = the sum of a[u]'s 16 lanes (a 16 x 16 transpose, adding as it goes)
__attribute__((always_inline)) inline __m512 sum16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128 bits: keys 4i .. 4i+3
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

// q . k for n <= 16 keys of D bf16 values each (k: the first one's row), lane u = key u's sum (0 from n on)
template <int D, bool Full>
__attribute__((always_inline)) inline __m512 dots16(const __m512bh* qv, const uint16_t* k, int n) {
  __m512 a[16];
  for (int u = 0; u < 16; ++u) {
    a[u] = _mm512_setzero_ps();
    if (Full || u < n)
      for (int c = 0; c < D / 32; ++c)
        a[u] = _mm512_dpbf16_ps(a[u], (__m512bh)_mm512_loadu_si512(k + u * D + 32 * c), qv[c]);
  }
  return sum16(a);
}

// out[j] = scale * q . k[j] for keys [first, last) of one kv head's rows in a block (D bf16 values each)
template <int D>
inline void scores_bf16(const uint16_t* q, const uint16_t* k, int64_t first, int64_t last, float scale, float* out) {
  constexpr int C = D / 32;  // 32 bf16 a vector
  __m512bh qv[C];
  for (int c = 0; c < C; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t j = first; j < last; j += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, last - j));
    const __m512 sj = _mm512_mul_ps(dots16<D, false>(qv, k + j * D, n), sv);
    if (n == 16) _mm512_storeu_ps(out + j, sj);  // (a masked store is not forwarded to the softmax's loads)
    else _mm512_mask_storeu_ps(out + j, static_cast<__mmask16>((1u << n) - 1), sj);
  }
}

// Where rows meet a block's keys in place as bf16 (in_place_bf16, block sizes that are a multiple of 16), the cache
// holds each kv head's keys of a block as pairs of values (keys_paired): 16-key group g's vector i (64 bytes), lane
// u = key 16g + u's values 2i and 2i + 1, so that `vdpbf16ps` of a broadcast pair of a query's values gives 16
// keys' sums in their own lanes: no reduction per key (sum16: 45 shuffles and adds per row and 16 keys), and 16 of
// its vectors are an AMX B tile as they lie. The keys are laid out once, as they are written (write_cache), where
// a prompt tile transposed each block it read (keys_as_pairs) and a decode row reduced each key's sums. Lanes of
// keys not yet written hold zeros or an earlier sequence's keys: their sums land in their own lanes, which no row
// reads.
// out[r * ostride + j] = scale * q_r . k[j] for R rows and every key j < 16 * groups (kt: paired keys), two groups at
// a time and each group's pairs split by parity (4R independent sums); the caller masks what a row does not see
template <int D, int R>
inline void scores_rows_bf16(const uint16_t* const* q, const __m512i* kt, int64_t groups, float scale, float* out,
                             int64_t ostride) {
  constexpr int P = D / 2;
  const __m512 sv = _mm512_set1_ps(scale);
  const int32_t* qp[R];
  for (int r = 0; r < R; ++r) qp[r] = reinterpret_cast<const int32_t*>(q[r]);
  for (int64_t g = 0; g < groups; g += 2) {
    const bool two = g + 1 < groups;  // (past the last group: another head's keys, or the cache's end)
    __m512 a[R][2][2];
    for (int r = 0; r < R; ++r) a[r][0][0] = a[r][0][1] = a[r][1][0] = a[r][1][1] = _mm512_setzero_ps();
    for (int i = 0; i < P; i += 2)
      for (int e = 0; e < 2; ++e) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(kt + g * P + i + e);
        const __m512bh w1 =
            two ? (__m512bh)_mm512_loadu_si512(kt + (g + 1) * P + i + e) : (__m512bh)_mm512_setzero_si512();
        for (int r = 0; r < R; ++r) {
          const __m512bh x = (__m512bh)_mm512_set1_epi32(qp[r][i + e]);
          a[r][0][e] = _mm512_dpbf16_ps(a[r][0][e], w0, x);
          a[r][1][e] = _mm512_dpbf16_ps(a[r][1][e], w1, x);
        }
      }
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(out + r * ostride + 16 * g, _mm512_mul_ps(_mm512_add_ps(a[r][0][0], a[r][0][1]), sv));
      if (two)
        _mm512_storeu_ps(out + r * ostride + 16 * (g + 1), _mm512_mul_ps(_mm512_add_ps(a[r][1][0], a[r][1][1]), sv));
    }
  }
}

template <int D>
inline void scores_tile_bf16(const uint16_t* const* q, int64_t rows, const __m512i* kt, int64_t groups, float scale,
                             float* out, int64_t ostride) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) scores_rows_bf16<D, 4>(q + r, kt, groups, scale, out + r * ostride, ostride);
  switch (rows - r) {
    case 3: scores_rows_bf16<D, 3>(q + r, kt, groups, scale, out + r * ostride, ostride); break;
    case 2: scores_rows_bf16<D, 2>(q + r, kt, groups, scale, out + r * ostride, ostride); break;
    case 1: scores_rows_bf16<D, 1>(q + r, kt, groups, scale, out + r * ostride, ostride); break;
  }
}

#ifdef __AVX512VNNI__
#define MII_ATTN_Q8 1
// An int8 KV cache (kv_cache_dtype="int8": half a bf16 cache's bytes, twice its tokens), under bf16 queries. Each kv
// head's run in a block holds B rows of d int8 values, then the rows' B fp32 scales (quantize: a row's values
// round(x * (127 / max|x|)), its scale max|x| * (1 / 127); so the cache is [blocks, kv_heads, B, d + 4] bytes). Keys
// as quads of values offset by 128 (16-key group g's vector i, lane u: key 16g + u's values 4i .. 4i + 3 as u8),
// so that `vpdpbusd` against a broadcast quad of a query row quantized the same way gives 16 keys' integer dot
// products in their own lanes, exact (the offset's 128 times the row's sum is taken off); values as rows in the
// accumulators' order (byte 32h + i holds value 32h + 2i, byte 32h + 16 + i value 32h + 2i + 1: see acc_value),
// widened 16 at a time, their scales folded into the softmax's weights.

// a row's scale is max|x| times this (what -ffast-math makes of max|x| / 127 anyway: written so, torch can match it)
constexpr float kInv127 = 1.f / 127.f;

// a row of d <= 128 values (T: float, or bf16 as uint16_t bits) as int8: q[e] = round(x[e] * (127 / max|x|)), to
// nearest even, and (sum) their sum; returns the row's scale, max|x| * (1 / 127). The cache's keys and values and
// the queries alike.
template <typename T, typename Q>
inline float quantize(const T* row, int64_t d, Q* q, int32_t* sum = nullptr) {
  float x[128], mx = 0.f;
  for (int64_t e = 0; e < d; ++e) {
    if constexpr (std::is_same_v<T, uint16_t>) {
      const uint32_t bits = static_cast<uint32_t>(row[e]) << 16;
      std::memcpy(&x[e], &bits, 4);
    } else {
      x[e] = static_cast<float>(row[e]);
    }
    mx = std::max(mx, std::fabs(x[e]));
  }
  const float inv = mx > 0.f ? 127.f / mx : 0.f;
  int32_t total = 0;
  for (int64_t e = 0; e < d; ++e) {
    const int v = static_cast<int>(std::nearbyint(x[e] * inv));
    q[e] = static_cast<Q>(v);
    total += v;
  }
  if (sum) *sum = total;
  return mx * kInv127;
}

// what the int8 loops read of a step and a block: the rows' quantized queries (q8 [rows, D]), their sums and
// scales (times the attention's scale), and the block's key and value scales
struct Q8Block {
  const int8_t* q8;
  const int32_t* qsum;
  const float* qscale;
  const float* ks;
  const float* vs;
};

// out[r * ostride + j] = row r's score of key j < 16 * groups (kt: the block's keys as quads; ks: their scales),
// two groups at a time and each group's quads split by parity (4R independent sums)
template <int D, int R>
inline void scores_rows_q8(const Q8Block& b, int64_t r0, const __m512i* kt, const float* ks, int64_t groups,
                           float* out, int64_t ostride) {
  constexpr int Q = D / 4;
  const int32_t* qp[R];
  for (int r = 0; r < R; ++r) qp[r] = reinterpret_cast<const int32_t*>(b.q8 + (r0 + r) * D);
  for (int64_t g = 0; g < groups; g += 2) {
    const bool two = g + 1 < groups;
    __m512i a[R][2][2];
    for (int r = 0; r < R; ++r)
      a[r][0][0] = a[r][0][1] = a[r][1][0] = a[r][1][1] = _mm512_setzero_si512();
    for (int i = 0; i < Q; i += 2)
      for (int e = 0; e < 2; ++e) {
        const __m512i w0 = _mm512_loadu_si512(kt + g * Q + i + e);
        const __m512i w1 = two ? _mm512_loadu_si512(kt + (g + 1) * Q + i + e) : _mm512_setzero_si512();
        for (int r = 0; r < R; ++r) {
          const __m512i x = _mm512_set1_epi32(qp[r][i + e]);
          a[r][0][e] = _mm512_dpbusd_epi32(a[r][0][e], w0, x);
          a[r][1][e] = _mm512_dpbusd_epi32(a[r][1][e], w1, x);
        }
      }
    for (int r = 0; r < R; ++r) {
      const __m512i off = _mm512_set1_epi32(128 * b.qsum[r0 + r]);
      const __m512 sv = _mm512_set1_ps(b.qscale[r0 + r]);
      for (int h = 0; h < (two ? 2 : 1); ++h) {
        const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(a[r][h][0], a[r][h][1]), off);
        const __m512 sc = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), sv), _mm512_loadu_ps(ks + 16 * (g + h)));
        _mm512_storeu_ps(out + r * ostride + 16 * (g + h), sc);
      }
    }
  }
}

template <int D>
inline void scores_tile_q8(const Q8Block& b, int64_t rows, const __m512i* kt, const float* ks, int64_t groups,
                           float* out, int64_t ostride) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) scores_rows_q8<D, 4>(b, r, kt, ks, groups, out + r * ostride, ostride);
  switch (rows - r) {
    case 3: scores_rows_q8<D, 3>(b, r, kt, ks, groups, out + r * ostride, ostride); break;
    case 2: scores_rows_q8<D, 2>(b, r, kt, ks, groups, out + r * ostride, ostride); break;
    case 1: scores_rows_q8<D, 1>(b, r, kt, ks, groups, out + r * ostride, ostride); break;
  }
}
#endif

// one key's 16 C bf16 values -> vv (fp32, in the accumulators' order: one shift and one mask per 32 values)
template <int C>
__attribute__((always_inline)) inline void widen_bf16(const uint16_t* v, __m512* vv) {
  const __m512i odd = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int c = 0; c < C; c += 2) {
    const __m512i x = _mm512_loadu_si512(v + 16 * c);
    vv[c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    vv[c + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, odd));
  }
}

// a[r] += p[r][j] * vv for R rows (the weights p[r * pstride + j])
template <int R, int C>
__attribute__((always_inline)) inline void add_weighted(__m512 (&a)[R][C], const __m512* vv, const float* p,
                                                        int64_t pstride, int64_t j) {
  for (int r = 0; r < R; ++r) {
    const __m512 pj = _mm512_set1_ps(p[r * pstride + j]);
    for (int c = 0; c < C; ++c) a[r][c] = _mm512_fmadd_ps(pj, vv[c], a[r][c]);
  }
}

// acc rows 0 .. R-1 (D floats each, permuted as above) += sum_j p[r][j] v[j] over keys [lo, hi) (p is zero where a
// row does not see a key), each value widened once for the R rows. E: the values' type, bf16 (uint16_t) or int8
// (an int8 cache's rows, stored in the accumulators' order: 16 bytes widen to 16 of its positions; p carries the
// rows' scales)
template <int D, int R, typename E = uint16_t>
inline void values_bf16(float* acc, const float* p, int64_t pstride, const E* v, int64_t lo, int64_t hi,
                        const E* pk = nullptr, const E* pv = nullptr, const float* rescale = nullptr) {
  constexpr int C = D / 16;
  __m512 a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      a[r][c] = _mm512_loadu_ps(acc + r * D + 16 * c);
      if (rescale) a[r][c] = _mm512_mul_ps(a[r][c], _mm512_set1_ps(rescale[r]));  // (softmax_step's ar[e] *= c)
    }
  for (int64_t j = lo; j < hi; ++j) {
    if (pk) {  // key j's rows of a later block: spread over the loop, so that they never fill the miss queues
      for (int e = 0; e < D; e += 64 / sizeof(E)) {
        __builtin_prefetch(pk + j * D + e, 0, 2);
        __builtin_prefetch(pv + j * D + e, 0, 2);
      }
    }
    __m512 vv[C];
    if constexpr (sizeof(E) == 1) {
      for (int c = 0; c < C; ++c)
        vv[c] = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + j * D + 16 * c))));
    } else {
      widen_bf16<C>(reinterpret_cast<const uint16_t*>(v + j * D), vv);
    }
    add_weighted<R, C>(a, vv, p, pstride, j);
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + r * D + 16 * c, a[r][c]);
}

// every row's values, up to kRowsV rows at a time (their accumulators in registers); pk, pv: a later block's keys
// and values, prefetched by the first rows' pass
// (rescale: each row's accumulators times rescale[r] first, or nullptr)
template <int D, typename E = uint16_t>
inline void values_rows(float* acc, const float* p, int64_t pstride, const E* v, int64_t rows, int64_t lo,
                        int64_t hi, const E* pk, const E* pv, const float* rescale = nullptr) {
  constexpr int kRowsV = D == 64 ? 4 : 2;
  int64_t r = 0;
  const auto c = [&](int64_t r) { return rescale ? rescale + r : nullptr; };
  for (; r + kRowsV <= rows; r += kRowsV, pk = pv = nullptr)
    values_bf16<D, kRowsV, E>(acc + r * D, p + r * pstride, pstride, v, lo, hi, pk, pv, c(r));
  if constexpr (kRowsV == 4) {
    if (rows - r == 3) return values_bf16<D, 3, E>(acc + r * D, p + r * pstride, pstride, v, lo, hi, pk, pv, c(r));
    if (rows - r == 2) return values_bf16<D, 2, E>(acc + r * D, p + r * pstride, pstride, v, lo, hi, pk, pv, c(r));
  }
  if (rows > r) values_bf16<D, 1, E>(acc + r * D, p + r * pstride, pstride, v, lo, hi, pk, pv, c(r));
}

// A decode row against one block: the `rows` query heads of a kv head for one query token, so that every row sees
// the same keys [first, last). The rows' scores: with paired keys (Paired), every row's 16 keys at a time
// (scores_tile_bf16, stored into sc: row r at sc + r * stride, stride >= last rounded up to 16 past first); with
// keys as rows, per row 16 keys' sums reduced together in registers (dots16). Then per row the online softmax 16
// lanes at a time (exp_neg), the weights into sc; then the values of all rows, each row's rescaling folded into its
// accumulators' load. m, l, acc: the rows' running maximum, sum and accumulators (softmax_step's arithmetic up to
// the exp's last bits and the order of the sum).
// An int8 cache's block (E = int8_t, q8: its rows and scales): the rows' scores as integer dot products
// (scores_tile_q8), and the weights stored times the values' scales.
template <int D, bool Paired, typename E = uint16_t>
inline void decode_block(const uint16_t* const* q, int64_t rows, const E* k, const E* v, int64_t first,
                         int64_t last, float scale, float* sc, int64_t stride, float* m, float* l, float* acc,
                         const E* pk, const E* pv, const void* q8 = nullptr) {
  constexpr bool Q8 = sizeof(E) == 1;
  const __m512 sv = _mm512_set1_ps(scale);
  float rescale[kMaxRows];
#ifdef MII_ATTN_Q8
  const Q8Block* qb = static_cast<const Q8Block*>(q8);
  if constexpr (Q8) {
    const int64_t g0 = first / 16;
    scores_tile_q8<D>(*qb, rows, reinterpret_cast<const __m512i*>(k) + g0 * (D / 4), qb->ks + 16 * g0,
                      (last + 15) / 16 - g0, sc + 16 * g0, stride);
  } else
#endif
  if constexpr (Paired) {
    const int64_t g0 = first / 16;
    scores_tile_bf16<D>(q, rows, reinterpret_cast<const __m512i*>(k) + g0 * (D / 2), (last + 15) / 16 - g0, scale,
                        sc + 16 * g0, stride);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = sc + r * stride;
    __m512 mx = _mm512_set1_ps(kNegBig);
    __m512bh qv[D / 32];
    if constexpr (!Paired && !Q8)
      for (int c = 0; c < D / 32; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q[r] + 32 * c);
    for (int64_t j = first; j < last; j += 16) {
      const int n = static_cast<int>(std::min<int64_t>(16, last - j));
      __m512 s;
      if constexpr (Paired || Q8) {
        s = _mm512_loadu_ps(sr + j);
      } else {
        s = _mm512_mul_ps(n == 16 ? dots16<D, true>(qv, k + j * D, 16) : dots16<D, false>(qv, k + j * D, n), sv);
        _mm512_storeu_ps(sr + j, s);
      }
      mx = _mm512_mask_max_ps(mx, static_cast<__mmask16>((1u << n) - 1), mx, s);
    }
    const float top = std::max(m[r], _mm512_reduce_max_ps(mx));
    const __m512 tv = _mm512_set1_ps(top);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = first; j < last; j += 16) {
      const int n = static_cast<int>(std::min<int64_t>(16, last - j));
      const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
      const __m512 p = _mm512_maskz_mov_ps(valid, mii_vec::exp_neg(_mm512_sub_ps(_mm512_loadu_ps(sr + j), tv)));
#ifdef MII_ATTN_Q8
      if constexpr (Q8) _mm512_storeu_ps(sr + j, _mm512_mul_ps(p, _mm512_maskz_loadu_ps(valid, qb->vs + j)));
      else
#endif
      _mm512_storeu_ps(sr + j, p);
      sum = _mm512_add_ps(sum, p);
    }
    rescale[r] = std::exp(m[r] - top);
    l[r] = l[r] * rescale[r] + _mm512_reduce_add_ps(sum);
    m[r] = top;
  }
  values_rows<D, E>(acc, sc, stride, v, rows, first, last, pk, pv, rescale);
}

// acc rows 0 .. R-1 += sum_j p[r][j] v[j] over a span's keys [lo, hi) (p: [R][pstride] weights, zero where a row
// does not see a key), the accumulators in registers over the whole span (each row's rescale[r] folded into their
// load): the span's blocks `vb[j / B]` (D values a key)
template <int D, int R>
inline void values_span(float* acc, const float* p, int64_t pstride, const uint16_t* const* vb, int64_t B, int64_t lo,
                        int64_t hi, const float* rescale) {
  constexpr int C = D / 16;
  __m512 a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      a[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + 16 * c), _mm512_set1_ps(rescale[r]));
  for (int64_t b0 = lo / B * B; b0 < hi; b0 += B) {
    const uint16_t* v = vb[b0 / B];  // (key j's values at v + (j - b0) * D)
    for (int64_t j = std::max(lo, b0), e = std::min(hi, b0 + B); j < e; ++j) {
      __m512 vv[C];
      widen_bf16<C>(v + (j - b0) * D, vv);
      add_weighted<R, C>(a, vv, p, pstride, j);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + r * D + 16 * c, a[r][c]);
}

// A prompt item on a CPU with AVX512-BF16 (no AMX): its rows (query tokens x the heads of a kv head, queries q[r]
// as they lie) against its keys [lo, hi) a span of kSpanKeys at a time, as prompt_item_amx takes them. Per span:
// every row's scaled scores (scores_tile_bf16, a block at a time, into sc: [rows, W]), then each row's online
// softmax over the whole span 16 keys a vector (exp_neg), its weights in place of its scores (zero where it sees no
// key, across the keys any row sees), then the weighted values with each row block's accumulators in registers
// over the span. Per block of 32 keys instead, every row's softmax pass (two reductions), its accumulators'
// rescaling in memory and the values' accumulator round trip were paid every 32 keys.
template <int D>
void prompt_item_bf16(const uint16_t* const* q, int64_t rows, const int64_t* qpos, int64_t window,
                      const uint16_t* k_cache, const uint16_t* v_cache, const int32_t* table, int64_t n_kv,
                      int64_t kvh, int64_t B, int64_t lo, int64_t hi, float scale, float* acc, float* m, float* l,
                      float* sc) {
  const int64_t S = span_keys(B), W = span_width(B);
  auto block = [&](int64_t j) {  // the run of kv head kvh's rows in the block of key j
    return (static_cast<int64_t>(table[j / B]) * n_kv + kvh) * B * D;
  };
  const uint16_t* vb[kSpanKeys];  // the span's value blocks (one per block: B >= 1)
  float rescale[kMaxRows];
  int64_t first[kMaxRows], last[kMaxRows];
  for (int64_t j0 = lo / S * S; j0 < hi; j0 += S) {
    const int64_t nk = std::min(S, hi - j0);
    for (int64_t b = 0; b < nk; b += B) {  // scores, a block at a time
      const auto* kt = reinterpret_cast<const __m512i*>(k_cache + block(j0 + b));
      scores_tile_bf16<D>(q, rows, kt, (std::min(B, nk - b) + 15) / 16, scale, sc + b, W);
      vb[b / B] = v_cache + block(j0 + b);
    }
    int64_t lo_j = nk, hi_j = 0;  // the keys some row sees
    for (int64_t r = 0; r < rows; ++r) {
      first[r] = window > 0 ? std::clamp<int64_t>(qpos[r] - window + 1 - j0, 0, nk) : 0;
      last[r] = std::clamp<int64_t>(qpos[r] + 1 - j0, 0, nk);
      if (last[r] <= first[r]) first[r] = last[r] = 0;
      else lo_j = std::min(lo_j, first[r]), hi_j = std::max(hi_j, last[r]);
    }
    if (hi_j <= lo_j) continue;
    auto seen = [](int64_t j, int64_t a, int64_t b) {  // lanes j .. j + 15 in [a, b)
      const int64_t x = std::clamp<int64_t>(a - j, 0, 16), y = std::clamp<int64_t>(b - j, 0, 16);
      return static_cast<__mmask16>(((1u << y) - 1) & ~((1u << x) - 1));
    };
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = sc + r * W;
      const int64_t f = first[r], e = last[r];
      rescale[r] = 1.f;
      if (e <= f) {
        std::fill(sr + lo_j, sr + hi_j, 0.f);
        continue;
      }
      __m512 mx = _mm512_set1_ps(kNegBig);
      for (int64_t j = f / 16 * 16; j < e; j += 16) {
        const __mmask16 k = seen(j, f, e);
        mx = _mm512_mask_max_ps(mx, k, mx, _mm512_maskz_loadu_ps(k, sr + j));
      }
      const float top = std::max(m[r], _mm512_reduce_max_ps(mx));
      const __m512 tv = _mm512_set1_ps(top);
      __m512 sum = _mm512_setzero_ps();
      std::fill(sr + lo_j, sr + f, 0.f);
      for (int64_t j = f / 16 * 16; j < e; j += 16) {
        const __mmask16 k = seen(j, f, e);
        const __m512 p = _mm512_maskz_mov_ps(k, mii_vec::exp_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sr + j), tv)));
        _mm512_mask_storeu_ps(sr + j, k, p);
        sum = _mm512_add_ps(sum, p);
      }
      std::fill(sr + e, sr + hi_j, 0.f);
      rescale[r] = std::exp(m[r] - top);
      l[r] = l[r] * rescale[r] + _mm512_reduce_add_ps(sum);
      m[r] = top;
    }
    constexpr int kRowsV = D == 64 ? 4 : 2;
    int64_t r = 0;
    for (; r + kRowsV <= rows; r += kRowsV)
      values_span<D, kRowsV>(acc + r * D, sc + r * W, W, vb, B, lo_j, hi_j, rescale + r);
    for (; r < rows; ++r) values_span<D, 1>(acc + r * D, sc + r * W, W, vb, B, lo_j, hi_j, rescale + r);
  }
}
#endif

#ifdef MII_AMX
// A prompt tile with AMX (Intel Xeons with amx_bf16): a work item's rows (query tokens x the heads of a kv head, 16
// to a tile, their queries copied once per item into qa, rows past the last tile's zero) against its keys a span
// of kSpanKeys at a time (whole blocks; spans start at multiples of it from the sequence's first key, so that a
// row's arithmetic does not depend on the rows beside it). Per span: every row's scores as tile products, then
// each row's online softmax over the whole span 16 keys a vector (exp_neg), its weights as bf16 hi = p rounded and
// lo = p - hi rounded (p to 2^-17, where bf16 alone would round each weight at 2^-9), then the weighted values as
// tile products, each accumulator tile loaded and stored once per span. Per block of keys instead (session 27's
// version), every row's softmax pass, its accumulators' rescaling and the accumulator tiles' round trip were paid
// every 32 keys, and the prompt's attention ran at 0.1-0.2 TFLOP/s.

// Scores: qa's 16 rows x 32 values (an A tile) times the keys as pairs (16 of a block's paired vectors are a B tile
// as they lie), into 16 x 16 keys' fp32 sums, stored into sc's rows (`stride` floats apart). The same exact
// products as scores_rows_bf16, summed in AMX's order.
template <int D>
inline void scores_amx(const uint16_t* qa, int64_t rtiles, const __m512i* kt, int64_t groups, float* sc,
                       int64_t stride) {
  constexpr int P = D / 2;
  for (int64_t rt = 0; rt < rtiles; ++rt) {
    for (int64_t g = 0; g < groups; g += 2) {
      const bool two = g + 1 < groups;
      _tile_zero(0);
      _tile_zero(1);
      for (int c = 0; c < D / 32; ++c) {
        _tile_loadd(4, qa + rt * 16 * D + 32 * c, D * 2);
        _tile_loadd(6, kt + g * P + 16 * c, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two) {
          _tile_loadd(7, kt + (g + 1) * P + 16 * c, 64);
          _tile_dpbf16ps(1, 4, 7);
        }
      }
      _tile_stored(0, sc + rt * 16 * stride + 16 * g, stride * 4);
      if (two) _tile_stored(1, sc + rt * 16 * stride + 16 * (g + 1), stride * 4);
    }
  }
}

// A row's weights over a span's keys [0, W) (W a multiple of 32) from its scores sr (unscaled): keys [first, last)
// seen, exp(scale s - max) as hi and lo bf16 into ph and pl (zero elsewhere); the row's running maximum m and sum l
// move on, and its accumulators (D floats) are rescaled where the maximum moved.
template <int D>
inline void span_weights(const float* sr, int64_t W, int64_t first, int64_t last, float scale, float& m, float& l,
                         float* acc, uint16_t* ph, uint16_t* pl) {
  auto seen = [&](int64_t j) {  // lanes j .. j + 15 in [first, last)
    const int64_t a = std::clamp<int64_t>(first - j, 0, 16), b = std::clamp<int64_t>(last - j, 0, 16);
    return static_cast<__mmask16>(((1u << b) - 1) & ~((1u << a) - 1));
  };
  auto zeros = [&](int64_t a, int64_t b) {  // no weights for keys [a, b) (whole chunks of 16)
    for (int64_t j = a; j < b; j += 16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(ph + j), _mm256_setzero_si256());
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pl + j), _mm256_setzero_si256());
    }
  };
  if (last <= first) return zeros(0, W);
  const int64_t from = first / 16 * 16;  // the chunks of 16 keys that hold seen ones: [from, last)
  zeros(0, from);
  // the maximum of the raw sums (scale > 0), scaled once
  __m512 mx = _mm512_set1_ps(kNegBig);
  for (int64_t i = from; i < last; i += 16) {
    if (i >= first && i + 16 <= last) {
      mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + i));
    } else {
      const __mmask16 k = seen(i);
      mx = _mm512_mask_max_ps(mx, k, mx, _mm512_maskz_loadu_ps(k, sr + i));
    }
  }
  const float mnew = std::max(m, _mm512_reduce_max_ps(mx) * scale);
  const __m512 sv = _mm512_set1_ps(scale), mv = _mm512_set1_ps(mnew);
  __m512 sum = _mm512_setzero_ps();
  auto weights = [&](int64_t i, __m512 p) {
    sum = _mm512_add_ps(sum, p);
    const __m256bh hi = _mm512_cvtneps_pbh(p);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(ph + i), (__m256i)hi);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pl + i),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(p, _mm512_cvtpbh_ps(hi))));
  };
  int64_t j = from;
  for (; j < last; j += 16) {
    if (j >= first && j + 16 <= last) {
      weights(j, mii_vec::exp_neg(_mm512_fmsub_ps(_mm512_loadu_ps(sr + j), sv, mv)));
    } else {
      const __mmask16 k = seen(j);
      weights(j, _mm512_maskz_mov_ps(k, mii_vec::exp_neg(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, sr + j), sv, mv))));
    }
  }
  zeros(j, W);
  if (mnew > m) {
    const float c = std::exp(m - mnew);
    const __m512 cv = _mm512_set1_ps(c);
    for (int e = 0; e < D; e += 16) _mm512_storeu_ps(acc + e, _mm512_mul_ps(_mm512_loadu_ps(acc + e), cv));
    l *= c;
    m = mnew;
  }
  l += _mm512_reduce_add_ps(sum);
}

// One prompt item's keys [lo, hi) (its sequence's blocks `table`, kv head kvh) for its `rows` rows (queries qa,
// positions qpos): acc, m, l as the generic loop keeps them (acc permuted as above). sc: [rtiles * 16, W] floats,
// ph and pl: [rtiles * 16, W] bf16 each, vt: [W / 32][D / 16][16] vectors, W = span_width(B).
// The values' B tiles are key pairs built so that C tile 2h's column u is value 32h + 2u and tile 2h + 1's value
// 32h + 2u + 1: the accumulators' own permutation, so the running sums are loaded into tiles and stored back as
// they lie. Keys past the span's last (and their weights) are zero.
template <int D>
void prompt_item_amx(const uint16_t* qa, int64_t rows, const int64_t* qpos, int64_t window, const uint16_t* k_cache,
                     const uint16_t* v_cache, const int32_t* table, int64_t n_kv, int64_t kvh, int64_t B, int64_t lo,
                     int64_t hi, float scale, float* acc, float* m, float* l, float* sc, uint16_t* ph,
                     uint16_t* pl, __m512i* vt) {
  const int64_t S = span_keys(B), W = span_width(B), rtiles = (rows + 15) / 16;
  auto block = [&](int64_t j) {  // the run of kv head kvh's rows in the block of key j
    return (static_cast<int64_t>(table[j / B]) * n_kv + kvh) * B * D;
  };
  for (int64_t r = rows; r < rtiles * 16; ++r) {  // the last tile's rows past `rows`: no weights
    std::fill(ph + r * W, ph + (r + 1) * W, uint16_t(0));
    std::fill(pl + r * W, pl + (r + 1) * W, uint16_t(0));
  }
  const __m512i lo16 = _mm512_set1_epi32(0xFFFF), hi16 = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t j0 = lo / S * S; j0 < hi; j0 += S) {
    const int64_t nk = std::min(S, hi - j0), steps = (nk + 31) / 32;
    for (int64_t b = 0; b < nk; b += B) {  // scores, a block at a time
      const auto* kt = reinterpret_cast<const __m512i*>(k_cache + block(j0 + b));
      scores_amx<D>(qa, rtiles, kt, (std::min(B, nk - b) + 15) / 16, sc + b, W);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t first = window > 0 ? std::max<int64_t>(0, qpos[r] - window + 1 - j0) : 0;
      const int64_t last = std::min<int64_t>(nk, qpos[r] + 1 - j0);
      span_weights<D>(sc + r * W, steps * 32, first, last, scale, m[r], l[r], acc + r * D,
                      ph + r * W, pl + r * W);
    }
    for (int64_t s = 0; s < steps; ++s) {  // the values as B tiles of key pairs, 32 keys a step
      for (int i = 0; i < 16; ++i) {  // key pair i: keys a and a + 1 (one block: B is even)
        const int64_t a = 32 * s + 2 * i;
        const uint16_t* va = a < nk ? v_cache + block(j0 + a) + (j0 + a) % B * D : nullptr;
        for (int h = 0; h < D / 32; ++h) {
          const __m512i x = va ? _mm512_loadu_si512(va + 32 * h) : _mm512_setzero_si512();
          const __m512i y = a + 1 < nk ? _mm512_loadu_si512(va + D + 32 * h) : _mm512_setzero_si512();
          vt[(s * D / 16 + 2 * h) * 16 + i] = _mm512_or_si512(_mm512_and_si512(x, lo16), _mm512_slli_epi32(y, 16));
          vt[(s * D / 16 + 2 * h + 1) * 16 + i] = _mm512_or_si512(_mm512_srli_epi32(x, 16), _mm512_and_si512(y, hi16));
        }
      }
    }
    for (int64_t rt = 0; rt < rtiles; ++rt) {  // acc += weights x values, 4 accumulator tiles (64 values) at a time
      for (int c0 = 0; c0 < D / 16; c0 += 4) {
        float* a0 = acc + rt * 16 * D + 16 * c0;
        _tile_loadd(0, a0, D * 4);
        _tile_loadd(1, a0 + 16, D * 4);
        _tile_loadd(2, a0 + 32, D * 4);
        _tile_loadd(3, a0 + 48, D * 4);
        for (int64_t s = 0; s < steps; ++s) {
          _tile_loadd(4, ph + rt * 16 * W + 32 * s, W * 2);
          _tile_loadd(5, pl + rt * 16 * W + 32 * s, W * 2);
          const __m512i* v = vt + (s * D / 16 + c0) * 16;
          _tile_loadd(6, v, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(0, 5, 6);
          _tile_loadd(7, v + 16, 64);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(1, 5, 7);
          _tile_loadd(6, v + 32, 64);
          _tile_dpbf16ps(2, 4, 6);
          _tile_dpbf16ps(2, 5, 6);
          _tile_loadd(7, v + 48, 64);
          _tile_dpbf16ps(3, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, a0, D * 4);
        _tile_stored(1, a0 + 16, D * 4);
        _tile_stored(2, a0 + 32, D * 4);
        _tile_stored(3, a0 + 48, D * 4);
      }
    }
  }
}
#endif

// a row's output from its accumulators (permuted as above) times inv: where attend() reads the blocks in place,
// 32 values at a time (the even and the odd ones rounded, then interleaved as the 16-bit halves of 32-bit lanes:
// a prompt chunk's scalar loop through acc_value was 7% of its attention); otherwise value by value
template <typename T>
inline void write_row(const float* acc, float inv, T* o, int64_t d, bool in_place) {
#ifdef MII_ATTN_BF16
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (in_place) {
      const __m512 iv = _mm512_set1_ps(inv);
      for (int64_t h = 0; h < d; h += 32) {
        const __m512i even = _mm512_cvtepu16_epi32(mii_vec::bf16_round(_mm512_mul_ps(_mm512_loadu_ps(acc + h), iv)));
        const __m512i odd = _mm512_cvtepu16_epi32(mii_vec::bf16_round(_mm512_mul_ps(_mm512_loadu_ps(acc + h + 16), iv)));
        _mm512_storeu_si512(o + h, _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
      }
      return;
    }
  }
#endif
  for (int64_t e = 0; e < d; ++e) o[in_place ? acc_value(e) : e] = static_cast<T>(acc[e] * inv);
}

// whether attend() reads the blocks as bf16 in place (queries and cache bf16, head size 64 or 128, AVX512-BF16)
template <typename T, typename C>
constexpr bool in_place_bf16_type() {
#ifdef MII_ATTN_BF16
  return std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16>;
#else
  return false;
#endif
}
inline bool in_place_bf16(at::ScalarType q, at::ScalarType cache, int64_t d) {
#ifdef MII_ATTN_BF16
  return q == at::kBFloat16 && cache == at::kBFloat16 && (d == 64 || d == 128);
#else
  return false;
#endif
}
// the keys' layout where they are read in place as bf16: as pairs (see scores_rows_bf16) in blocks of whole 16-key
// groups, as rows otherwise
inline bool keys_paired(int64_t block_size) { return block_size % 16 == 0; }
inline bool keys_paired(at::ScalarType q, at::ScalarType cache, int64_t d, int64_t block_size) {
  return in_place_bf16(q, cache, d) && keys_paired(block_size);
}
// whether attend() reads an int8 cache (MII_ATTN_Q8) of head size d under queries of type q
inline bool q8_cache(at::ScalarType q, int64_t d, int64_t block_size) {
#ifdef MII_ATTN_Q8
  return q == at::kBFloat16 && (d == 64 || d == 128) && keys_paired(block_size);
#else
  return false;
#endif
}
template <typename T, typename C>
constexpr bool q8_type() {
#ifdef MII_ATTN_Q8
  return std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, int8_t>;
#else
  return false;
#endif
}

// the shortest prompt chunk that goes through prompt_chunk() (ATen's SDPA) rather than attend()
inline int64_t sdpa_from(at::ScalarType q, at::ScalarType cache, int64_t d) {
  return in_place_bf16(q, cache, d) || cache == at::kChar ? std::numeric_limits<int64_t>::max() : kPromptChunk;
}

// a row's online softmax over one block's scores sr[first, last): the scores become their weights exp(s - max),
// the row's maximum m and sum l move on, and what it accumulated under the old maximum (ar, d values) is rescaled
inline void softmax_step(float* sr, int64_t first, int64_t last, float& m, float& l, float* ar, int64_t d) {
  float mx = m;
  for (int64_t j = first; j < last; ++j) mx = std::max(mx, sr[j]);
  const float c = std::exp(m - mx);
  float sum = 0.f;
  for (int64_t j = first; j < last; ++j) {
    sr[j] = std::exp(sr[j] - mx);
    sum += sr[j];
  }
  l = l * c + sum;
  m = mx;
  for (int64_t e = 0; e < d; ++e) ar[e] *= c;
}

// T: the queries' and the output's dtype; C: the cache's (T, or bf16/fp16 under fp32 queries, or int8 under bf16)
template <typename T, typename C>
void attend(const T* q, T* out, const C* k_cache, const C* v_cache, const int32_t* query_start,
            const int32_t* seq_lens, const int32_t* tables, int64_t num_seqs, int64_t table_width,
            int64_t n_heads, int64_t n_kv, int64_t d, int64_t block_size, double scale, int64_t window,
            int64_t q_stride, int64_t o_stride, int64_t sdpa_min) {
  const int64_t group = n_heads / n_kv;
  constexpr bool Q8 = q8_type<T, C>();
  // (bf16 or int8 blocks read as they are, the accumulators permuted: scores_bf16 below, not qf)
  const bool in_place = (in_place_bf16_type<T, C>() || Q8) && (d == 64 || d == 128);
  const bool paired = in_place && keys_paired(block_size);  // the keys' layout in the blocks
  const int64_t tile = std::max<int64_t>(1, std::min<int64_t>(kQueryTile, kMaxRows / group));
#ifdef MII_AMX
  // prompt tiles: scores_amx, values_amx
  const bool amx = paired && !Q8 && mii_vec::amx_usable();
#endif
  const int64_t B = block_size, part_blocks = std::max<int64_t>(1, kSplitKeys / B);
  // work items: (sequence, kv head, query tile, part of the keys); parts only for decode rows
  std::vector<int64_t> item_start(num_seqs + 1, 0), parts(num_seqs, 1), partial_start(num_seqs + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s) {  // (prompt chunks of sdpa_min+ tokens: prompt_chunk())
    const int64_t ql = query_start[s + 1] - query_start[s];
    if (ql == 1) {
      const int64_t pos = seq_lens[s] - 1, lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      parts[s] = (pos / B - lo / B + part_blocks) / part_blocks;
    }
    item_start[s + 1] = item_start[s] + (ql >= sdpa_min ? 0 : n_kv * ((ql + tile - 1) / tile) * parts[s]);
    partial_start[s + 1] = partial_start[s] + (parts[s] > 1 ? n_kv * parts[s] : 0);
  }
  // a split row's parts: per (sequence, kv head, part), `group` rows of (max, sum, accumulator [d])
  // and per (sequence, kv head) how many parts are done: both only when a row is split
  std::vector<float> partial(partial_start[num_seqs] * group * (d + 2));
  const int64_t counters = partial.empty() ? 0 : num_seqs * n_kv;
  // (one to a cache line: counters that two threads move on would share lines)
  constexpr int64_t kLine = 64 / sizeof(std::atomic<int>);
  std::unique_ptr<std::atomic<int>[]> finished(counters ? new std::atomic<int>[counters * kLine] : nullptr);
  for (int64_t i = 0; i < counters; ++i) finished[i * kLine].store(0, std::memory_order_relaxed);
  const int64_t head_block = B * (Q8 ? d + 4 : d);  // elements of one kv head's rows in one block (and scales)
  const float fscale = static_cast<float>(scale);
  // items are taken one at a time from a shared counter rather than in even shares of the list: their costs differ
  // (a prompt chunk's later tiles see more keys; sequences differ in length), and so can the threads' speeds
  const int64_t items = item_start[num_seqs];
  std::atomic<int64_t> next_item{0};
  struct Where {  // an item: its sequence, kv head, query tile, part, and its blocks of keys
    int64_t s = -1, ql = 0, kvh = 0, t0 = 0, part = 0, first_block = 0, blocks = 0;
  };
  auto where = [&](int64_t item) {
    Where w;
    w.s = std::upper_bound(item_start.begin(), item_start.end(), item) - item_start.begin() - 1;
    const int64_t local = item - item_start[w.s], np = parts[w.s];
    w.ql = query_start[w.s + 1] - query_start[w.s];
    const int64_t tiles = (w.ql + tile - 1) / tile;
    // (a prompt's tiles last first: they see the most keys, and the threads' shares end together when the longest
    // items are taken first)
    w.kvh = local / (tiles * np), w.t0 = (tiles - 1 - local / np % tiles) * tile, w.part = local % np;
    const int64_t pos = seq_lens[w.s] - w.ql + w.t0;  // the tile's first query sees the earliest keys
    w.first_block = (window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0) / B + w.part * part_blocks;
    int64_t end = pos + std::min(tile, w.ql - w.t0);  // past the tile's last query's keys
    if (np > 1) end = std::min(end, (w.first_block + part_blocks) * B);
    w.blocks = (end + B - 1) / B - w.first_block;
    return w;
  };
  auto block_base = [&](const Where& w, int64_t i) {  // where block i of an item starts in the caches
    return (static_cast<int64_t>(tables[w.s * table_width + w.first_block + i]) * n_kv + w.kvh) * head_block;
  };
  mii_team::parallel_for(0, std::min<int64_t>(at::get_num_threads(), items), 1, [&](int64_t, int64_t) {
    // (rows rounded up to whole AMX tiles of 16)
    const int64_t max_rows = (std::min<int64_t>(kMaxRows, tile * group) + 15) / 16 * 16;
    // scaled queries and accumulators [rows, d], one block of keys/values as float [B, d], scores [rows, B]
    // (decode_block's: [rows, B + 16])
    std::unique_ptr<float[]> buf(new float[2 * max_rows * d + 2 * B * d + max_rows * (B + 16) + 2 * max_rows]);
    float *qf = buf.get(), *acc = qf + max_rows * d, *kb = acc + max_rows * d, *vb = kb + B * d,
          *sc = vb + B * d, *m = sc + max_rows * (B + 16), *l = m + max_rows;
    int64_t qpos[kMaxRows];
    const T* qrow[kMaxRows];
#ifdef MII_AMX
    // an AMX prompt item's queries [rows, d], scores [rows, W] and weights (hi and lo bf16 [rows, W] each), a
    // span's values as B tiles of key pairs ([W / 32][d / 16][16] vectors): see prompt_item_amx. Made at the
    // thread's first prompt item (~130 KB: a decode step's 30 calls would clear them for nothing), not cleared
    // (each part is written before it is read), the tile unit configured then too.
    const int64_t W = span_width(B);
    std::unique_ptr<uint16_t[]> qa, pa;
    std::unique_ptr<float[]> sw;
    std::unique_ptr<__m512i[]> vt;
#endif
    std::unique_ptr<float[]> ssc;  // a prompt item's span of scores and weights [rows, W] (prompt_item_bf16)
    // an int8 cache's rows: their queries quantized, the queries' sums and scales
    std::vector<int8_t> q8(Q8 ? max_rows * d : 0);
    std::vector<int32_t> qsum(Q8 ? max_rows : 0);
    std::vector<float> qscale(Q8 ? max_rows : 0);
    // a thread claims its next item as it starts one, so that the last block of one item prefetches the first of
    // the next (a decode row's part is a few blocks: its first one would otherwise wait for memory unhidden)
    int64_t item = next_item.fetch_add(1, std::memory_order_relaxed);
    int64_t next_ready = 0;  // how many of the next item's first blocks this one prefetched
    auto prefetch_block = [&](int64_t base, int64_t n) {
      for (int64_t e = 0; e < n; e += 64 / sizeof(C)) {
        __builtin_prefetch(k_cache + base + e);
        __builtin_prefetch(v_cache + base + e);
      }
    };
    while (item < items) {
      const int64_t upcoming = next_item.fetch_add(1, std::memory_order_relaxed);
      const Where at = where(item), next_at = upcoming < items ? where(upcoming) : Where{};
      item = upcoming;
      const int64_t s = at.s, ql = at.ql, np = parts[s], kvh = at.kvh, t0 = at.t0, part = at.part;
      if (in_place) {  // the item's first two blocks, those the item before did not prefetch
        for (int64_t b = next_ready; b < std::min<int64_t>(2, at.blocks); ++b)
          prefetch_block(block_base(at, b), head_block);
        next_ready = 0;
      }
      const int64_t nq = std::min(tile, ql - t0), rows = nq * group;
      const int64_t len = seq_lens[s], first_pos = len - ql;
      // rows are (query token, head in group); queries scaled, in fp32
      int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t tok = query_start[s] + t0 + i, pos = first_pos + t0 + i;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t r = i * group + g;
          qrow[r] = q + tok * q_stride + (kvh * group + g) * d;
          if (!in_place) {
            load_row(qrow[r], qf + r * d, d);
            for (int64_t e = 0; e < d; ++e) qf[r * d + e] *= fscale;
          }
#ifdef MII_ATTN_Q8
          if constexpr (Q8)
            qscale[r] = fscale * quantize(reinterpret_cast<const uint16_t*>(qrow[r]), d, &q8[r * d], &qsum[r]);
#endif
          qpos[r] = pos;
          m[r] = kNegBig;
          l[r] = 0.f;
          std::fill(acc + r * d, acc + (r + 1) * d, 0.f);
        }
        lo = std::min(lo, window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0);
        hi = std::max(hi, pos + 1);
      }
      const int32_t* table = tables + s * table_width;
#ifdef MII_AMX
      const bool tiles_amx = amx && nq > 1;  // (then the block loop below is skipped)
      if (tiles_amx) {
        if (!qa) {
          qa.reset(new uint16_t[max_rows * d]), pa.reset(new uint16_t[2 * max_rows * W]);
          sw.reset(new float[max_rows * W]), vt.reset(new __m512i[W / 32 * d]);
          mii_vec::amx_configure();
        }
        // the rows' queries, contiguous for the A tiles; the rows up to a whole tile zero
        for (int64_t r = 0; r < rows; ++r) std::memcpy(&qa[r * d], qrow[r], d * 2);
        std::fill(&qa[rows * d], &qa[(rows + 15) / 16 * 16 * d], uint16_t(0));
        const auto* kc = reinterpret_cast<const uint16_t*>(k_cache);
        const auto* vc = reinterpret_cast<const uint16_t*>(v_cache);
        uint16_t *ph = pa.get(), *pl = ph + max_rows * W;
        if (d == 64)
          prompt_item_amx<64>(qa.get(), rows, qpos, window, kc, vc, table, n_kv, kvh, B, lo, hi, fscale, acc, m, l,
                              sw.get(), ph, pl, vt.get());
        else
          prompt_item_amx<128>(qa.get(), rows, qpos, window, kc, vc, table, n_kv, kvh, B, lo, hi, fscale, acc, m, l,
                               sw.get(), ph, pl, vt.get());
      }
#else
      constexpr bool tiles_amx = false;
#endif
      bool tiles_span = false;  // prompt_item_bf16 (then, too, the block loop below is skipped)
#ifdef MII_ATTN_BF16
      if constexpr (in_place_bf16_type<T, C>()) {
        if (paired && nq > 1 && !tiles_amx) {
          tiles_span = true;
          if (!ssc) ssc.reset(new float[max_rows * span_width(B)]);
          const auto* qs = reinterpret_cast<const uint16_t* const*>(qrow);
          const auto* kc = reinterpret_cast<const uint16_t*>(k_cache);
          const auto* vc = reinterpret_cast<const uint16_t*>(v_cache);
          if (d == 64)
            prompt_item_bf16<64>(qs, rows, qpos, window, kc, vc, table, n_kv, kvh, B, lo, hi, fscale, acc, m, l,
                                 ssc.get());
          else
            prompt_item_bf16<128>(qs, rows, qpos, window, kc, vc, table, n_kv, kvh, B, lo, hi, fscale, acc, m, l,
                                  ssc.get());
        }
      }
#endif
      const int64_t first_block = lo / B + part * part_blocks;
      if (np > 1) hi = std::min(hi, (first_block + part_blocks) * B);  // this part's keys
      // one KV block at a time
      for (int64_t k = 0, j0 = first_block * B; j0 < hi && !tiles_amx && !tiles_span; ++k, j0 += B) {
        const int64_t base = (static_cast<int64_t>(table[first_block + k]) * n_kv + kvh) * head_block;
        const int64_t nk = std::min(B, hi - j0);
        auto visible = [&](int64_t r) {  // the keys j0 + j row r sees: j in [first, last)
          return std::pair<int64_t, int64_t>(window > 0 ? std::max<int64_t>(0, qpos[r] - window + 1 - j0) : 0,
                                             std::min<int64_t>(nk, qpos[r] + 1 - j0));
        };
        auto tile_row = [&](int64_t r) {  // a prompt tile's row r: its scores zero outside the keys it sees, those keys
          auto [first, last] = visible(r);
          float* sr = sc + r * B;
          if (last <= first) first = last = nk;
          std::fill(sr, sr + first, 0.f);
          std::fill(sr + last, sr + nk, 0.f);
          return std::pair<int64_t, int64_t>(first, last);
        };
        // the blocks ahead, this item's then the next item's: where the blocks are read in place, the one two ahead,
        // its lines spread over the values pass (a burst of them fills the miss queues and stalls the loop, so that
        // memory and compute took turns) and brought into L2, not L1 (prefetcht1: 64 decode rows x 300-500 keys
        // 43-47 → 31-33 ms a step, 30 layers; a C probe reading 4 KB runs in random order, 2 threads: 14.3 GB/s
        // into L1, 16.2 into L2, where the lines of the next blocks evicted the current one's from L1); otherwise the
        // next one, all at once, while this one is computed
        const C* later_k = nullptr;
        const C* later_v = nullptr;
        auto prefetch_rest = [&](int64_t a, int64_t b) {  // the later block's lines outside elements [a, b)
          for (const auto [from, to] : {std::pair<int64_t, int64_t>(0, a), {b, head_block}})
            for (int64_t e = from; e < to; e += 64 / sizeof(C)) {
              __builtin_prefetch(later_k + e, 0, 2);
              __builtin_prefetch(later_v + e, 0, 2);
            }
        };
        if (in_place) {
          int64_t later = -1;
          if (k + 2 < at.blocks) {
            later = block_base(at, k + 2);
          } else if (next_at.s >= 0 && k + 2 - at.blocks < next_at.blocks) {
            later = block_base(next_at, k + 2 - at.blocks);
            next_ready = k + 3 - at.blocks;
          }
          if (later >= 0) later_k = k_cache + later, later_v = v_cache + later;
        } else if (j0 + B < hi) {
          prefetch_block(block_base(at, k + 1), std::min(B, hi - j0 - B) * d);
        }
#ifdef MII_ATTN_Q8
        if constexpr (Q8) {  // an int8 cache (in_place is true)
          const int8_t* kr = k_cache + base;
          const int8_t* vr = v_cache + base;
          const Q8Block qb{q8.data(), qsum.data(), qscale.data(), reinterpret_cast<const float*>(kr + B * d),
                           reinterpret_cast<const float*>(vr + B * d)};
          const auto* kt = reinterpret_cast<const __m512i*>(kr);
          int64_t lo_j = nk, hi_j = 0;  // the keys some row sees
          if (nq == 1) {  // a decode row (or a one-token chunk): every row sees the same keys
            const auto [first, last] = visible(0);
            if (last > first) {
              if (d == 64)
                decode_block<64, true, int8_t>(nullptr, rows, kr, vr, first, last, fscale, sc, B + 16, m, l, acc,
                                               later_k, later_v, &qb);
              else
                decode_block<128, true, int8_t>(nullptr, rows, kr, vr, first, last, fscale, sc, B + 16, m, l, acc,
                                                later_k, later_v, &qb);
              lo_j = first, hi_j = last;
            }
          } else {  // a prompt tile: every row's scores at once, then masked
            if (d == 64) scores_tile_q8<64>(qb, rows, kt, qb.ks, (nk + 15) / 16, sc, B);
            else scores_tile_q8<128>(qb, rows, kt, qb.ks, (nk + 15) / 16, sc, B);
            for (int64_t r = 0; r < rows; ++r) {
              const auto [first, last] = tile_row(r);
              if (last <= first) continue;
              float* sr = sc + r * B;
              softmax_step(sr, first, last, m[r], l[r], acc + r * d, d);
              for (int64_t j = first; j < last; ++j) sr[j] *= qb.vs[j];
              lo_j = std::min(lo_j, first), hi_j = std::max(hi_j, last);
            }
            if (hi_j > lo_j) {
              if (d == 64) values_rows<64, int8_t>(acc, sc, B, vr, rows, lo_j, hi_j, later_k, later_v);
              else values_rows<128, int8_t>(acc, sc, B, vr, rows, lo_j, hi_j, later_k, later_v);
            }
          }
          if (later_k)  // the lines the values pass did not prefetch, the scales' among them
            hi_j > lo_j ? prefetch_rest(lo_j * d, hi_j * d) : prefetch_rest(0, 0);
          continue;
        }
#endif
#ifdef MII_ATTN_BF16
        if constexpr (in_place_bf16_type<T, C>()) {
          if (in_place) {
            const auto* kr = reinterpret_cast<const uint16_t*>(k_cache + base);
            const auto* vr = reinterpret_cast<const uint16_t*>(v_cache + base);
            int64_t lo_j = nk, hi_j = 0;  // the keys some row sees
            const auto* pk = reinterpret_cast<const uint16_t*>(later_k);
            const auto* pv = reinterpret_cast<const uint16_t*>(later_v);
            if (nq == 1) {  // a decode row (or a one-token chunk): every row sees the same keys
              const auto [first, last] = visible(0);
              const auto* qs = reinterpret_cast<const uint16_t* const*>(qrow);
              if (last > first) {
                const int64_t st = B + 16;  // (decode_block's scores stride)
                if (paired && d == 64)
                  decode_block<64, true>(qs, rows, kr, vr, first, last, fscale, sc, st, m, l, acc, pk, pv);
                else if (paired)
                  decode_block<128, true>(qs, rows, kr, vr, first, last, fscale, sc, st, m, l, acc, pk, pv);
                else if (d == 64)
                  decode_block<64, false>(qs, rows, kr, vr, first, last, fscale, sc, st, m, l, acc, pk, pv);
                else
                  decode_block<128, false>(qs, rows, kr, vr, first, last, fscale, sc, st, m, l, acc, pk, pv);
                lo_j = first, hi_j = last;
              }
            } else {
              // a prompt tile on keys as rows (blocks of other than a multiple of 16 keys: paired keys take
              // prompt_item_bf16 or prompt_item_amx above), each row's scores by dots16
              for (int64_t r = 0; r < rows; ++r) {
                const auto [first, last] = tile_row(r);
                if (last <= first) continue;
                float* sr = sc + r * B;
                const auto* qr = reinterpret_cast<const uint16_t*>(qrow[r]);
                if (d == 64) scores_bf16<64>(qr, kr, first, last, fscale, sr);
                else scores_bf16<128>(qr, kr, first, last, fscale, sr);
                softmax_step(sr, first, last, m[r], l[r], acc + r * d, d);
                lo_j = std::min(lo_j, first), hi_j = std::max(hi_j, last);
              }
              if (hi_j > lo_j) {
                if (d == 64) values_rows<64>(acc, sc, B, vr, rows, lo_j, hi_j, pk, pv);
                else values_rows<128>(acc, sc, B, vr, rows, lo_j, hi_j, pk, pv);
              }
            }
            // the lines the values pass did not prefetch
            if (later_k && (hi_j <= lo_j || hi_j - lo_j < B))
              hi_j > lo_j ? prefetch_rest(lo_j * d, hi_j * d) : prefetch_rest(0, 0);
            continue;
          }
        }
#endif
        // the block's keys and values as float rows: in place for fp32, converted once per block otherwise
        const float *kblk, *vblk;
        if constexpr (std::is_same_v<C, float>) {
          kblk = k_cache + base, vblk = v_cache + base;
        } else {
          load_row(k_cache + base, kb, nk * d);
          load_row(v_cache + base, vb, nk * d);
          kblk = kb, vblk = vb;
        }
        for (int64_t r = 0; r < rows; ++r) {
          // keys j0 + j visible to this row: (qpos - window, qpos]
          const auto [first, last] = visible(r);
          if (last <= first) continue;
          const float* qr = qf + r * d;
          float* sr = sc + r * B;
          scores(qr, kblk, d, d, first, last, sr);
          softmax_step(sr, first, last, m[r], l[r], acc + r * d, d);
          values(acc + r * d, sr, vblk, d, d, first, last);
        }
      }
      if (np == 1) {
        for (int64_t i = 0; i < nq; ++i) {
          const int64_t tok = query_start[s] + t0 + i;
          for (int64_t g = 0; g < group; ++g) {
            const int64_t r = i * group + g;
            const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
            write_row(acc + r * d, inv, out + tok * o_stride + (kvh * group + g) * d, d, in_place);
          }
        }
        continue;
      }
      // one of a decode row's parts: keep it; the last part to finish combines them all, in order of parts
      const int64_t row_floats = d + 2;
      float* mine = partial.data() + ((partial_start[s] + kvh * np + part) * group) * row_floats;
      for (int64_t r = 0; r < group; ++r) {
        mine[r * row_floats] = m[r];
        mine[r * row_floats + 1] = l[r];
        std::memcpy(mine + r * row_floats + 2, acc + r * d, d * sizeof(float));
      }
      if (finished[(s * n_kv + kvh) * kLine].fetch_add(1, std::memory_order_acq_rel) != np - 1) continue;
      const float* all = partial.data() + (partial_start[s] + kvh * np) * group * row_floats;
      const int64_t tok = query_start[s];
      for (int64_t r = 0; r < group; ++r) {
        float mx = kNegBig, sum = 0.f;
        for (int64_t p = 0; p < np; ++p) mx = std::max(mx, all[(p * group + r) * row_floats]);
        std::fill(acc, acc + d, 0.f);
        for (int64_t p = 0; p < np; ++p) {
          const float* pr = all + (p * group + r) * row_floats;
          const float c = std::exp(pr[0] - mx);
          sum += pr[1] * c;
          for (int64_t e = 0; e < d; ++e) acc[e] += pr[2 + e] * c;
        }
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        write_row(acc, inv, out + tok * o_stride + (kvh * group + r) * d, d, in_place);
      }
    }
#ifdef MII_AMX
    if (qa) _tile_release();
#endif
  });
}

}  // namespace

// One sequence's prompt chunk (its queries [Q, h, d]) against all its keys: the sequence's blocks copied into a
// contiguous [kvh, L, d] once (in q's dtype), then ATen's SDPA with the causal (and window) mask at the chunk's
// offset.
void prompt_chunk(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  int64_t q0, int64_t q1, int64_t len, const at::Tensor& table, double scale, int64_t window) {
  const int64_t kvh = k_cache.size(1), B = k_cache.size(2), d = k_cache.size(3), Q = q1 - q0;
  const int64_t nb = (len + B - 1) / B;
  auto blocks = table.narrow(0, 0, nb).to(at::kLong);
  auto keys = [&](const at::Tensor& cache) {  // [nb, kvh, B, d] -> [1, kvh, L, d]
    return cache.index_select(0, blocks).permute({1, 0, 2, 3}).reshape({kvh, nb * B, d}).narrow(1, 0, len)
        .unsqueeze(0).to(q.scalar_type());
  };
  auto qs = q.narrow(0, q0, Q).permute({1, 0, 2}).unsqueeze(0);  // [1, h, Q, d]
  c10::optional<at::Tensor> mask;
  if (window > 0 || Q != len) {
    auto qpos = at::arange(len - Q, len, q.options().dtype(at::kLong)).unsqueeze(1);
    auto kpos = at::arange(len, q.options().dtype(at::kLong)).unsqueeze(0);
    auto allowed = kpos.le(qpos);
    if (window > 0) allowed = allowed.logical_and(kpos.gt(qpos.sub(window)));
    mask = allowed;
  }
  auto o = at::scaled_dot_product_attention(qs, keys(k_cache), keys(v_cache), mask, 0.0,
                                            /*is_causal=*/!mask.has_value(), scale, /*enable_gqa=*/true);
  out.narrow(0, q0, Q).copy_(o.squeeze(0).permute({1, 0, 2}));
}

// this step's keys (or values) [T, kvh, d] into their cache slots (slot = block * B + offset: row `offset` of each
// kv head's run in the block, or with `paired` keys lane offset % 16 of group offset / 16's d / 2 vectors), rounded
// to the cache's dtype C (to nearest even, as torch's .to() rounds) when it is not theirs
template <typename T, typename C>
void write_cache(const at::Tensor& src, at::Tensor& cache, const int64_t* slots, int64_t n, bool paired = false) {
  const T* x = src.data_ptr<T>();
  C* c = cache.data_ptr<C>();
  const int64_t kvh = cache.size(1), B = cache.size(2), d = cache.size(3), stride = src.stride(0);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t hh = 0; hh < kvh; ++hh) {
      const T* row = x + t * stride + hh * d;
      if constexpr (std::is_same_v<T, C> && sizeof(T) == 2) {
        if (paired) {  // value pair i of key o at 32-bit word (o / 16 * d / 2 + i) * 16 + o % 16 of the run
          const int64_t o = slots[t] % B;
          uint32_t* dst = reinterpret_cast<uint32_t*>(c + (slots[t] / B * kvh + hh) * B * d) + o / 16 * d * 8 + o % 16;
          const uint32_t* pairs = reinterpret_cast<const uint32_t*>(row);
          for (int64_t i = 0; i < d / 2; ++i) dst[i * 16] = pairs[i];
          continue;
        }
      }
      C* dst = c + ((slots[t] / B * kvh + hh) * B + slots[t] % B) * d;
      if constexpr (std::is_same_v<T, C>) {
        std::memcpy(dst, row, d * sizeof(T));
      } else {
        for (int64_t e = 0; e < d; ++e) dst[e] = static_cast<C>(static_cast<float>(row[e]));
      }
    }
  }
}

#ifdef MII_ATTN_Q8
// this step's keys (keys) or values [T, kvh, d] quantized into an int8 cache's slots (see MII_ATTN_Q8): the row's
// scale max|x| * (1 / 127), its values round(x * (127 / max|x|)) (to nearest even), the keys as quads offset by
// 128, the values in the accumulators' order
template <typename T>
void write_cache_q8(const at::Tensor& src, at::Tensor& cache, const int64_t* slots, int64_t n, bool keys) {
  const T* x = src.data_ptr<T>();
  int8_t* c = cache.data_ptr<int8_t>();
  const int64_t kvh = cache.size(1), B = cache.size(2), d = cache.size(3) - 4, stride = src.stride(0);
  int q[128];
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t hh = 0; hh < kvh; ++hh) {
      int8_t* run = c + (slots[t] / B * kvh + hh) * B * (d + 4);
      const int64_t o = slots[t] % B;
      reinterpret_cast<float*>(run + B * d)[o] = quantize(x + t * stride + hh * d, d, q);
      if (keys) {
        uint8_t* g = reinterpret_cast<uint8_t*>(run) + (o / 16 * (d / 4)) * 64 + (o % 16) * 4;
        for (int64_t i = 0; i < d / 4; ++i)
          for (int b = 0; b < 4; ++b) g[i * 64 + b] = static_cast<uint8_t>(q[4 * i + b] + 128);
      } else {
        int8_t* r = run + o * d;
        for (int64_t h = 0; h < d; h += 32)
          for (int i = 0; i < 16; ++i) {
            r[h + i] = static_cast<int8_t>(q[h + 2 * i]);
            r[h + 16 + i] = static_cast<int8_t>(q[h + 2 * i + 1]);
          }
      }
    }
  }
}
#endif

// q [T, h, d], k/v [T, kvh, d] (this step's; rows of each token dense), caches [blocks, kvh, block_size, d] in q's
// dtype or, under fp32 q, bf16 / fp16, or under bf16 q int8 ([blocks, kvh, block_size, d + 4]: see MII_ATTN_Q8),
// query_start [S + 1], seq_lens [S], block_tables [S, W] (int32), slot_mapping [T] (int64); returns [T, h * d].
at::Tensor paged_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                               at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& query_start,
                               const at::Tensor& seq_lens, const at::Tensor& block_tables, int64_t max_query_len,
                               double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "paged_attention: q, k, v must be [T, heads, d]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_attention: caches must be contiguous");
  const int64_t T = q.size(0), h = q.size(1), d = q.size(2), kvh = k_cache.size(1), bs = k_cache.size(2);
  const auto dt = q.scalar_type(), cdt = k_cache.scalar_type();
  const int64_t row = cdt == at::kChar ? d + 4 : d;  // (an int8 cache's rows end in their scales)
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(3) == row,
              "paged_attention: caches must be [blocks, kv_heads, block_size, ", row, "]");
  TORCH_CHECK(h % kvh == 0, "paged_attention: heads must be a multiple of kv heads");
  TORCH_CHECK(cdt != at::kChar || q8_cache(dt, d, bs), "paged_attention: an int8 cache needs bf16 queries, head size "
              "64 or 128, blocks of a multiple of 16 and a CPU with AVX512-VNNI and AVX512-BF16");
  for (const at::Tensor* x : {&q, &k, &v})
    TORCH_CHECK(x->stride(2) == 1 && x->stride(1) == d && x->scalar_type() == dt,
                "paged_attention: q, k, v must have dense rows and one dtype");
  TORCH_CHECK(v_cache.scalar_type() == cdt &&
              (cdt == dt || (dt == at::kFloat && (cdt == at::kBFloat16 || cdt == at::kHalf)) || cdt == at::kChar),
              "paged_attention: the caches must have q's dtype, or bf16/fp16 under fp32 q (got ", cdt, " for ", dt, ")");
  TORCH_CHECK(query_start.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
              block_tables.scalar_type() == at::kInt && slot_mapping.scalar_type() == at::kLong,
              "paged_attention: int32 query_start/seq_lens/block_tables and int64 slot_mapping expected");
  auto qs = query_start.contiguous(), sl = seq_lens.contiguous(), bt = block_tables.contiguous();
  auto slots = slot_mapping.contiguous();
  auto out = at::empty({T, h, d}, q.options());
  const int64_t S = sl.size(0), sdpa_min = sdpa_from(dt, cdt, d);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dt, "paged_attention_cpu", [&] {
    auto run = [&](auto cache_type) {
      using C = decltype(cache_type);
      if constexpr (std::is_same_v<C, int8_t>) {
#ifdef MII_ATTN_Q8
        write_cache_q8<scalar_t>(k, k_cache, slots.data_ptr<int64_t>(), T, true);
        write_cache_q8<scalar_t>(v, v_cache, slots.data_ptr<int64_t>(), T, false);
#endif
      } else {
        write_cache<scalar_t, C>(k, k_cache, slots.data_ptr<int64_t>(), T, keys_paired(dt, cdt, d, bs));
        write_cache<scalar_t, C>(v, v_cache, slots.data_ptr<int64_t>(), T);
      }
      if (T > 0 && S > 0)
        attend<scalar_t, C>(q.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), k_cache.data_ptr<C>(),
                            v_cache.data_ptr<C>(), qs.data_ptr<int32_t>(), sl.data_ptr<int32_t>(),
                            bt.data_ptr<int32_t>(), S, bt.size(1), h, kvh, d, bs, scale, window, q.stride(0), h * d,
                            sdpa_min);
    };
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (cdt == at::kBFloat16) return run(c10::BFloat16());
      if (cdt == at::kHalf) return run(c10::Half());
    }
    if constexpr (q8_type<scalar_t, int8_t>()) {
      if (cdt == at::kChar) return run(int8_t());
    }
    run(scalar_t());
  });
  const int32_t* qsp = qs.data_ptr<int32_t>();
  for (int64_t i = 0; i < S; ++i) {
    if (qsp[i + 1] - qsp[i] >= sdpa_min)
      prompt_chunk(q, out, k_cache, v_cache, qsp[i], qsp[i + 1], sl.data_ptr<int32_t>()[i], bt[i], scale, window);
  }
  return out.view({T, h * d});
}

// whether paged_attention keeps the keys of a cache like k_cache, under queries of q's dtype, as pairs (bf16) or
// quads (int8: where it reads an int8 cache at all)
bool keys_paired_cpu(const at::Tensor& q, const at::Tensor& k_cache) {
  if (k_cache.dim() != 4) return false;
  if (k_cache.scalar_type() == at::kChar) return q8_cache(q.scalar_type(), k_cache.size(3) - 4, k_cache.size(2));
  return keys_paired(q.scalar_type(), k_cache.scalar_type(), k_cache.size(3), k_cache.size(2));
}

TORCH_LIBRARY_IMPL(mii, CPU, m) {
  m.impl("paged_attention", &paged_attention_cpu);
  m.impl("keys_paired", &keys_paired_cpu);
}

