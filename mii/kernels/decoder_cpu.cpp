// mii::decoder_stack: every pre-norm decoder layer of a step in one call (Llama, Mistral, Qwen2, Qwen3, Phi-3,
// SmolLM2: RMSNorm, fused qkv with optional bias, optional q/k RMSNorm, rotary, paged attention, gated SiLU MLP).
// It runs the same kernels in the same order as the layers' eager forward (mii/models/decoder.py with the fused
// ops), so its output is identical; what it removes is the Python between them — module calls, dispatcher round
// trips and views, about 0.15 ms a layer, 4-5 ms of a single-stream decode step of SmolLM2. A step of a few bf16
// rows (1-8: decode steps of a few streams) goes further where the layers allow (few_rows_stack): the kernels' forms
// for raw rows on one workspace, without a tensor an op.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include "bf16_vec.h"
#include "team.h"

#include <cstring>
#include <tuple>
#include <vector>

// the kernels of the other sources
std::tuple<at::Tensor, at::Tensor> rms_norm_cpu(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps, double offset);
void rotary_cpu(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos,
                const at::Tensor& sin);
at::Tensor silu_and_mul_cpu(const at::Tensor& x);
at::Tensor paged_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                               at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& query_start,
                               const at::Tensor& seq_lens, const at::Tensor& block_tables, int64_t max_query_len,
                               double scale, int64_t window);
at::Tensor linear_bf16w_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
at::Tensor linear_quant_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                            bool act8);
// and their forms for a few rows on raw bf16 rows (see there)
bool linear_quant_rows(const at::BFloat16* x, int64_t M, int64_t K, const at::Tensor& weight, const at::BFloat16* bias,
                       at::BFloat16* y, int64_t N, bool act8);
bool linear_bf16w_rows(const at::BFloat16* x, int64_t M, int64_t K, const at::Tensor& weight, const at::BFloat16* bias,
                       at::BFloat16* y, int64_t N);
void rms_norm_row_bf16(const at::BFloat16* x, const at::BFloat16* residual, at::BFloat16* res_out,
                       const at::BFloat16* w, at::BFloat16* y, int64_t n, float eps, float offset);
void silu_and_mul_row_bf16(const at::BFloat16* gate_up, at::BFloat16* y, int64_t n);

namespace {

constexpr int64_t kPerLayer = 14;  // parameters per layer (see decoder_stack_cpu)

// x @ w.T + b through oneDNN for a weight it prepacked (mii/layers/linear.py: prepack_cpu_bf16), the call the
// layer's packed_linear makes
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, c10::string_view,
                        c10::List<c10::optional<at::Scalar>>, c10::optional<c10::string_view>)>();
  return op.call(x, w, bias, "none", c10::List<c10::optional<at::Scalar>>(), c10::string_view(""));
}

// which computation linear() below takes for x @ w.T
enum class Linear { kPacked, kQuant, kBf16w, kAten };
Linear linear_kind(const at::Tensor& x, const at::Tensor& w) {
  if (w.is_mkldnn()) return Linear::kPacked;
  if (w.scalar_type() == at::kByte || w.scalar_type() == at::kChar) return Linear::kQuant;
  if (w.dim() == 3 || (w.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kFloat)) return Linear::kBf16w;
  return Linear::kAten;
}

// x @ w.T + b, the way the layer's linear computes it: oneDNN for a prepacked weight, mii::linear_quant for a
// quantized weight (int4: uint8, int8: int8, both 3-D), mii::linear_bf16w for a bf16 weight under fp32 math (or a
// tiled one), ATen otherwise. A row-parallel layer (o, down) adds its bias after the matmul (after the all-reduce
// under tensor parallelism): `bias_after` does the same, so the rounding is the eager one. `act8`: the int4
// linears' inputs rounded to int8 (quantize_activations).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, bool act8, bool bias_after = false) {
  const bool has_bias = b.defined() && b.numel() > 0;
  const c10::optional<at::Tensor> bias = has_bias && !bias_after ? c10::optional<at::Tensor>(b) : c10::nullopt;
  at::Tensor y;
  switch (linear_kind(x, w)) {
    case Linear::kPacked: y = packed_linear(x, w, bias); break;
    case Linear::kQuant: y = linear_quant_cpu(x, w, bias, act8); break;
    case Linear::kBf16w: y = linear_bf16w_cpu(x, w, bias); break;
    case Linear::kAten: y = at::linear(x, w, bias); break;
  }
  return has_bias && bias_after ? y.add(b) : y;
}

constexpr int64_t kFewRows = 8;  // rows up to which a step may take few_rows_stack (the decode linears' row counts)

// whether linear() takes mii's kernels for every linear of the stack (no oneDNN-packed or ATen weight), whose
// threads share out through mii_team::parallel_for (at up to kFewRows rows: their streaming forms, no ATen GEMM)
bool mii_kernels_only(at::TensorList params, const at::Tensor& x, int64_t layers) {
  for (int64_t i = 0; i < layers; ++i)
    for (const int64_t j : {1, 3, 6, 8}) {
      const Linear kind = linear_kind(x, params[i * kPerLayer + j]);
      if (kind != Linear::kQuant && kind != Linear::kBf16w) return false;
    }
  return true;
}

#ifdef MII_BF16_VEC

bool dense_bf16(const at::Tensor& t, int64_t n) {
  return t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.numel() == n;
}

// y [M, N] = x [M, K] @ w.T + b for 1-8 bf16 rows, by the weight's form: packed int4/int8 or bf16 k-pair tiles; b
// (empty: none) added to the fp32 sums, or after the rounding (`bias_after`, as linear() above: y + b in bf16, as
// torch adds two bf16 tensors). False where neither kernel takes w or the bias is not a dense bf16 [N]; x ==
// nullptr: only whether they would.
bool rows_linear(const at::BFloat16* x, int64_t M, int64_t K, const at::Tensor& w, const at::Tensor& b,
                 at::BFloat16* y, int64_t N, bool act8, bool bias_after = false) {
  if (w.is_mkldnn() || w.dim() != 3 || (b.numel() > 0 && !dense_bf16(b, N))) return false;
  const at::BFloat16* bp = b.numel() > 0 && x != nullptr ? b.data_ptr<at::BFloat16>() : nullptr;
  const at::BFloat16* bias = bias_after ? nullptr : bp;
  const bool quantized = w.scalar_type() == at::kByte || w.scalar_type() == at::kChar;
  if (!(quantized ? linear_quant_rows(x, M, K, w, bias, y, N, act8) : linear_bf16w_rows(x, M, K, w, bias, y, N)))
    return false;
  if (bias_after && bp != nullptr)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t i = 0; i < N; i += 16) {
        at::BFloat16* yi = y + m * N + i;
        mii_vec::bf16_store(yi, _mm512_add_ps(mii_vec::bf16_load(yi), mii_vec::bf16_load(bp + i)));
      }
  return true;
}

// the MLP's intermediate size from its gate_up weight (int4/int8: a pair of rows a slice; k-pair tiles: 16); 0 for
// another form
int64_t intermediate(const at::Tensor& gate_up) {
  return gate_up.dim() == 3 ? gate_up.size(0) * (gate_up.scalar_type() == at::kBFloat16 ? 8 : 1) : 0;
}

// A step of 1-8 bf16 rows (a single stream's decode step, a few streams' together): the layers of decoder_stack_cpu
// through the same kernels' forms for raw rows on one workspace, where each op made its output tensor and views (~10
// a layer, ~0.3 ms of a ~4 ms single-stream int4 step). The same arithmetic, so the same values. few_rows_fit:
// whether every layer is of what those forms take (packed int4/int8 or bf16 k-pair tiled weights, bf16 biases and
// q/k norms, sizes a multiple of 16), for bf16 rows.
bool few_rows_fit(const at::Tensor& x_in, at::TensorList params, int64_t n_heads, int64_t n_kv_heads,
                  int64_t head_dim, at::IntArrayRef windows, bool act8) {
  constexpr int64_t P = kPerLayer;
  const int64_t layers = static_cast<int64_t>(windows.size()), T = x_in.size(0), H = x_in.size(1);
  const int64_t q_size = n_heads * head_dim, qkv_n = q_size + 2 * n_kv_heads * head_dim;
  if (layers == 0 || !dense_bf16(x_in, T * H) || H % 16 != 0 || head_dim % 16 != 0) return false;
  const int64_t I = intermediate(params[6]);
  if (I == 0 || I % 16 != 0) return false;
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* p = params.data() + i * P;
    const bool qk_norm = p[12].numel() > 0;
    if (!dense_bf16(p[0], H) || !dense_bf16(p[5], H) ||
        (qk_norm && !(dense_bf16(p[12], head_dim) && dense_bf16(p[13], head_dim))) ||
        !rows_linear(nullptr, 1, H, p[1], p[2], nullptr, qkv_n, act8) ||
        !rows_linear(nullptr, 1, q_size, p[3], p[4], nullptr, H, act8) ||
        !rows_linear(nullptr, 1, H, p[6], p[7], nullptr, 2 * I, act8) ||
        !rows_linear(nullptr, 1, I, p[8], p[9], nullptr, H, act8))
      return false;
  }
  return true;
}

std::tuple<at::Tensor, at::Tensor> few_rows_stack(
    const at::Tensor& x_in, const at::Tensor& positions, at::TensorList params, at::TensorList caches,
    const at::Tensor& slot_mapping, const at::Tensor& query_start, const at::Tensor& seq_lens,
    const at::Tensor& block_tables, int64_t max_query_len, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
    double scale, double eps, double norm_offset, at::IntArrayRef windows, bool act8,
    const c10::optional<at::Tensor>& final_norm, mii_team::Pace* pace) {
  constexpr int64_t P = kPerLayer;
  const int64_t layers = static_cast<int64_t>(windows.size()), T = x_in.size(0), H = x_in.size(1);
  const int64_t q_size = n_heads * head_dim, kv_size = n_kv_heads * head_dim, qkv_n = q_size + 2 * kv_size;
  const int64_t I = intermediate(params[6]);
  // [T, n] each: the residual, the layer's output x, the normed h, o's output, qkv, gate_up, and silu * up
  const at::Tensor ws = at::empty({T * (4 * H + qkv_n + 3 * I)}, x_in.options());
  at::BFloat16* res = ws.data_ptr<at::BFloat16>();
  at::BFloat16 *x = res + T * H, *h = x + T * H, *o = h + T * H, *qkv = o + T * H, *gu = qkv + T * qkv_n,
               *act = gu + T * 2 * I;
  const at::Tensor qkv_t = at::from_blob(qkv, {T, qkv_n}, x_in.options());  // (ws's memory, held by ws)
  at::Tensor q = qkv_t.narrow(1, 0, q_size).view({T, n_heads, head_dim});
  at::Tensor k = qkv_t.narrow(1, q_size, kv_size).view({T, n_kv_heads, head_dim});
  const at::Tensor v = qkv_t.narrow(1, q_size + kv_size, kv_size).view({T, n_kv_heads, head_dim});
  const float feps = static_cast<float>(eps), off = static_cast<float>(norm_offset);
  const auto bf = [](const at::Tensor& t) { return t.data_ptr<at::BFloat16>(); };
  std::memcpy(res, x_in.data_ptr<at::BFloat16>(), T * H * sizeof(at::BFloat16));  // the first layer's residual: x
  // the layers in one parallel region: the kernels' threads wait in it between their calls (mii_team::run), as many
  // threads as the handle's pace gives on a busy CPU
  mii_team::run([&] {
    for (int64_t i = 0; i < layers; ++i) {
      const at::Tensor* p = params.data() + i * P;
      for (int64_t t = 0; t < T; ++t) {
        if (i == 0) rms_norm_row_bf16(res + t * H, nullptr, nullptr, bf(p[0]), h + t * H, H, feps, off);
        else rms_norm_row_bf16(x + t * H, res + t * H, res + t * H, bf(p[0]), h + t * H, H, feps, off);
      }
      rows_linear(h, T, H, p[1], p[2], qkv, qkv_n, act8);
      if (p[12].numel() > 0) {  // one RMSNorm over head_dim for every head (Qwen3), in place
        for (int64_t t = 0; t < T; ++t)
          for (int64_t j = 0; j < n_heads + n_kv_heads; ++j) {
            at::BFloat16* row = qkv + t * qkv_n + j * head_dim;
            rms_norm_row_bf16(row, nullptr, nullptr, bf(p[j < n_heads ? 12 : 13]), row, head_dim, feps, off);
          }
      }
      rotary_cpu(q, k, positions, p[10], p[11]);
      at::Tensor k_cache = caches[2 * i], v_cache = caches[2 * i + 1];
      const at::Tensor attn = paged_attention_cpu(q, k, v, k_cache, v_cache, slot_mapping, query_start, seq_lens,
                                                  block_tables, max_query_len, scale, windows[i]);
      rows_linear(bf(attn), T, q_size, p[3], p[4], o, H, act8, /*bias_after=*/true);
      for (int64_t t = 0; t < T; ++t)
        rms_norm_row_bf16(o + t * H, res + t * H, res + t * H, bf(p[5]), h + t * H, H, feps, off);
      rows_linear(h, T, H, p[6], p[7], gu, 2 * I, act8);
      for (int64_t t = 0; t < T; ++t) silu_and_mul_row_bf16(gu + t * 2 * I, act + t * I, I);
      rows_linear(act, T, I, p[8], p[9], x, H, act8, /*bias_after=*/true);
    }
  }, pace, T);
  const at::Tensor xs = at::from_blob(x, {T, H}, x_in.options()), rs = at::from_blob(res, {T, H}, x_in.options());
  if (final_norm.has_value() && final_norm->defined()) return rms_norm_cpu(xs, rs, *final_norm, eps, norm_offset);
  return {xs.clone(), rs.clone()};  // (not views of the workspace)
}
#endif

}  // namespace

// x [T, hidden] (the embeddings; residual none) -> (x, residual) after the last layer, as DecoderLayer returns
// them. params: per layer, in order: input norm weight, qkv weight, qkv bias, o weight, o bias, post-attention
// norm weight, gate_up weight, gate_up bias, down weight, down bias, rotary cos, rotary sin, q norm weight, k norm
// weight (a bias or q/k norm not present is an empty tensor). caches: per layer k_cache, v_cache. windows: per
// layer (0: none). act8: as the layers' int4 linears (quantize_activations). final_norm: the model's last RMSNorm
// (same eps and offset), applied here too: then x comes back normed (one call fewer after the stack, whose cold
// Python and dispatch cost ~100 us of a decode step).
std::tuple<at::Tensor, at::Tensor> decoder_stack_cpu(
    const at::Tensor& x_in, const at::Tensor& positions, at::TensorList params, at::TensorList caches,
    const at::Tensor& slot_mapping, const at::Tensor& query_start, const at::Tensor& seq_lens,
    const at::Tensor& block_tables, int64_t max_query_len, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
    double scale, double eps, double norm_offset, at::IntArrayRef windows, bool act8,
    const c10::optional<at::Tensor>& final_norm, int64_t* few_rows = nullptr, mii_team::Pace* pace = nullptr) {
  constexpr int64_t P = kPerLayer;
  const int64_t layers = static_cast<int64_t>(windows.size());
  TORCH_CHECK(static_cast<int64_t>(params.size()) == layers * P && static_cast<int64_t>(caches.size()) == 2 * layers,
              "decoder_stack: ", P, " parameters and 2 caches per layer expected");
  TORCH_CHECK(x_in.dim() == 2, "decoder_stack: x must be [T, hidden]");
  const int64_t T = x_in.size(0), q_size = n_heads * head_dim, kv_size = n_kv_heads * head_dim;
  // how a step of a few rows runs, decided at the first such step and remembered in the handle: 1, the layers'
  // forms for raw rows, where they take every layer (bf16 rows on CPUs with AVX-512); else 2, the layers' own
  // kernels in one parallel region, where they are all mii's (below); else 0, as any step
  const bool few = T >= 1 && T <= kFewRows && few_rows != nullptr;
  if (few && *few_rows < 0) {
#ifdef MII_BF16_VEC
    *few_rows = few_rows_fit(x_in, params, n_heads, n_kv_heads, head_dim, windows, act8) ? 1 : 0;
#else
    *few_rows = 0;
#endif
    if (*few_rows == 0 && mii_kernels_only(params, x_in, layers)) *few_rows = 2;
  }
#ifdef MII_BF16_VEC
  if (few && *few_rows == 1)
    return few_rows_stack(x_in, positions, params, caches, slot_mapping, query_start, seq_lens, block_tables,
                          max_query_len, n_heads, n_kv_heads, head_dim, scale, eps, norm_offset, windows, act8,
                          final_norm, pace);
#endif
  at::Tensor x = x_in, residual;
  const auto layers_loop = [&] {
    for (int64_t i = 0; i < layers; ++i) {
      const at::Tensor* p = params.data() + i * P;
      at::Tensor h;
      if (i == 0) {
        h = std::get<0>(rms_norm_cpu(x, c10::nullopt, p[0], eps, norm_offset));
        residual = x;
      } else {
        std::tie(h, residual) = rms_norm_cpu(x, residual, p[0], eps, norm_offset);
      }
      const at::Tensor qkv = linear(h, p[1], p[2], act8);
      at::Tensor q = qkv.narrow(1, 0, q_size).view({T, n_heads, head_dim});
      at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, n_kv_heads, head_dim});
      const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, n_kv_heads, head_dim});
      if (p[12].numel() > 0) {  // one RMSNorm over head_dim for every head (Qwen3): new dense q and k, as eager
        q = std::get<0>(rms_norm_cpu(q.reshape({-1, head_dim}), c10::nullopt, p[12], eps, norm_offset))
                .view({T, n_heads, head_dim});
        k = std::get<0>(rms_norm_cpu(k.reshape({-1, head_dim}), c10::nullopt, p[13], eps, norm_offset))
                .view({T, n_kv_heads, head_dim});
      }
      rotary_cpu(q, k, positions, p[10], p[11]);
      at::Tensor k_cache = caches[2 * i], v_cache = caches[2 * i + 1];
      const at::Tensor attn = paged_attention_cpu(q, k, v, k_cache, v_cache, slot_mapping, query_start, seq_lens,
                                                  block_tables, max_query_len, scale, windows[i]);
      const at::Tensor o = linear(attn, p[3], p[4], act8, /*bias_after=*/true);
      std::tie(h, residual) = rms_norm_cpu(o, residual, p[5], eps, norm_offset);
      x = linear(silu_and_mul_cpu(linear(h, p[6], p[7], act8)), p[8], p[9], act8, /*bias_after=*/true);
    }
  };
  // a step of a few rows whose linears are all mii's (fp32 rows on CPUs without AVX512-BF16, or rows the few-rows
  // forms do not take): every kernel's threads in one parallel region, as few_rows_stack's, the same shares (so the
  // same values); else each kernel its own parallel region (oneDNN's and MKL's run their own), their joins' waits
  // told to the handle's pace. Single-stream decode on the AVX2 kernels, alternated in one process (Zen 4 as
  // MII_CPU_ISA=avx2, 12 rounds): int4 1.05x, bf16 weights 1.01x
  if (few && *few_rows == 2)
    mii_team::run(layers_loop, pace, T);
  else
    mii_team::timed(layers_loop, pace, T);
  if (final_norm.has_value() && final_norm->defined() && layers > 0)
    return rms_norm_cpu(x, residual, *final_norm, eps, norm_offset);
  return {x, residual};
}

// The stack's parameters, caches and windows held in C++ between steps (mii::stack_params): a decode step's call
// then passes one tensor where it passed ~480 (SmolLM2: 14 parameters and 2 caches a layer), whose conversion from
// Python took ~0.1 ms of a ~4 ms single-stream step. The handle is a tensor of two int64 (a tag, the address of
// what it holds) whose memory is that record: freed with the last reference to the tensor (the model's).
namespace {

constexpr int64_t kStackTag = 0x6d69697374616bLL;  // "miistak"

struct StackParams {
  int64_t tag = kStackTag;
  std::vector<at::Tensor>* held;  // params, then caches
  std::vector<int64_t>* windows;
  int64_t n_params;
  int64_t few_rows = -1;  // how a step of 1-8 rows runs: -1 not known yet, 0 as others, 1 few_rows_stack, 2 one region
  mii_team::Pace* pace;   // how many threads its parallel region takes
};

StackParams& held_stack(const at::Tensor& handle) {
  TORCH_CHECK(handle.scalar_type() == at::kLong && handle.numel() == 2 && handle.is_contiguous() &&
                  handle.data_ptr<int64_t>()[0] == kStackTag,
              "decoder_stack: not a handle from mii::stack_params");
  return *static_cast<StackParams*>(handle.data_ptr());
}

}  // namespace

at::Tensor stack_params_cpu(at::TensorList params, at::TensorList caches, at::IntArrayRef windows) {
  TORCH_CHECK(static_cast<int64_t>(params.size()) == static_cast<int64_t>(windows.size()) * kPerLayer &&
                  caches.size() == 2 * windows.size(),
              "stack_params: ", kPerLayer, " parameters and 2 caches per layer expected");
  auto* h = new StackParams;
  h->held = new std::vector<at::Tensor>(params.vec());
  h->held->insert(h->held->end(), caches.begin(), caches.end());
  h->windows = new std::vector<int64_t>(windows.vec());
  h->n_params = static_cast<int64_t>(params.size());
  h->pace = new mii_team::Pace();
  static_assert(sizeof(StackParams) == 6 * sizeof(int64_t), "the handle's two int64 are the record's first two");
  return at::from_blob(
      h, {2},
      [](void* p) {
        auto* r = static_cast<StackParams*>(p);
        delete r->held;
        delete r->windows;
        delete r->pace;
        delete r;
      },
      at::TensorOptions().dtype(at::kLong));
}

// mii::decoder_stack: decoder_stack_cpu with the parameters, caches and windows a handle from mii::stack_params holds
std::tuple<at::Tensor, at::Tensor> decoder_stack_held_cpu(
    const at::Tensor& x, const at::Tensor& positions, const at::Tensor& handle, const at::Tensor& slot_mapping,
    const at::Tensor& query_start, const at::Tensor& seq_lens, const at::Tensor& block_tables, int64_t max_query_len,
    int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, double scale, double eps, double norm_offset, bool act8,
    const c10::optional<at::Tensor>& final_norm) {
  StackParams& h = held_stack(handle);
  const at::TensorList all(*h.held);
  return decoder_stack_cpu(x, positions, all.slice(0, h.n_params), all.slice(h.n_params), slot_mapping, query_start,
                           seq_lens, block_tables, max_query_len, n_heads, n_kv_heads, head_dim, scale, eps,
                           norm_offset, *h.windows, act8, final_norm, &h.few_rows, h.pace);
}

// mii::stack_few_rows: how a handle's steps of 1-8 rows run (-1: none has run yet, 0: as the others, 1: few_rows_stack,
// 2: the layers' kernels in one parallel region)
int64_t stack_few_rows_cpu(const at::Tensor& handle) { return held_stack(handle).few_rows; }

// mii::stack_threads: the threads a handle's next step takes, of the `configured` (the engine sets them for the
// step): as many as its pace (mii_team::Pace) gives, fewer where it has seen a busy CPU take its steps' time, and one
// more on its tries. Every step counts, of any rows: beside a CPU-bound process (Zen 4, 2 threads) a
// 128-token prompt's first token took 300-485 ms on two threads and 173-186 on one, 32 streams' 64 tokens each
// 12.3-19.9 s and 7.2.
int64_t stack_threads_cpu(const at::Tensor& handle, int64_t configured) {
  return held_stack(handle).pace->threads(static_cast<int>(configured));
}

// mii::stack_pace: a handle's pace: [the threads its steps take between trials; how often it took one fewer, ran a
// trial (of one fewer or one more), kept one more]
std::vector<int64_t> stack_pace_cpu(const at::Tensor& handle) {
  const mii_team::Pace& p = *held_stack(handle).pace;
  return {p.settled(), p.drops, p.probes, p.rises};
}

// mii::pace_trace: the threads a fresh pace gives step after step, where a step on n threads takes times[i][n - 1] ms
// for one row, of which its calling thread loses the fraction losses[i][n - 1] (the pace's rules, on a trace;
// threads: times' columns)
at::Tensor pace_trace_cpu(const at::Tensor& times, const at::Tensor& losses) {
  TORCH_CHECK(times.dim() == 2 && times.scalar_type() == at::kDouble && times.size(1) >= 1,
              "pace_trace: times must be [steps, threads] float64");
  TORCH_CHECK(losses.sizes() == times.sizes() && losses.scalar_type() == at::kDouble,
              "pace_trace: losses must be float64 of times' shape");
  TORCH_CHECK(times.gt(0).all().item<bool>(), "pace_trace: times must be positive");
  const at::Tensor t = times.contiguous(), l = losses.clamp(0, 1).contiguous();
  const int64_t steps = t.size(0), threads = t.size(1);
  at::Tensor out = at::empty({steps}, at::TensorOptions().dtype(at::kLong));
  mii_team::Pace pace(static_cast<int>(threads), /*enabled=*/true);
  for (int64_t i = 0; i < steps; ++i) {
    const int n = pace.threads(static_cast<int>(threads));
    const int64_t ns = static_cast<int64_t>(t.data_ptr<double>()[i * threads + n - 1] * 1e6);
    pace.record(n, ns, static_cast<int64_t>(l.data_ptr<double>()[i * threads + n - 1] * ns), 1);
    out.data_ptr<int64_t>()[i] = n;
  }
  return out;
}

TORCH_LIBRARY_IMPL(mii, CPU, m) {
  m.impl("stack_params", &stack_params_cpu);
  m.impl("decoder_stack", &decoder_stack_held_cpu);
  m.impl("stack_few_rows", &stack_few_rows_cpu);
  m.impl("stack_threads", &stack_threads_cpu);
  m.impl("stack_pace", &stack_pace_cpu);
  m.impl("pace_trace", &pace_trace_cpu);
}
// (oneDNN-prepacked weights among the parameters make the dispatcher pick this key)
TORCH_LIBRARY_IMPL(mii, MkldnnCPU, m) { m.impl("stack_params", &stack_params_cpu); }
