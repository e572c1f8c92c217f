// Fused element-wise ops of a decoder layer on CPU: one pass over memory and one dispatcher call where eager
// PyTorch takes 5-10 small ops each (mii::rms_norm, mii::rotary_, mii::silu_and_mul). Each rounds to the
// model's dtype at the same points as the eager code it replaces (mii/layers), so bf16 results match it.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <type_traits>

#include "bf16_vec.h"
#include "team.h"

namespace {

template <typename T> inline float f(T x) { return static_cast<float>(x); }
// the value as the model's dtype would hold it (a no-op for float)
template <typename T> inline float round_to(float x) { return static_cast<float>(static_cast<T>(x)); }

// rows of a [T, n] tensor in parallel, a grain of rows per task sized so a task is not tiny
template <typename F> void for_rows(int64_t rows, int64_t width, const F& fn) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1));
  mii_team::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) fn(r);
  });
}

}  // namespace

#ifdef MII_BF16_VEC
// One bf16 row of rms_norm_cpu (n % 16 == 0), with its rounding points, 16 values at a time (the sum of squares in
// another order than the scalar path; x and the residual are bf16: the _fast roundings). With a residual, h = x +
// residual goes to res_out first (which may be the residual itself) and is normalized from there.
void rms_norm_row_bf16(const at::BFloat16* x, const at::BFloat16* residual, at::BFloat16* res_out,
                       const at::BFloat16* w, at::BFloat16* y, int64_t n, float eps, float offset) {
  using namespace mii_vec;
  __m512 ss = _mm512_setzero_ps();
  if (residual != nullptr) {
    for (int64_t i = 0; i < n; i += 16) {
      const __m512 h = bf16_rounded_fast(_mm512_add_ps(bf16_load(x + i), bf16_load(residual + i)));
      bf16_store_fast(res_out + i, h);
      ss = _mm512_fmadd_ps(h, h, ss);
    }
    x = res_out;
  } else {
    for (int64_t i = 0; i < n; i += 16) {
      const __m512 h = bf16_load(x + i);
      ss = _mm512_fmadd_ps(h, h, ss);
    }
  }
  const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(n) + eps);
  const __m512 iv = _mm512_set1_ps(inv), ov = _mm512_set1_ps(offset);
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 xn = _mm512_mul_ps(bf16_load(x + i), iv), wv = bf16_load(w + i);
    bf16_store_fast(y + i, offset == 0.f ? _mm512_mul_ps(bf16_rounded_fast(xn), wv)
                                         : _mm512_mul_ps(xn, _mm512_add_ps(wv, ov)));
  }
}
#endif

// y = rms_norm(x [+ residual]) * (offset + weight); with a residual, also returns x + residual (the new residual).
// Eager (mii/layers/norm.py): h = x + residual (rounded to dtype); y = (h / rms(h) in fp32), rounded to dtype,
// times weight in dtype (offset 0), or (h / rms(h)) * (offset + weight) in fp32, rounded (offset != 0).
std::tuple<at::Tensor, at::Tensor> rms_norm_cpu(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps, double offset) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [T, n] with dense rows");
  auto xc = x.contiguous();
  const int64_t T = xc.size(0), n = xc.size(1);
  auto y = at::empty_like(xc);
  at::Tensor res_out = residual.has_value() ? at::empty_like(xc) : at::empty({0}, xc.options());
  auto w = weight.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "rms_norm_cpu", [&] {
    TORCH_CHECK(w.scalar_type() == xc.scalar_type(), "rms_norm: weight and input dtypes differ");
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    const scalar_t* rp = residual.has_value() ? residual->contiguous().data_ptr<scalar_t>() : nullptr;
    scalar_t* ro = residual.has_value() ? res_out.data_ptr<scalar_t>() : nullptr;
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    const float fo = static_cast<float>(offset);
#ifdef MII_BF16_VEC
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
      if (n % 16 == 0) {
        // (a lambda under AT_DISPATCH is no template: the casts are no-ops for bf16, and compile for the others)
        using B = at::BFloat16;
        const B *xb = reinterpret_cast<const B*>(xp), *rb = reinterpret_cast<const B*>(rp);
        for_rows(T, n, [&](int64_t r) {
          rms_norm_row_bf16(xb + r * n, rb != nullptr ? rb + r * n : nullptr,
                            rb != nullptr ? reinterpret_cast<B*>(ro) + r * n : nullptr, reinterpret_cast<const B*>(wp),
                            reinterpret_cast<B*>(yp) + r * n, n, static_cast<float>(eps), fo);
        });
        return;
      }
    }
#endif
    for_rows(T, n, [&](int64_t r) {
      const scalar_t* xr = xp + r * n;
      scalar_t* yr = yp + r * n;
      // h in the output row first (rounded to dtype as the eager add is), then normalize in place
      float ss = 0.f;
      if (rp != nullptr) {
        const scalar_t* rr = rp + r * n;
        scalar_t* rout = ro + r * n;
        for (int64_t i = 0; i < n; ++i) {
          const scalar_t h = static_cast<scalar_t>(f(xr[i]) + f(rr[i]));
          rout[i] = h;
          ss += f(h) * f(h);
        }
        xr = rout;
      } else {
        for (int64_t i = 0; i < n; ++i) ss += f(xr[i]) * f(xr[i]);
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
      if (fo == 0.f) {
        for (int64_t i = 0; i < n; ++i) yr[i] = static_cast<scalar_t>(round_to<scalar_t>(f(xr[i]) * inv) * f(wp[i]));
      } else {
        for (int64_t i = 0; i < n; ++i) yr[i] = static_cast<scalar_t>(f(xr[i]) * inv * (f(wp[i]) + fo));
      }
    });
  });
  return {y, res_out};
}

// In place on q [T, hq, d] and k [T, hk, d] (rows of each token dense): GPT-NeoX rotary on the first rot_dim
// features of every head, cos/sin [max_pos, rot_dim / 2] (fp32) looked up at positions [T].
void rotary_cpu(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos,
                const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 &&
              q.stride(1) == q.size(2) && k.stride(1) == k.size(2), "rotary_: q, k must be [T, heads, d], dense rows");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous(), "rotary_: fp32 contiguous cos/sin tables expected");
  auto pos = positions.to(at::kLong).contiguous();
  const int64_t T = q.size(0), d = q.size(2), half = cos.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_cpu", [&] {
    const int64_t* pp = pos.data_ptr<int64_t>();
    const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
    for_rows(T, (q.size(1) + k.size(1)) * d, [&](int64_t t) {
      const float* c = cp + pp[t] * half;
      const float* s = sp + pp[t] * half;
      for (at::Tensor* x : {&q, &k}) {
        scalar_t* base = x->data_ptr<scalar_t>() + t * x->stride(0);
        for (int64_t h = 0; h < x->size(1); ++h) {
          scalar_t* row = base + h * d;
#ifdef MII_BF16_VEC
          if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
            if (half % 16 == 0) {
              using namespace mii_vec;
              for (int64_t i = 0; i < half; i += 16) {
                const __m512 x1 = bf16_load(row + i), x2 = bf16_load(row + i + half);
                const __m512 cv = _mm512_loadu_ps(c + i), sv = _mm512_loadu_ps(s + i);
                bf16_store_fast(row + i, _mm512_sub_ps(_mm512_mul_ps(x1, cv), _mm512_mul_ps(x2, sv)));
                bf16_store_fast(row + i + half, _mm512_add_ps(_mm512_mul_ps(x2, cv), _mm512_mul_ps(x1, sv)));
              }
              continue;
            }
          }
#endif
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = f(row[i]), x2 = f(row[i + half]);
            row[i] = static_cast<scalar_t>(x1 * c[i] - x2 * s[i]);
            row[i + half] = static_cast<scalar_t>(x2 * c[i] + x1 * s[i]);
          }
        }
      }
    });
  });
}

// silu(x) = x / (1 + e^-x), from e = e^-|x| <= 1: x / (1 + e) for x >= 0, x e / (1 + e) below. No e^-x of a large
// negative x, whose overflow to infinity made x / inf a NaN under -ffast-math's reciprocal (x < -88 in fp32).
inline float silu(float x) {
  const float e = std::exp(-std::fabs(x));
  return (x < 0.f ? x * e : x) / (1.f + e);
}

#ifdef MII_BF16_VEC
namespace {
// o = silu(g) * u for n % 16 == 0 values: silu's formula above, 16 values at a time, its exp inlined (exp_neg); bf16
// rounds silu first, then the product, as eager
template <typename T> void silu_mul_vec(const T* g, const T* u, T* o, int64_t n) {
  using namespace mii_vec;
  constexpr bool kBf16 = std::is_same_v<T, at::BFloat16>;
  const auto load = [](const T* p) {
    if constexpr (kBf16) return bf16_load(p);
    else return _mm512_loadu_ps(p);
  };
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 xv = load(g + i);
    const __mmask16 neg = _mm512_cmp_ps_mask(xv, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 e = exp_neg(_mm512_or_ps(xv, _mm512_set1_ps(-0.f)));  // e^-|x|
    // x / (1 + e) as x times 1 / (1 + e) by vrcp14ps and one Newton step (within 2^-23 of the quotient; 1 + e is
    // in [1, 2]): vdivps alone took ~half of this loop's time
    const __m512 den = _mm512_add_ps(one, e), r0 = _mm512_rcp14_ps(den);
    const __m512 r = _mm512_mul_ps(r0, _mm512_fnmadd_ps(den, r0, _mm512_set1_ps(2.f)));
    const __m512 s = _mm512_mul_ps(_mm512_mask_mul_ps(xv, neg, xv, e), r);
    if constexpr (kBf16) bf16_store_fast(o + i, _mm512_mul_ps(bf16_rounded_fast(s), load(u + i)));
    else _mm512_storeu_ps(o + i, _mm512_mul_ps(s, load(u + i)));
  }
}
}  // namespace

// one bf16 row of silu_and_mul_cpu: gate_up [2n] -> y [n] (n % 16 == 0)
void silu_and_mul_row_bf16(const at::BFloat16* gate_up, at::BFloat16* y, int64_t n) {
  silu_mul_vec(gate_up, gate_up + n, y, n);
}
#endif

// [T, 2 * n] (gate | up) -> silu(gate) * up, [T, n]; silu rounded to dtype first, as eager F.silu(gate) * up.
at::Tensor silu_and_mul_cpu(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "silu_and_mul: x must be [T, 2n]");
  const int64_t T = x.size(0), n = x.size(1) / 2;
  auto y = at::empty({T, n}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul_cpu", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    const int64_t stride = x.stride(0);
    for_rows(T, n, [&](int64_t r) {
      const scalar_t* g = xp + r * stride;
      const scalar_t* u = g + n;
      scalar_t* o = yp + r * n;
#ifdef MII_BF16_VEC
      if constexpr (std::is_same_v<scalar_t, at::BFloat16> || std::is_same_v<scalar_t, float>) {
        if (n % 16 == 0) return silu_mul_vec(g, u, o, n);
      }
#endif
      for (int64_t i = 0; i < n; ++i)
        o[i] = static_cast<scalar_t>(round_to<scalar_t>(silu(f(g[i]))) * f(u[i]));
    });
  });
  return y;
}

TORCH_LIBRARY_IMPL(mii, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("rotary_", &rotary_cpu);
  m.impl("silu_and_mul", &silu_and_mul_cpu);
}
