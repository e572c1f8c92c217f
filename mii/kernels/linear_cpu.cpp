// y = x @ w.T + bias with w stored in bf16 and the math in fp32: mii::linear_bf16w. Two layouts:
// - k-pair tiles [N/16, K/2, 32], for CPUs with native bf16 dot products (AVX512-BF16) and bf16 activations:
//   `vdpbf16ps` multiplies 16 rows by a broadcast pair of x's columns (see kpair_gemm below). Measured on a Zen 4
//   EPYC: 1.3-2x oneDNN's prepacked weights at 1-16 rows of x, even at 33-64, ~0.9x at 256.
// - for CPUs without native bf16 matmul (AVX2 machines), where oneDNN's bf16 GEMM crawls and fp32 weights cost
//   twice the bytes per decode step, the weights widened to fp32 in registers:
//   - up to kGemvRows rows of x (decode): every weight row is streamed once from memory, widened bf16 -> fp32 in
//   registers (a 16-bit shift) and multiplied with all rows of x at once; the bytes read are what limit it.
//   - more rows (prompt chunks, big batches): each thread widens a block of weight rows into an fp32 buffer that
//   stays in cache and multiplies it with ATen's fp32 GEMM, so the cost of widening is shared by all the rows.
// The weight is either row-major [N, K] or tiled [N/8, K/8, 64] (`tile_bf16w` in mii/layers/linear.py, at load):
// a tile holds 8 rows x 8 columns, rows interleaved in pairs (element j of rows 2p and 2p+1 side by side), so the
// kernel reads the whole weight as one sequential stream — rows of a few hundred columns, as in small models,
// otherwise make many short streams the hardware prefetcher follows badly — and widens two rows with one
// 32-byte load, a shift (even lanes) and a mask (odd lanes).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_vec.h"
#include "team.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MII_AVX2 1
#endif
#if defined(MII_AVX2) && defined(__AVX512F__) && defined(__AVX512BF16__)
#define MII_BF16DP 1  // vdpbf16ps: 32 bf16 multiply-adds into 16 fp32 sums an instruction
#endif

namespace {

constexpr int64_t kGemvRows = 16;    // rows of x handled by the streaming kernel; more go through blocked GEMM
constexpr int64_t kTiledRows = 32;   // the same for tiled weights (measured: 1.46x ATen's GEMM at 17 rows, even at 32)
constexpr int kPrefetchGroups = 4;   // weight rows are prefetched this many row groups ahead
constexpr int64_t kGemmBlock = 128;  // weight rows widened to fp32 at a time for the GEMM path

inline float bf16_to_float(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

#ifdef MII_AVX2
inline __m256 load_bf16x8(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// y[m, n] = sum_k x[m, k] * w[n, k] for M rows of x and R weight rows n0..n0+R-1 (M * R accumulators).
template <int M, int R>
inline void dot_rows(const float* x, int64_t K, const uint16_t* w, int64_t n0, float* y, int64_t ldy) {
  int64_t k = 0;
  float out[M][R];
#ifdef MII_AVX2
  __m256 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (n0 + r + kPrefetchGroups * R) * K + k), _MM_HINT_T0);
      wv[r] = load_bf16x8(w + (n0 + r) * K + k);
    }
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) out[m][r] = hsum(acc[m][r]);
#else
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) out[m][r] = 0.f;
#endif
  for (; k < K; ++k)
    for (int r = 0; r < R; ++r) {
      const float wk = bf16_to_float(w[(n0 + r) * K + k]);
      for (int m = 0; m < M; ++m) out[m][r] += x[m * K + k] * wk;
    }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) y[m * ldy + n0 + r] = out[m][r];
}

// Rows of x in groups of up to 4 against R weight rows at a time (as many as the 16 vector registers allow next
// to the accumulators): the R rows are read from memory once, and from L1 for the later groups of x.
template <int R>
inline void dot_group(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0, float* y, int64_t N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) dot_rows<4, R>(x + m * K, K, w, n0, y + m * N, N);
  switch (M - m) {
    case 1: dot_rows<1, R>(x + m * K, K, w, n0, y + m * N, N); break;
    case 2: dot_rows<2, R>(x + m * K, K, w, n0, y + m * N, N); break;
    case 3: dot_rows<3, R>(x + m * K, K, w, n0, y + m * N, N); break;
  }
}

template <int R>
void gemv(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y) {
  // a task streams at least ~64 KB of weights, in whole groups of R rows
  const int64_t grain = std::max<int64_t>(R, (32768 / std::max<int64_t>(K, 1)) / R * R);
  mii_team::parallel_for(0, (N + R - 1) / R, std::max<int64_t>(1, grain / R), [&](int64_t b, int64_t e) {
    for (int64_t g = b; g < e; ++g) {
      const int64_t n0 = g * R;
      if (n0 + R <= N) {
        dot_group<R>(x, M, K, w, n0, y, N);
      } else {
        for (int64_t n = n0; n < N; ++n) dot_group<1>(x, M, K, w, n, y, N);
      }
    }
  });
}

void widen(const uint16_t* src, float* dst, int64_t count) {
  int64_t i = 0;
#ifdef MII_AVX2
  for (; i + 8 <= count; i += 8) _mm256_storeu_ps(dst + i, load_bf16x8(src + i));
#endif
  for (; i < count; ++i) dst[i] = bf16_to_float(src[i]);
}

// --- tiled weights: [N/8][K/8][pair p][column j][row 2p + s], 64 bf16 (128 bytes) a tile --------------------------

constexpr int64_t kTile = 64;
constexpr int64_t kPrefetchTiles = 16;  // ~2 KB ahead

#ifdef MII_AVX2
// 8 accumulators of one row group -> their 8 sums, in order
inline __m256 reduce8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

#ifdef MII_AVX2
// One row of x against the group's 8 weight rows: every tile read once, 8 accumulators (single-stream decode).
inline void tiled_row(const float* xm, int64_t KT, const uint16_t* group, float* ym) {
  const __m256i odd = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[8];
  for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t kt = 0; kt < KT; ++kt) {
    const uint16_t* t = group + kt * kTile;
    // both cache lines of the tile kPrefetchTiles ahead
    _mm_prefetch(reinterpret_cast<const char*>(t + kPrefetchTiles * kTile), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(t + kPrefetchTiles * kTile + 32), _MM_HINT_T0);
    const __m256 xv = _mm256_loadu_ps(xm + kt * 8);
    for (int p = 0; p < 4; ++p) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + p * 16));
      acc[2 * p] = _mm256_fmadd_ps(xv, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), acc[2 * p]);
      acc[2 * p + 1] = _mm256_fmadd_ps(xv, _mm256_castsi256_ps(_mm256_and_si256(v, odd)), acc[2 * p + 1]);
    }
  }
  _mm256_storeu_ps(ym, reduce8(acc));
}

// MR rows of x (up to 4) against one pair of weight rows (2p, 2p+1): each weight vector widened once for MR rows,
// 2 x MR accumulators. (6 rows, 12 accumulators, measured no faster: 6 rows of a 1536-wide x overflow L1.)
template <int MR>
inline void tiled_rows_pair(const float* x, int64_t K, const uint16_t* group, int p, float* y, int64_t N) {
  const __m256i odd = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[2 * MR];  // [row of x][even, odd weight row]
  for (int r = 0; r < 2 * MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t kt = 0; kt < K / 8; ++kt) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + kt * kTile + p * 16));
    const __m256 even_w = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    const __m256 odd_w = _mm256_castsi256_ps(_mm256_and_si256(v, odd));
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + kt * 8);
      acc[2 * m] = _mm256_fmadd_ps(xv, even_w, acc[2 * m]);
      acc[2 * m + 1] = _mm256_fmadd_ps(xv, odd_w, acc[2 * m + 1]);
    }
  }
  for (int m0 = 0; m0 < MR; m0 += 4) {  // reduce8 sums 8 accumulators: 4 rows of x at a time
    __m256 part[8];
    for (int r = 0; r < 8; ++r) part[r] = 2 * m0 + r < 2 * MR ? acc[2 * m0 + r] : _mm256_setzero_ps();
    alignas(32) float sums[8];
    _mm256_store_ps(sums, reduce8(part));
    for (int m = m0; m < std::min(MR, m0 + 4); ++m) {
      y[m * N + 2 * p] = sums[2 * (m - m0)];
      y[m * N + 2 * p + 1] = sums[2 * (m - m0) + 1];
    }
  }
}

template <int MR>
inline void tiled_block(const float* x, int64_t K, const uint16_t* group, float* y, int64_t N) {
  for (int p = 0; p < 4; ++p) tiled_rows_pair<MR>(x, K, group, p, y, N);
}
#endif

// y[m, 8g .. 8g+7] for every row m of x, from the group's K/8 tiles (read from memory once, then from cache)
inline void tiled_group(const float* x, int64_t M, int64_t K, const uint16_t* group, float* y, int64_t N) {
  int64_t m = 0;
#ifdef MII_AVX2
  for (; m + 4 <= M; m += 4) tiled_block<4>(x + m * K, K, group, y + m * N, N);
  switch (M - m) {
    case 3: tiled_block<3>(x + m * K, K, group, y + m * N, N); break;
    case 2: tiled_block<2>(x + m * K, K, group, y + m * N, N); break;
    case 1: tiled_row(x + m * K, K / 8, group, y + m * N); break;
  }
  m = M;
#else
  for (; m < M; ++m)
    for (int r = 0; r < 8; ++r) {
      float sum = 0.f;
      for (int64_t k = 0; k < K; ++k)
        sum += x[m * K + k] * bf16_to_float(group[(k / 8) * kTile + (r / 2) * 16 + (k % 8) * 2 + r % 2]);
      y[m * N + r] = sum;
    }
#endif
}

void tiled_gemv(const float* x, int64_t M, int64_t K, const uint16_t* tiles, int64_t N, float* y) {
  const int64_t groups = N / 8, group_elems = K * 8;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(group_elems, 1));  // ~64 KB a task
  mii_team::parallel_for(0, groups, grain, [&](int64_t b, int64_t e) {
    for (int64_t g = b; g < e; ++g) tiled_group(x, M, K, tiles + g * group_elems, y + g * 8, N);
  });
}

// rows n0 .. n0+count-1 (multiples of 8) of a tiled weight -> row-major fp32
void widen_tiled(const uint16_t* tiles, int64_t K, int64_t n0, int64_t count, float* dst) {
  const int64_t KT = K / 8;
  for (int64_t g = n0 / 8; g < (n0 + count) / 8; ++g) {
    float* rows = dst + (g * 8 - n0) * K;
    for (int64_t kt = 0; kt < KT; ++kt) {
      const uint16_t* t = tiles + (g * KT + kt) * kTile;
      for (int p = 0; p < 4; ++p) {
#ifdef MII_AVX2
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + p * 16));
        _mm256_storeu_ps(rows + (2 * p) * K + kt * 8, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
        _mm256_storeu_ps(rows + (2 * p + 1) * K + kt * 8,
                         _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)))));
#else
        for (int j = 0; j < 8; ++j)
          for (int s2 = 0; s2 < 2; ++s2) rows[(2 * p + s2) * K + kt * 8 + j] = bf16_to_float(t[p * 16 + j * 2 + s2]);
#endif
      }
    }
  }
}

// Blocks of kGemmBlock weight rows in parallel: widen into a per-task buffer, then y[:, block] = x @ block.T.
void blocked_gemm(const at::Tensor& x, const uint16_t* w, bool tiled, int64_t N, int64_t K, at::Tensor& y) {
  // about kGemmBlock rows a block, in a multiple of the thread count so that no thread idles at the end
  const int64_t threads = at::get_num_threads();
  const int64_t blocks = ((N + kGemmBlock - 1) / kGemmBlock + threads - 1) / threads * threads;
  const int64_t rows = ((N + blocks - 1) / blocks + 7) / 8 * 8;
  const bool inference = c10::InferenceMode::is_enabled();  // OpenMP threads do not inherit it
  mii_team::parallel_for(0, blocks, 1, [&](int64_t b, int64_t e) {
    c10::InferenceMode guard(inference);
    std::vector<float> buf(rows * K);
    auto wt = at::from_blob(buf.data(), {rows, K}, at::TensorOptions().dtype(at::kFloat));
    for (int64_t blk = b; blk < e; ++blk) {
      const int64_t n0 = blk * rows, nb = std::min(rows, N - n0);
      if (nb <= 0) continue;
      if (tiled) {
        widen_tiled(w, K, n0, nb, buf.data());
      } else {
        widen(w + n0 * K, buf.data(), nb * K);
      }
      auto out = y.narrow(1, n0, nb);
      at::mm_out(out, x, wt.narrow(0, 0, nb).t());
    }
  });
}

// --- k-pair tiles, for CPUs with native bf16 dot products: [N/16][K/2][row r][s], 32 bf16 (64 bytes) a tile ---
// Tile j of a 16-row group holds columns 2j and 2j+1 of its 16 rows, so that one `vdpbf16ps` multiplies all 16
// rows by x's pair of columns (broadcast) and adds both products into each row's own fp32 lane: no horizontal
// sums, and the same instruction stream for one row of x (decode) or many (prompt chunks). x must be bf16.

constexpr int64_t kPairTile = 32;

#ifdef MII_BF16DP
// rows m0 .. m0+MR-1 of x against G 16-row groups (each K/2 tiles) `far` groups apart (1: consecutive), fp32
// results into y. kStream: the weights are read once (a decode step's rows, up to 64), prefetched
// into L2 rather than L1 (a decode step's 120 bf16 linears, 212 MB streamed, 2 threads, alternating runs: 21-30 ->
// 29-34 GB/s; where many row blocks follow, into L1: [3072, 576] at 64 rows 386-417 GFLOP/s, 295-305 into L2)
template <int MR, int G, bool kStream = false>
inline void kpair_block(const uint16_t* x, int64_t K, const uint16_t* w, float* y, int64_t N, int64_t far = 1) {
  const int64_t KP = K / 2, stride = KP * kPairTile * far;
  __m512 acc[MR][G];
  for (int m = 0; m < MR; ++m)
    for (int g = 0; g < G; ++g) acc[m][g] = _mm512_setzero_ps();
  for (int64_t j = 0; j < KP; ++j) {
    __m512bh wv[G];
    for (int g = 0; g < G; ++g) {
      const uint16_t* t = w + g * stride + j * kPairTile;
      // 1 KB ahead
      _mm_prefetch(reinterpret_cast<const char*>(t + 16 * kPairTile), kStream ? _MM_HINT_T1 : _MM_HINT_T0);
      wv[g] = (__m512bh)_mm512_loadu_si512(t);
    }
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * K + 2 * j, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int g = 0; g < G; ++g) acc[m][g] = _mm512_dpbf16_ps(acc[m][g], wv[g], xv);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(y + m * N + g * far * 16, acc[m][g]);
}

// every row of x against G groups `far` apart: rows of x in blocks of 4 (16 accumulators) and 3
template <int G, bool kStream>
inline void kpair_rows(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, float* y, int64_t N,
                       int64_t far = 1) {
  mii_vec::by_fours_and_threes(M, [&](int64_t m, int R) {
    switch (R) {
      case 4: kpair_block<4, G, kStream>(x + m * K, K, w, y + m * N, N, far); break;
      case 3: kpair_block<3, G, kStream>(x + m * K, K, w, y + m * N, N, far); break;
      case 2: kpair_block<2, G, kStream>(x + m * K, K, w, y + m * N, N, far); break;
      default: kpair_block<1, G, kStream>(x + m * K, K, w, y + m * N, N, far);
    }
  });
}
#endif

#ifdef MII_AMX
constexpr int64_t kAmxRows = 5;  // rows of x from which kpair_gemm takes AMX (see there)

// The k-pair layout is AMX's B-tile layout: 16 consecutive tiles of a 16-row group (32 of x's columns) are one
// 16 x 64-byte tile for `tdpbf16ps`.
// y [M, N] fp32 = x (bf16 [M, K], K a multiple of 32) @ w.T with AMX: each task takes 32 columns of w (two 16-row
// groups, 2 x K x 64 bytes, kept in L2) past every 32 rows of x; tiles 0-3 the 32 x 32 sums, 4-5 x, 6-7 w.
// yb: y in bf16 instead (rounded to nearest even, as linear_output rounds, without its pass over an fp32 copy), or null.
void kpair_gemm_amx(const uint16_t* x, int64_t M, int64_t K, const uint16_t* tiles, int64_t N, float* y,
                    at::BFloat16* yb = nullptr) {
  const int64_t groups = N / 16, group_elems = K * 16, Mp = (M + 31) / 32 * 32;
  std::vector<uint16_t> padded;
  if (Mp != M) {  // x's last rows padded with zeros to a whole tile; their sums are not stored
    padded.assign(Mp * K, 0);
    std::memcpy(padded.data(), x, M * K * sizeof(uint16_t));
    x = padded.data();
  }
  mii_team::parallel_for(0, (groups + 1) / 2, 1, [&](int64_t b, int64_t e) {
    mii_vec::amx_configure();
    alignas(64) float part[4][16 * 16];
    for (int64_t p = b; p < e; ++p) {
      const int64_t g0 = 2 * p;
      const bool two = g0 + 1 < groups;
      const uint16_t* w0 = tiles + g0 * group_elems;
      const uint16_t* w1 = two ? w0 + group_elems : w0;
      for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t k0 = 0; k0 < K; k0 += 32)
          mii_vec::amx_dots_2x2(x + m0 * K + k0, x + (m0 + 16) * K + k0, K * 2, w0 + k0 * 16, w1 + k0 * 16);
        float* out = yb ? nullptr : y + m0 * N + g0 * 16;
        if (!yb && m0 + 32 <= M) {
          _tile_stored(0, out, N * 4);
          _tile_stored(1, out + 16 * N, N * 4);
          if (two) {
            _tile_stored(2, out + 16, N * 4);
            _tile_stored(3, out + 16 * N + 16, N * 4);
          }
          continue;
        }
        _tile_stored(0, part[0], 64);
        _tile_stored(1, part[1], 64);
        _tile_stored(2, part[2], 64);
        _tile_stored(3, part[3], 64);
        for (int64_t r = 0; r < 32 && m0 + r < M; ++r)
          for (int g = 0; g < (two ? 2 : 1); ++g) {
            const float* sums = part[2 * g + r / 16] + (r % 16) * 16;
            if (yb) mii_vec::bf16_store(yb + (m0 + r) * N + g0 * 16 + g * 16, _mm512_load_ps(sums));
            else std::memcpy(out + r * N + g * 16, sums, 64);
          }
      }
    }
    _tile_release();
  });
}
#endif

// y [M, N] fp32 = x (bf16 [M, K]) @ w.T for a k-pair tiled w
void kpair_gemm(const uint16_t* x, int64_t M, int64_t K, const uint16_t* tiles, int64_t N, float* y) {
  const int64_t groups = N / 16, group_elems = K * 16;
  constexpr int64_t kSuper = 4;  // 16-row groups a task step handles together (64 rows of w)
  constexpr int64_t kDecodeRows = 64;  // rows of x up to which the weights stream in far runs
#ifdef MII_BF16DP
  // decode steps (up to kDecodeRows rows, the weights read once): each thread's groups as kSuper runs far apart, one
  // group of each run at a time, four long sequential streams where one 64-row slice after another restarted four
  // short ones. Alternated in one process, single-stream bf16 decode (2 threads): 10 of 14 steps faster, medians
  // 12.6 → 12.3 and 13.1 → 12.0 ms; the LM head [49152, 576] 2.1-2.3 → 1.7 ms. A decode step's 120 bf16 linears
  // streamed: 5 rows 11.7 → 10.5 ms, 8 rows 12.5-13.0 → 10.9-11.1, 16 rows 15.8 → 14.9, 64 rows 59.2 → 54.2 (at 256
  // rows even). The same sums in the same order.
#ifdef MII_AMX
  // AMX from 5 rows of x, padded to 32 (an AMX Xeon, 2 threads, a decode step's 120 linears streamed: 1-4 rows
  // 10.4-10.6 ms against vdpbf16ps's 7.9-8.3, 6 rows 10.5 / 11.1, 8 rows 10.7 / 12.6, 32 rows 11.7 / 37.6, 64 rows
  // 16.1 / 71.2; one [3072, 576] linear at 256 rows 1,452 against 215 GFLOP/s). Other sums than vdpbf16ps's (fp32
  // order and AMX's own accumulation), the same for a row whichever block of 32 it lands in.
  if (M >= kAmxRows && K % 32 == 0 && mii_vec::amx_usable()) {
    kpair_gemm_amx(x, M, K, tiles, N, y);
    return;
  }
#endif
  if (M <= kDecodeRows) {
    mii_team::parallel_for(0, groups, kSuper, [&](int64_t b, int64_t e) {
      // runs of S groups, the last one shorter: the groups past kSuper whole runs ride along in the runs' last
      // steps, several streams at a time, where they came one group after another at the end (single-stream bf16
      // decode, alternated every 4 steps in one process: 8 of 8 rounds faster, 0.3-1.2%; the same sums)
      static_assert(kSuper == 4, "a step takes up to 4 runs' groups (the switch below)");
      const int64_t n = e - b, S = (n + kSuper - 1) / kSuper, runs = (n + S - 1) / S, last = n - (runs - 1) * S;
      for (int64_t i = 0; i < S; ++i) {
        const int64_t g = b + i;
        switch (i < last ? runs : runs - 1) {
          case 4: kpair_rows<4, true>(x, M, K, tiles + g * group_elems, y + g * 16, N, S); break;
          case 3: kpair_rows<3, true>(x, M, K, tiles + g * group_elems, y + g * 16, N, S); break;
          case 2: kpair_rows<2, true>(x, M, K, tiles + g * group_elems, y + g * 16, N, S); break;
          default: kpair_rows<1, true>(x, M, K, tiles + g * group_elems, y + g * 16, N, S);
        }
      }
    });
    return;
  }
#endif
  // more rows: each 64-row slice of w (K * 128 bytes) is read from memory once and stays in L2 while every row of
  // x passes; 32-row slices where that evens out the threads' shares (a [576, K] weight's 36 groups as 18 tasks,
  // not 9: 5 on one thread, 4 on the other)
#ifdef MII_BF16DP
  const int64_t per_task = mii_vec::balanced_share(groups, at::get_num_threads(), kSuper);
#else
  const int64_t per_task = kSuper;
#endif
  mii_team::parallel_for(0, (groups + per_task - 1) / per_task, 1, [&](int64_t b, int64_t e) {
    for (int64_t sg = b; sg < e; ++sg) {
      const int64_t g0 = sg * per_task, ng = std::min(per_task, groups - g0);
      const uint16_t* w = tiles + g0 * group_elems;
      float* yb = y + g0 * 16;
#ifdef MII_BF16DP
      if (ng == 4) {
        kpair_rows<4, false>(x, M, K, w, yb, N);
      } else if (ng == 2) {
        kpair_rows<2, false>(x, M, K, w, yb, N);
      } else {
        for (int64_t g = 0; g < ng; ++g) kpair_rows<1, false>(x, M, K, w + g * group_elems, yb + g * 16, N);
      }
#else
      for (int64_t m = 0; m < M; ++m)
        for (int64_t r = 0; r < ng * 16; ++r) {
          const uint16_t* t = w + (r / 16) * group_elems + (r % 16) * 2;
          float sum = 0.f;
          for (int64_t j = 0; j < K / 2; ++j)
            sum += bf16_to_float(x[m * K + 2 * j]) * bf16_to_float(t[j * kPairTile]) +
                   bf16_to_float(x[m * K + 2 * j + 1]) * bf16_to_float(t[j * kPairTile + 1]);
          yb[m * N + r] = sum;
        }
#endif
    }
  });
}

}  // namespace

// bf16 <-> fp32 for the linears' inputs and outputs, done here rather than by Tensor::to: for a decode row the
// conversion is a few hundred values, and the dispatcher round trip and TensorIterator set-up around it cost
// ~4 us a call with 2 threads (measured: an int4 [576, 576] linear on one bf16 row 20.6 us, on fp32 11.2 us), ~1 ms
// of a decode step's 120 linears. Large ones are split over the threads as ATen's copy splits them.
constexpr int64_t kConvertGrain = 32768;

template <class F>
inline void for_elements(int64_t n, F&& f) {  // f(begin, end) over [0, n), in parallel when large
  if (n < 2 * kConvertGrain) {
    f(0, n);
  } else {
    mii_team::parallel_for(0, n, kConvertGrain, f);
  }
}

// x as the linear kernels read it: [M, K], dense fp32 (a decode step's x already is: no dispatcher call then)
at::Tensor linear_input(const at::Tensor& x, int64_t K) {
  const at::Tensor x2 = x.dim() == 2 ? x : x.reshape({-1, K});
  if (x2.scalar_type() == at::kFloat && x2.is_contiguous()) return x2;
  if (x2.scalar_type() != at::kBFloat16 || !x2.is_contiguous()) return x2.to(at::kFloat).contiguous();
  auto out = at::empty(x2.sizes(), x2.options().dtype(at::kFloat));
  const uint16_t* src = reinterpret_cast<const uint16_t*>(x2.data_ptr<at::BFloat16>());
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data_ptr<float>());
  for_elements(x2.numel(), [&](int64_t b, int64_t e) {  // a bf16 is the upper half of its fp32
    for (int64_t i = b; i < e; ++i) dst[i] = static_cast<uint32_t>(src[i]) << 16;
  });
  return out;
}

// y [M, N] fp32 -> plus the bias, in x's dtype and leading dimensions
at::Tensor linear_output(at::Tensor y, const at::Tensor& x, const c10::optional<at::Tensor>& bias) {
  const bool has_bias = bias.has_value() && bias->defined();
  if (x.scalar_type() == at::kBFloat16 && y.is_contiguous()) {  // bias and rounding in one pass, as torch rounds
    const int64_t N = y.size(1);
    const at::Tensor b = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
    const float* bp = has_bias ? b.data_ptr<float>() : nullptr;
    auto out = at::empty(y.sizes(), y.options().dtype(at::kBFloat16));
    const float* src = y.data_ptr<float>();
    at::BFloat16* dst = out.data_ptr<at::BFloat16>();
    const auto one = [&](int64_t i) { dst[i] = at::BFloat16(bp ? src[i] + bp[i % N] : src[i]); };
    for_elements(y.numel(), [&](int64_t s, int64_t e) {
      int64_t i = s;
#ifdef MII_BF16_VEC
      if (N % 16 == 0) {  // runs of 16 that start at a multiple of 16: within one row of the bias
        for (; i < e && i % 16; ++i) one(i);
        for (; i + 16 <= e; i += 16) {
          const __m512 v = _mm512_loadu_ps(src + i);
          mii_vec::bf16_store(dst + i, bp ? _mm512_add_ps(v, _mm512_loadu_ps(bp + i % N)) : v);
        }
      }
#endif
      for (; i < e; ++i) one(i);
    });
    y = out;
  } else {
    if (has_bias) y.add_(bias->to(at::kFloat));
    if (x.scalar_type() != at::kFloat) y = y.to(x.scalar_type());
  }
  if (x.dim() == 2) return y;
  auto sizes = x.sizes().vec();
  sizes.back() = y.size(1);
  return y.view(sizes);
}

// M = 1-8 bf16 rows x [M, K] through k-pair tiles [N rows, K] (contiguous) plus a bias (bf16 [N], or none) into y
// [M, N], bf16: linear_bf16w_cpu's path for them without its tensors (mii::decoder_stack's few-row steps), the same
// values (without a bias, AMX from kAmxRows rows where it is usable, writing bf16; else the fp32 sums plus the bias,
// rounded as linear_output rounds). False for a weight of another form, or where this CPU has no native bf16 dot
// products; x == nullptr: only whether it would take the weight (its shape checked).
bool linear_bf16w_rows(const at::BFloat16* x, int64_t M, int64_t K, const at::Tensor& weight, const at::BFloat16* bias,
                       at::BFloat16* y, int64_t N) {
#ifdef MII_BF16DP
  if (weight.dim() != 3 || weight.size(2) != kPairTile || weight.scalar_type() != at::kBFloat16) return false;
  TORCH_CHECK(weight.size(0) * 16 == N && weight.size(1) * 2 == K && weight.is_contiguous(), "decoder_stack: a weight of ",
              weight.size(0) * 16, " x ", weight.size(1) * 2, " where ", N, " x ", K, " was expected");
  if (x == nullptr) return true;
  const auto* xp = reinterpret_cast<const uint16_t*>(x);
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
#ifdef MII_AMX
  if (bias == nullptr && M >= kAmxRows && K % 32 == 0 && mii_vec::amx_usable()) {
    kpair_gemm_amx(xp, M, K, wp, N, nullptr, y);
    return true;
  }
#endif
  thread_local std::vector<float> acc;
  if (static_cast<int64_t>(acc.size()) < M * N) acc.resize(M * N);
  kpair_gemm(xp, M, K, wp, N, acc.data());
  mii_vec::round_rows(acc.data(), bias, y, M, N);
  return true;
#else
  return false;
#endif
}

at::Tensor linear_bf16w_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  if (weight.dim() == 3 && weight.size(2) == kPairTile) {  // k-pair tiles: [N/16, K/2, 32]
    TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "linear_bf16w: k-pair tiles must be bf16");
    const int64_t N = weight.size(0) * 16, K = weight.size(1) * 2;
    TORCH_CHECK(x.size(-1) == K, "linear_bf16w: x has ", x.size(-1), " features, the weight ", K);
    const at::Tensor x2 = x.reshape({-1, K});
    const at::Tensor xb =
        x2.scalar_type() == at::kBFloat16 && x2.is_contiguous() ? x2 : x2.to(at::kBFloat16).contiguous();
    const at::Tensor w = weight.contiguous();
#ifdef MII_AMX
    // bf16 x through AMX without a bias: y written in bf16 by the kernel (kpair_gemm's AMX case)
    if (x2.scalar_type() == at::kBFloat16 && xb.size(0) >= kAmxRows && N > 0 && K % 32 == 0
        && !(bias.has_value() && bias->defined()) && mii_vec::amx_usable()) {
      auto sizes = x.sizes().vec();
      sizes.back() = N;
      at::Tensor out = at::empty(sizes, x.options());
      kpair_gemm_amx(reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>()), xb.size(0), K,
                     reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), N, nullptr,
                     out.data_ptr<at::BFloat16>());
      return out;
    }
#endif
    auto y = at::empty({xb.size(0), N}, xb.options().dtype(at::kFloat));
    if (xb.size(0) > 0 && N > 0)
      kpair_gemm(reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>()), xb.size(0), K,
                 reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), N, y.data_ptr<float>());
    return linear_output(y, x, bias);
  }
  const bool tiled = weight.dim() == 3;
  TORCH_CHECK((weight.dim() == 2 || (tiled && weight.size(2) == kTile)) && weight.scalar_type() == at::kBFloat16,
              "linear_bf16w: weight must be bf16, [N, K] or tiled [N/8, K/8, 64]");
  const int64_t N = tiled ? weight.size(0) * 8 : weight.size(0), K = tiled ? weight.size(1) * 8 : weight.size(1);
  TORCH_CHECK(x.size(-1) == K, "linear_bf16w: x has ", x.size(-1), " features, the weight ", K);
  // (no dispatcher calls for what a decode step already has: 2-D dense fp32 rows and a dense weight)
  const at::Tensor xf = linear_input(x, K);
  const int64_t M = xf.size(0);
  const at::Tensor w = weight.is_contiguous() ? weight : weight.contiguous();
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto y = at::empty({M, N}, xf.options());
  if (M > 0 && N > 0) {
    const float* xp = xf.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    if (M > (tiled ? kTiledRows : kGemvRows)) {
      blocked_gemm(xf, wp, tiled, N, K, y);
    } else if (tiled) {
      tiled_gemv(xp, M, K, wp, N, yp);
    } else if (M <= 2) {
      gemv<4>(xp, M, K, wp, N, yp);
    } else {
      gemv<2>(xp, M, K, wp, N, yp);
    }
  }
  return linear_output(y, x, bias);
}

// Rows `ids` of a tiled bf16 weight, row-major [*ids.shape, K]: the embedding lookup of a tied LM head, one pass of
// word copies where the torch indexing of the tiles (mii/layers/linear.py's tiled_rows, its reference) set up an
// advanced-indexing kernel every step (~20 us a decode token warm, ~130 in the step). k-pair tiles [N/16, K/2, 32]:
// word j of row 16g + r at tile (g, j), word r; 8-row tiles [N/8, K/8, 64]: value c of row 8g + 2p + s, column block
// b, at tile (g, b), element 16p + 2c + s.
at::Tensor tiled_rows_cpu(const at::Tensor& tiles, const at::Tensor& ids) {
  TORCH_CHECK(tiles.dim() == 3 && tiles.scalar_type() == at::kBFloat16 && tiles.is_contiguous() &&
              (tiles.size(2) == kPairTile || tiles.size(2) == kTile),
              "tiled_rows: tiles must be contiguous bf16 [N/16, K/2, 32] or [N/8, K/8, 64]");
  const bool kpairs = tiles.size(2) == kPairTile;
  const int64_t N = tiles.size(0) * (kpairs ? 16 : 8), K = tiles.size(1) * (kpairs ? 2 : 8);
  const at::Tensor id = ids.to(at::kLong).contiguous();
  const int64_t T = id.numel();
  const int64_t* ip = id.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK_INDEX(ip[t] >= 0 && ip[t] < N, "tiled_rows: index ", ip[t], " is out of range for ", N, " rows");
  auto sizes = ids.sizes().vec();
  sizes.push_back(K);
  auto out = at::empty(sizes, tiles.options());
  const uint16_t* w = reinterpret_cast<const uint16_t*>(tiles.data_ptr<at::BFloat16>());
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t row = ip[t];
      uint16_t* dst = o + t * K;
      if (kpairs) {
        const uint16_t* src = w + (row / 16) * (K / 2) * kPairTile + (row % 16) * 2;
        for (int64_t j = 0; j < K / 2; ++j) std::memcpy(dst + 2 * j, src + j * kPairTile, 4);
      } else {
        const int64_t r = row % 8;
        const uint16_t* src = w + (row / 8) * (K / 8) * kTile + (r / 2) * 16 + r % 2;
        for (int64_t blk = 0; blk < K / 8; ++blk)
          for (int64_t c = 0; c < 8; ++c) dst[blk * 8 + c] = src[blk * kTile + 2 * c];
      }
    }
  });
  return out;
}

TORCH_LIBRARY_IMPL(mii, CPU, m) {
  m.impl("linear_bf16w", &linear_bf16w_cpu);
  m.impl("tiled_rows", &tiled_rows_cpu);
}
