// bf16 <-> fp32 for 16 values at a time (AVX-512), with c10::BFloat16's arithmetic: a bf16 is the upper half of
// its fp32, and fp32 -> bf16 rounds to nearest even (NaN -> 0x7FC0), as torch rounds. Integer operations only, so
// -ffast-math cannot change them, and denormals round like any other value (AVX512-BF16's vcvtneps2bf16 flushes
// them). And a 16 x 16 transpose of 32-bit lanes (the int4 GEMM's tiles, attention's keys as pairs), and the
// split of x's rows into register blocks of 4 and 3 (the GEMMs' `vdpbf16ps` blocks). Included by the kernels'
// sources; part of the build's hash (mii/kernels/__init__.py).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#if defined(__AMX_TILE__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define MII_BF16_VEC 1

namespace mii_vec {

inline __m512 bf16_load(const void* p) {  // 16 bf16 -> fp32
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p))), 16));
}

// fp32 -> bf16 to nearest even without bf16_round's NaN check: for values computed from bf16 inputs, whose NaNs (if
// any) have a zero low half (the default NaN, or an input's payload, quieted), so that a NaN keeps its upper half
// (torch writes 0x7FC0 for every NaN: the same value, other payload bits); infinities and overflow as bf16_round.
// ~20% of an element-wise loop.
inline __m512i bf16_round_bits(__m512 v) {  // 16 fp32 -> bf16 in the low half of each 32-bit lane
  const __m512i u = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  return _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
}

inline __m256i bf16_round(__m512 v) {  // 16 fp32 -> bf16, to nearest even
  const __m512i magnitude = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7FFFFFFF));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7F800000));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(bf16_round_bits(v), nan, _mm512_set1_epi32(0x7FC0)));
}

// bf16_rounded and bf16_store by bf16_round_bits, for values computed from bf16 inputs
inline __m512 bf16_rounded_fast(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_round_bits(v), 16)); }
inline void bf16_store_fast(void* p, __m512 v) {
  _mm256_storeu_si256(static_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_round_bits(v)));
}

inline void bf16_store(void* p, __m512 v) {
  _mm256_storeu_si256(static_cast<__m256i*>(p), bf16_round(v));
}

// y [M, N] = bf16(acc + bias) (bias [N] bf16, or none), as linear_output rounds a linear's fp32 sums (N % 16 == 0)
inline void round_rows(const float* acc, const void* bias, void* y, int64_t M, int64_t N) {
  const auto* b = static_cast<const uint16_t*>(bias);
  auto* out = static_cast<uint16_t*>(y);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < N; i += 16) {
      const __m512 v = _mm512_loadu_ps(acc + m * N + i);
      bf16_store(out + m * N + i, b ? _mm512_add_ps(v, bf16_load(b + i)) : v);
    }
}

// v as bf16 would hold it, back in fp32 (the eager code's rounding to the model dtype between two ops)
inline __m512 bf16_rounded(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_round(v)), 16));
}

// e^x for x <= 0 (a softmax's s - max; silu's e^-|x|), 16 lanes: x = n ln2 + r (ln2 in two parts, Cody and
// Waite), e^r by Cephes's polynomial on |r| <= ln2 / 2, times 2^n by vscalefps: within 1-2 ulp of expf. Inlined, so
// that no call spills the loop's registers (the compiler's vectorized std::exp calls libmvec's 8-lane expf, and its
// tails the scalar one). Below -80 it returns 0 (e^-80 is 1.8e-35 of the largest weight, 1): no denormal results, and
// fewer denormal products after it. A library cannot set flush-to-zero for the process, and each instruction that
// makes or meets a denormal takes a microcode assist (the prompt tiles' softmax through this function, session 25:
// pp512 173-174 ms with its denormals down to -104, 153-159 without, libmvec's expf alternated 149-158).
__attribute__((always_inline)) inline __m512 exp_neg(__m512 x) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-80.f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-80.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

// r[n] lane b -> out[b] lane n (a 16 x 16 transpose of 32-bit elements)
inline void transpose16(const __m512i* r, __m512i* out) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + j], 128-bit lane L: element 4L + j of rows 4i .. 4i+3
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88), v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88), w1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xDD);
    _mm512_store_si512(out + j, _mm512_shuffle_i32x4(v0, w0, 0x88));
    _mm512_store_si512(out + 8 + j, _mm512_shuffle_i32x4(v0, w0, 0xDD));
    _mm512_store_si512(out + 4 + j, _mm512_shuffle_i32x4(v1, w1, 0x88));
    _mm512_store_si512(out + 12 + j, _mm512_shuffle_i32x4(v1, w1, 0xDD));
  }
}

// f(m0, R) over M rows of x in blocks of R = 4 rows, and of 3 where M is not a multiple of 4 (5: 3 + 2; 1, 2, 3,
// 4: one block). A GEMM block's accumulators are its rows times its weight vectors, each one chain of dependent
// `vdpbf16ps` (a few cycles each): a last block of 1 or 2 rows has too few chains to keep the unit busy and costs
// about what 3 rows do. Each row's sums are the same whatever its block. Measured on a Zen 4 EPYC (2 threads,
// alternated in one process, a layer's four int4 linears in cache): 9, 13, 17 and 33 rows 7-16% faster.
template <class F>
inline void by_fours_and_threes(int64_t M, F&& f) {
  const int64_t threes = (4 - M % 4) % 4;
  if (M < 3 * threes) {
    if (M == 5) f(0, 3), f(3, 2);
    else f(0, static_cast<int>(M));
    return;
  }
  int64_t m = 0;
  for (; m + 3 * threes < M; m += 4) f(m, 4);
  for (; m < M; m += 3) f(m, 3);
}

// f(m0, R) over M rows of x in blocks of R = Most rows, and of Most - 1 where M is not a multiple of Most (fewer
// rows than that takes: blocks of Most - 1 and below). Each row's sums are the same whatever its block.
template <int Most, class F>
inline void by_blocks(int64_t M, F&& f) {
  if constexpr (Most <= 4) {
    by_fours_and_threes(M, f);
  } else {
    const int64_t shorter = (Most - M % Most) % Most;
    if (M < (Most - 1) * shorter) return by_blocks<Most - 1>(M, f);
    int64_t m = 0;
    for (; m + (Most - 1) * shorter < M; m += Most) f(m, Most);
    for (; m < M; m += Most - 1) f(m, Most - 1);
  }
}

// units of work per task, `most` or half of it, whichever ends sooner when `threads` threads take the tasks in
// turn (the fewest units on the busiest thread; ties to the bigger task)
inline int64_t balanced_share(int64_t units, int64_t threads, int64_t most) {
  auto busiest = [&](int64_t per) {
    const int64_t tasks = (units + per - 1) / per;
    return (tasks + threads - 1) / threads * per;
  };
  return busiest(most / 2) < busiest(most) ? most / 2 : most;
}

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define MII_AMX 1  // AMX tiles (Intel Sapphire Rapids and later): 16 x 16 x 32 bf16 multiply-adds an instruction
// Linux hands out AMX's tile state only on request, once per process; MII_AMX=0 turns AMX off (for A/B
// measurements and the tests that compare both paths)
inline bool amx_usable() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  const char* off = std::getenv("MII_AMX");
  return granted && !(off && off[0] == '0' && off[1] == 0);
}

// every tile 16 rows of 64 bytes (fp32 sums, bf16 pairs alike); loaded per thread, released by the caller
inline void amx_configure() {
  struct {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// tiles 0-3 (a 32 x 32 block of fp32 sums: 0 and 1 the rows of a0 and a1 against b0, 2 and 3 against b1) += two A
// tiles of 16 rows `astride` bytes apart times two B tiles of 16 contiguous 64-byte rows
inline void amx_dots_2x2(const void* a0, const void* a1, int64_t astride, const void* b0, const void* b1) {
  _tile_loadd(4, a0, astride);
  _tile_loadd(5, a1, astride);
  _tile_loadd(6, b0, 64);
  _tile_loadd(7, b1, 64);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 5, 6);
  _tile_dpbf16ps(2, 4, 7);
  _tile_dpbf16ps(3, 5, 7);
}
#endif
}  // namespace mii_vec
#endif
