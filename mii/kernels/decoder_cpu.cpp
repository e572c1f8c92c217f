// mii::decoder_stack: every pre-norm decoder layer of a step in one call (Llama, Mistral, Qwen2, Qwen3, Phi-3,
// SmolLM2: RMSNorm, fused qkv with optional bias, optional q/k RMSNorm, rotary, paged attention, gated SiLU MLP).
// It runs the same kernels in the same order as the layers' eager forward (mii/models/decoder.py with the fused
// ops), so its output is identical; what it removes is the Python between them — module calls, dispatcher round
// trips and views, about 0.15 ms a layer, 4-5 ms of a single-stream decode step of SmolLM2. A single sequence's
// decode step (one bf16 row) goes further where the layers allow (one_row_stack): the kernels' row forms on one
// workspace, without a tensor an op.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include "bf16_vec.h"

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
// and their single-row forms on raw bf16 rows (see there)
bool linear_quant_row(const at::BFloat16* x, int64_t K, const at::Tensor& weight, at::BFloat16* y, int64_t N,
                      bool act8);
bool linear_bf16w_row(const at::BFloat16* x, int64_t K, const at::Tensor& weight, at::BFloat16* y, int64_t N);
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

// x @ w.T + b, the way the layer's linear computes it: oneDNN for a prepacked weight, mii::linear_quant for a
// quantized weight (int4: uint8, int8: int8, both 3-D), mii::linear_bf16w for a bf16 weight under fp32 math (or a
// tiled one), ATen otherwise. A row-parallel layer (o, down) adds its bias after the matmul (after the all-reduce
// under tensor parallelism): `bias_after` does the same, so the rounding is the eager one. `act8`: the int4
// linears' inputs rounded to int8 (quantize_activations).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, bool act8, bool bias_after = false) {
  const bool has_bias = b.defined() && b.numel() > 0;
  const c10::optional<at::Tensor> bias = has_bias && !bias_after ? c10::optional<at::Tensor>(b) : c10::nullopt;
  const bool quantized = w.scalar_type() == at::kByte || w.scalar_type() == at::kChar;
  at::Tensor y = w.is_mkldnn() ? packed_linear(x, w, bias)
                 : quantized ? linear_quant_cpu(x, w, bias, act8)
                 : w.dim() == 3 || (w.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kFloat)
                     ? linear_bf16w_cpu(x, w, bias)
                     : at::linear(x, w, bias);
  return has_bias && bias_after ? y.add(b) : y;
}

#ifdef MII_BF16_VEC
// y [N] = x [K] @ w.T for one bf16 row, by the weight's form: packed int4/int8 or bf16 k-pair tiles. False where
// neither single-row kernel takes w; x == nullptr: only whether one would.
bool row_linear(const at::BFloat16* x, int64_t K, const at::Tensor& w, at::BFloat16* y, int64_t N, bool act8) {
  if (w.is_mkldnn() || w.dim() != 3) return false;
  if (w.scalar_type() == at::kByte || w.scalar_type() == at::kChar) return linear_quant_row(x, K, w, y, N, act8);
  return linear_bf16w_row(x, K, w, y, N);
}

bool dense_bf16(const at::Tensor& t, int64_t n) {
  return t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.numel() == n;
}

// the MLP's intermediate size from its gate_up weight (int4/int8: a pair of rows a slice; k-pair tiles: 16); 0 for
// another form
int64_t intermediate(const at::Tensor& gate_up) {
  return gate_up.dim() == 3 ? gate_up.size(0) * (gate_up.scalar_type() == at::kBFloat16 ? 8 : 1) : 0;
}

// The decode step of a single sequence (one bf16 row): the layers of decoder_stack_cpu through the row forms of the
// same kernels on one workspace, where each op made its output tensor and views (~10 a layer, ~0.3 ms of a ~4 ms
// single-stream int4 step). The same arithmetic, so the same values. one_row_fits: whether every layer is of what
// those forms take (no bias, no q/k norm, packed int4/int8 or bf16 k-pair tiled weights, sizes a multiple of 16).
bool one_row_fits(const at::Tensor& x_in, at::TensorList params, int64_t n_heads, int64_t n_kv_heads,
                  int64_t head_dim, at::IntArrayRef windows, bool act8) {
  constexpr int64_t P = kPerLayer;
  const int64_t layers = static_cast<int64_t>(windows.size()), H = x_in.size(1);
  const int64_t q_size = n_heads * head_dim, qkv_n = q_size + 2 * n_kv_heads * head_dim;
  if (layers == 0 || x_in.size(0) != 1 || !dense_bf16(x_in, H) || H % 16 != 0) return false;
  const int64_t I = intermediate(params[6]);
  if (I == 0 || I % 16 != 0) return false;
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* p = params.data() + i * P;
    for (int j : {2, 4, 7, 9, 12, 13})
      if (p[j].numel() > 0) return false;
    if (!dense_bf16(p[0], H) || !dense_bf16(p[5], H) || !row_linear(nullptr, H, p[1], nullptr, qkv_n, act8) ||
        !row_linear(nullptr, q_size, p[3], nullptr, H, act8) || !row_linear(nullptr, H, p[6], nullptr, 2 * I, act8) ||
        !row_linear(nullptr, I, p[8], nullptr, H, act8))
      return false;
  }
  return true;
}

std::tuple<at::Tensor, at::Tensor> one_row_stack(
    const at::Tensor& x_in, const at::Tensor& positions, at::TensorList params, at::TensorList caches,
    const at::Tensor& slot_mapping, const at::Tensor& query_start, const at::Tensor& seq_lens,
    const at::Tensor& block_tables, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, double scale, double eps,
    double norm_offset, at::IntArrayRef windows, bool act8, const c10::optional<at::Tensor>& final_norm) {
  constexpr int64_t P = kPerLayer;
  const int64_t layers = static_cast<int64_t>(windows.size()), H = x_in.size(1);
  const int64_t q_size = n_heads * head_dim, kv_size = n_kv_heads * head_dim, qkv_n = q_size + 2 * kv_size;
  const int64_t I = intermediate(params[6]);
  // the residual, the layer's output x, the normed h, o's output, qkv, gate_up, and silu * up
  at::Tensor ws = at::empty({4 * H + qkv_n + 3 * I}, x_in.options());
  at::BFloat16* res = ws.data_ptr<at::BFloat16>();
  at::BFloat16 *x = res + H, *h = x + H, *o = h + H, *qkv = o + H, *gu = qkv + qkv_n, *act = gu + 2 * I;
  at::Tensor q = ws.narrow(0, 4 * H, q_size).view({1, n_heads, head_dim});
  at::Tensor k = ws.narrow(0, 4 * H + q_size, kv_size).view({1, n_kv_heads, head_dim});
  const at::Tensor v = ws.narrow(0, 4 * H + q_size + kv_size, kv_size).view({1, n_kv_heads, head_dim});
  const float feps = static_cast<float>(eps), off = static_cast<float>(norm_offset);
  const auto bf = [](const at::Tensor& t) { return t.data_ptr<at::BFloat16>(); };
  std::memcpy(res, x_in.data_ptr<at::BFloat16>(), H * sizeof(at::BFloat16));  // the first layer's residual: x
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* p = params.data() + i * P;
    if (i == 0) rms_norm_row_bf16(res, nullptr, nullptr, bf(p[0]), h, H, feps, off);
    else rms_norm_row_bf16(x, res, res, bf(p[0]), h, H, feps, off);
    row_linear(h, H, p[1], qkv, qkv_n, act8);
    rotary_cpu(q, k, positions, p[10], p[11]);
    at::Tensor k_cache = caches[2 * i], v_cache = caches[2 * i + 1];
    const at::Tensor attn = paged_attention_cpu(q, k, v, k_cache, v_cache, slot_mapping, query_start, seq_lens,
                                                block_tables, 1, scale, windows[i]);
    row_linear(bf(attn), q_size, p[3], o, H, act8);
    rms_norm_row_bf16(o, res, res, bf(p[5]), h, H, feps, off);
    row_linear(h, H, p[6], gu, 2 * I, act8);
    silu_and_mul_row_bf16(gu, act, I);
    row_linear(act, I, p[8], x, H, act8);
  }
  const at::Tensor xt = ws.narrow(0, H, H).view({1, H}), rt = ws.narrow(0, 0, H).view({1, H});
  if (final_norm.has_value() && final_norm->defined()) return rms_norm_cpu(xt, rt, *final_norm, eps, norm_offset);
  return {xt.clone(), rt.clone()};  // (not views of the workspace)
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
    const c10::optional<at::Tensor>& final_norm, int64_t* one_row = nullptr) {
  constexpr int64_t P = kPerLayer;
  const int64_t layers = static_cast<int64_t>(windows.size());
  TORCH_CHECK(static_cast<int64_t>(params.size()) == layers * P && static_cast<int64_t>(caches.size()) == 2 * layers,
              "decoder_stack: ", P, " parameters and 2 caches per layer expected");
  TORCH_CHECK(x_in.dim() == 2, "decoder_stack: x must be [T, hidden]");
  const int64_t T = x_in.size(0), q_size = n_heads * head_dim, kv_size = n_kv_heads * head_dim;
#ifdef MII_BF16_VEC
  // a single sequence's decode step: the layers' row forms, where they take every layer (decided at the first such
  // step, and remembered in the handle: -1 not yet, 0 no, 1 yes)
  if (T == 1 && one_row != nullptr) {
    if (*one_row < 0) *one_row = one_row_fits(x_in, params, n_heads, n_kv_heads, head_dim, windows, act8);
    if (*one_row == 1)
      return one_row_stack(x_in, positions, params, caches, slot_mapping, query_start, seq_lens, block_tables, n_heads,
                           n_kv_heads, head_dim, scale, eps, norm_offset, windows, act8, final_norm);
  }
#endif
  at::Tensor x = x_in, residual;
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
  int64_t one_row = -1;  // whether a single row's step takes one_row_stack: -1 not known yet, 0 no, 1 yes
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
  static_assert(sizeof(StackParams) == 5 * sizeof(int64_t), "the handle's two int64 are the record's first two");
  return at::from_blob(
      h, {2},
      [](void* p) {
        auto* r = static_cast<StackParams*>(p);
        delete r->held;
        delete r->windows;
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
                           norm_offset, *h.windows, act8, final_norm, &h.one_row);
}

// mii::stack_one_row: whether a handle's single-row steps take one_row_stack (-1: none has run yet, 0: no, 1: yes)
int64_t stack_one_row_cpu(const at::Tensor& handle) { return held_stack(handle).one_row; }

TORCH_LIBRARY_IMPL(mii, CPU, m) {
  m.impl("stack_params", &stack_params_cpu);
  m.impl("decoder_stack", &decoder_stack_held_cpu);
  m.impl("stack_one_row", &stack_one_row_cpu);
}
// (oneDNN-prepacked weights among the parameters make the dispatcher pick this key)
TORCH_LIBRARY_IMPL(mii, MkldnnCPU, m) { m.impl("stack_params", &stack_params_cpu); }
