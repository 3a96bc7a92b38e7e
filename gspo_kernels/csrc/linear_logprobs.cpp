// Hidden-state path: per-token log-probability and entropy of logits = hidden @ weight.T + bias,
// without materializing the [N, V] logits, and its backward.
//
// The rows that count (active ones in the forward, rows with a nonzero gradient in the backward)
// are gathered into a zero-padded fp32 block. The vocabulary is walked in tiles; each tile of
// logits is produced by ATen's matmul (MKL/oneDNN) into one preallocated fp32 buffer, then folded
// in one pass per row (OpenMP over rows): running max / sum-exp / entropy sums and the label
// logit. The backward recomputes each tile for the rows with gradient only, turns it in place into
// dlogits, and accumulates dH += dZ @ W_tile and dW_tile = dZ.T @ H in fp32.
//
// Precision: fp16/bf16 hidden states and weights are converted to fp32 exactly, so every product
// h_k * w_k is exact in fp32 (at most 22 significant bits) and the GEMMs accumulate in fp32.
//
// Batch invariance and determinism: BLAS libraries pick kernels (and summation orders) by the shape
// of the product, so a row's logits computed among 1000 rows may differ in the last bit from the
// same row computed alone. Every row-dependent product (the logits tile z = h W^T, and dH = dZ W)
// is therefore issued as a GEMM of exactly `gemm_rows` rows, zero-padded, with the vocabulary tile
// width fixed: a row's log-prob, entropy and dH row are the same bits whatever the other rows are,
// where the row sits, and whether its logits were saved or recomputed. The per-row folds run in a
// fixed order (gspo_cpu.h). dW and dbias sum over rows in a fixed order (fixed chunks and shapes):
// the same bits on every run with the same thread count.
//
// Memory for speed: the forward may keep the first `save_cols` vocabulary columns of the logits
// (a budget chosen by the caller); the backward then reads those tiles instead of recomputing them,
// which saves one of the four N x H x V GEMMs for that share of the vocabulary.
// Labels are not range-checked here (the Python layer does it, except under torch.compile): a row
// whose label is outside [0, V) reads nothing out of bounds and gets a NaN log-prob.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "gspo_cpu.h"

namespace gspo {
namespace {

void check_linear_inputs(const at::Tensor& hidden, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                         const at::Tensor& labels, const c10::optional<at::Tensor>& active) {
  TORCH_CHECK(hidden.device().is_cpu() && weight.device().is_cpu(), "gspo_kernels cpu ops need CPU tensors");
  TORCH_CHECK(hidden.dim() == 2, "hidden must be [N, H], got ", hidden.sizes());
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == hidden.size(1) && weight.size(0) >= 1,
              "weight must be [V, H] with H = ", hidden.size(1), ", got ", weight.sizes());
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0), "bias must be [V], got ", bias->sizes());
  }
  const int64_t N = hidden.size(0);
  TORCH_CHECK(labels.dim() == 1 && labels.size(0) == N && labels.scalar_type() == at::kLong,
              "labels must be [N] int64 with N = ", N);
  if (active.has_value()) {
    TORCH_CHECK(active->dim() == 1 && active->size(0) == N && active->scalar_type() == at::kBool,
                "active must be [N] bool");
  }
}

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Rows of weight [v0, v0 + n) as an fp32 [n, H] tensor: a view when weight is fp32, else a
// conversion into `buf`.
at::Tensor weight_tile(const at::Tensor& weight, int64_t v0, int64_t n, at::Tensor& buf) {
  at::Tensor w = weight.narrow(0, v0, n);
  if (weight.scalar_type() == at::kFloat) return w;
  at::Tensor dst = buf.narrow(0, 0, n);
  dst.copy_(w);
  return dst;
}

// bias - max(bias) as fp32 (softmax is shift-invariant): a bias of 1e4 + noise then adds no rounding
// of 1e4-sized numbers to the logits. Unchanged when its max is not finite.
at::Tensor shifted_bias(const at::Tensor& bias) {
  at::Tensor b = bias.to(at::kFloat).contiguous();
  if (b.numel() == 0) return b;
  const float top = b.max().item<float>();
  return std::isfinite(top) ? (b - top).contiguous() : b;
}

// A [rows, cols] fp32 matrix in the front of a flat buffer.
at::Tensor tile_view(at::Tensor& flat, int64_t rows, int64_t cols) {
  return flat.narrow(0, 0, rows * cols).view({rows, cols});
}

// The rows `idx` of hidden (all rows when idx is undefined) as a contiguous fp32 [padded, H]
// matrix, the rows past the selected ones zero.
at::Tensor padded_rows(const at::Tensor& hidden, const at::Tensor& idx, int64_t n, int64_t padded) {
  if (!idx.defined() && n == padded && hidden.scalar_type() == at::kFloat && hidden.is_contiguous()) return hidden;
  at::Tensor h = at::empty({padded, hidden.size(1)}, hidden.options().dtype(at::kFloat));
  h.narrow(0, 0, n).copy_(idx.defined() ? hidden.index_select(0, idx) : hidden);
  if (padded > n) h.narrow(0, n, padded - n).zero_();
  return h;
}

// z[0:np] = h[r0:r0+np] @ w.T, as np / G products of exactly G rows.
void logits_tile(at::Tensor& z, const at::Tensor& h, int64_t r0, int64_t np, const at::Tensor& w, int64_t G) {
  const at::Tensor wt = w.t();
  for (int64_t s = 0; s < np; s += G) {
    at::Tensor out = z.narrow(0, s, G);
    at::mm_out(out, h.narrow(0, r0 + s, G), wt);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_fwd(const at::Tensor& hidden, const at::Tensor& weight,
                                                          const c10::optional<at::Tensor>& bias,
                                                          const at::Tensor& labels,
                                                          const c10::optional<at::Tensor>& active, double temperature,
                                                          bool return_entropy, int64_t row_block, int64_t gemm_rows,
                                                          int64_t vocab_block, int64_t save_cols) {
  check_linear_inputs(hidden, weight, bias, labels, active);
  const int64_t N = hidden.size(0), H = hidden.size(1), V = weight.size(0);
  const float inv_t = static_cast<float>(1.0 / temperature);
  auto f32 = hidden.options().dtype(at::kFloat);
  at::Tensor logp = at::zeros({N}, f32), ent = at::zeros({N}, f32), stats = at::zeros({2, N}, f32);
  const int64_t VB = std::min(std::max<int64_t>(vocab_block, 1), V);
  TORCH_CHECK(save_cols >= 0 && save_cols <= V && (save_cols % VB == 0 || save_cols == V),
              "save_cols must be a multiple of vocab_block in [0, V], or V; got ", save_cols);
  at::Tensor saved = at::empty({N * save_cols}, f32);
  advise_huge_pages(saved.data_ptr(), saved.nbytes());
  float* saved_p = save_cols > 0 ? saved.data_ptr<float>() : nullptr;

  const bool all_rows = !active.has_value();
  const at::Tensor idx = all_rows ? at::Tensor() : at::nonzero(*active).flatten();
  const int64_t Na = all_rows ? N : idx.size(0);
  if (Na == 0) return {logp, ent, stats, saved};
  const int64_t G = std::max<int64_t>(gemm_rows, 1);
  const int64_t R = round_up(std::max<int64_t>(row_block, 1), G);
  const int64_t* idx_p = all_rows ? nullptr : idx.data_ptr<int64_t>();
  const at::Tensor h = padded_rows(hidden, idx, Na, round_up(Na, G));
  const at::Tensor y = (all_rows ? labels : labels.index_select(0, idx)).contiguous();
  const at::Tensor b = bias.has_value() ? shifted_bias(*bias) : at::Tensor();
  const int64_t* yp = y.data_ptr<int64_t>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;

  at::Tensor zbuf = at::empty({std::min(R, round_up(Na, G)) * VB}, f32);
  at::Tensor wbuf = weight.scalar_type() == at::kFloat ? at::Tensor() : at::empty({VB, H}, f32);
  std::vector<RowStats> st(Na);
  std::vector<float> label_x(Na, std::numeric_limits<float>::quiet_NaN());  // stays NaN: label not in [0, V)

  for (int64_t r0 = 0; r0 < Na; r0 += R) {
    const int64_t nr = std::min(R, Na - r0);
    const int64_t np = round_up(nr, G);
    for (int64_t v0 = 0; v0 < V; v0 += VB) {
      const int64_t nv = std::min(VB, V - v0);
      at::Tensor z = tile_view(zbuf, np, nv);
      logits_tile(z, h, r0, np, weight_tile(weight, v0, nv, wbuf), G);
      const float* zp = z.data_ptr<float>();
      const float* btile = bp != nullptr ? bp + v0 : nullptr;
      at::parallel_for(0, nr, 4, [&](int64_t a, int64_t e) {
        for (int64_t i = a; i < e; ++i) {
          const float* zrow = zp + i * nv;
          RowStats& rs = st[r0 + i];
          if (return_entropy) {
            btile ? rs.fold<true, true>(zrow, btile, nv, inv_t) : rs.fold<true, false>(zrow, nullptr, nv, inv_t);
          } else {
            btile ? rs.fold<false, true>(zrow, btile, nv, inv_t) : rs.fold<false, false>(zrow, nullptr, nv, inv_t);
          }
          const int64_t label = yp[r0 + i];
          if (label >= v0 && label < v0 + nv) {
            label_x[r0 + i] = btile ? scaled<true>(zrow, btile, label - v0, inv_t)
                                    : scaled<false>(zrow, nullptr, label - v0, inv_t);
          }
          if (v0 < save_cols) {  // keep the tile row (still in cache) at the row's own position
            const int64_t row = idx_p ? idx_p[r0 + i] : r0 + i;
            std::memcpy(saved_p + v0 * N + row * nv, zrow, sizeof(float) * nv);
          }
        }
      });
    }
  }

  float* lp = logp.data_ptr<float>();
  float* ep = ent.data_ptr<float>();
  float* sp = stats.data_ptr<float>();
  for (int64_t i = 0; i < Na; ++i) {
    const int64_t row = idx_p ? idx_p[i] : i;
    const float ls = st[i].log_s();
    sp[row] = st[i].m;
    sp[N + row] = ls;
    lp[row] = (label_x[i] - st[i].m) - ls;
    ep[row] = return_entropy ? st[i].entropy() : 0.0f;
  }
  return {logp, ent, stats, saved};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_bwd(
    const at::Tensor& grad_logp, const c10::optional<at::Tensor>& grad_entropy, const at::Tensor& hidden,
    const at::Tensor& weight, const c10::optional<at::Tensor>& bias, const at::Tensor& labels,
    const c10::optional<at::Tensor>& active, const at::Tensor& stats, const at::Tensor& entropy,
    const at::Tensor& saved, double temperature, int64_t row_block, int64_t gemm_rows, int64_t vocab_block,
    int64_t save_cols, bool weight_grad) {
  check_linear_inputs(hidden, weight, bias, labels, active);
  const int64_t N = hidden.size(0), H = hidden.size(1), V = weight.size(0);
  const float inv_t = static_cast<float>(1.0 / temperature);
  auto f32 = hidden.options().dtype(at::kFloat);
  const bool has_ge = grad_entropy.has_value() && grad_entropy->defined();
  TORCH_CHECK(stats.dim() == 2 && stats.size(0) == 2 && stats.size(1) == N, "stats must be [2, N], got ",
              stats.sizes());

  // Rows that carry gradient: active and (grad_logp != 0 or grad_entropy != 0).
  const at::Tensor g_all = grad_logp.reshape({N}).to(at::kFloat);
  const at::Tensor ge_all = has_ge ? grad_entropy->reshape({N}).to(at::kFloat) : at::Tensor();
  at::Tensor need = g_all != 0;
  if (has_ge) need = need.logical_or(ge_all != 0);
  if (active.has_value()) need = need.logical_and(*active);
  const at::Tensor idx = at::nonzero(need).flatten();
  const int64_t Ng = idx.size(0);

  // Every vocabulary tile of dW is overwritten by its first row chunk when some row has gradient.
  const int64_t VW = weight_grad ? V : 0;
  at::Tensor dW = Ng > 0 ? at::empty({VW, H}, f32) : at::zeros({VW, H}, f32);
  if (Ng > 0) advise_huge_pages(dW.data_ptr(), dW.nbytes());
  at::Tensor dB = at::zeros({bias.has_value() ? V : 0}, f32);
  at::Tensor grad_hidden = at::zeros({N, H}, hidden.options());
  if (Ng > 0) {
    const int64_t G = std::max<int64_t>(gemm_rows, 1);
    const int64_t R = round_up(std::max<int64_t>(row_block, 1), G);
    const int64_t Np = round_up(Ng, G);
    const at::Tensor h = padded_rows(hidden, idx, Ng, Np);
    const at::Tensor y = labels.index_select(0, idx).contiguous();
    const at::Tensor g = g_all.index_select(0, idx).contiguous();
    const at::Tensor ge = has_ge ? ge_all.index_select(0, idx).contiguous() : at::Tensor();
    const at::Tensor s32 = stats.to(at::kFloat);
    const at::Tensor mrow = s32.select(0, 0).index_select(0, idx).contiguous();
    const at::Tensor lsrow = s32.select(0, 1).index_select(0, idx).contiguous();
    const at::Tensor ent = entropy.reshape({N}).to(at::kFloat).index_select(0, idx).contiguous();
    const at::Tensor b = bias.has_value() ? shifted_bias(*bias) : at::Tensor();
    const int64_t* yp = y.data_ptr<int64_t>();
    const int64_t* idx_p = idx.data_ptr<int64_t>();
    TORCH_CHECK(saved.numel() == N * save_cols && saved.scalar_type() == at::kFloat && saved.is_contiguous(),
                "saved must be the [N * save_cols] fp32 tensor returned by linear_fwd");
    const float* saved_p = save_cols > 0 ? saved.data_ptr<float>() : nullptr;
    const float* gp = g.data_ptr<float>();
    const float* gep = has_ge ? ge.data_ptr<float>() : nullptr;
    const float* mp = mrow.data_ptr<float>();
    const float* lsp = lsrow.data_ptr<float>();
    const float* entp = ent.data_ptr<float>();
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;

    const int64_t VB = std::min(std::max<int64_t>(vocab_block, 1), V);
    at::Tensor zbuf = at::empty({std::min(R, Np) * VB}, f32);
    at::Tensor wbuf = weight.scalar_type() == at::kFloat ? at::Tensor() : at::empty({VB, H}, f32);
    at::Tensor dh = at::zeros({Np, H}, f32);

    for (int64_t v0 = 0; v0 < V; v0 += VB) {
      const int64_t nv = std::min(VB, V - v0);
      const at::Tensor w = weight_tile(weight, v0, nv, wbuf);
      at::Tensor dw = weight_grad ? dW.narrow(0, v0, nv) : at::Tensor();
      const float* btile = bp != nullptr ? bp + v0 : nullptr;
      for (int64_t r0 = 0; r0 < Ng; r0 += R) {
        const int64_t nr = std::min(R, Ng - r0);
        const int64_t np = round_up(nr, G);
        at::Tensor z = tile_view(zbuf, np, nv);
        const bool from_saved = v0 < save_cols;
        if (!from_saved) logits_tile(z, h, r0, np, w, G);
        float* zp = z.data_ptr<float>();
        at::parallel_for(0, nr, 4, [&](int64_t a, int64_t e) {
          for (int64_t i = a; i < e; ++i) {
            const int64_t k = r0 + i;
            float* zrow = zp + i * nv;
            const float* src = from_saved ? saved_p + v0 * N + idx_p[k] * nv : zrow;
            const float gk = gp[k], gek = has_ge ? gep[k] : 0.0f;
            if (has_ge) {
              btile ? softmax_grad<true, true>(src, btile, zrow, nv, inv_t, mp[k], lsp[k], gk, gek, entp[k])
                    : softmax_grad<true, false>(src, nullptr, zrow, nv, inv_t, mp[k], lsp[k], gk, gek, entp[k]);
            } else {
              btile ? softmax_grad<false, true>(src, btile, zrow, nv, inv_t, mp[k], lsp[k], gk, 0.0f, 0.0f)
                    : softmax_grad<false, false>(src, nullptr, zrow, nv, inv_t, mp[k], lsp[k], gk, 0.0f, 0.0f);
            }
            const int64_t label = yp[k];
            if (label >= v0 && label < v0 + nv) zrow[label - v0] += inv_t * gk;
          }
        });
        if (np > nr) z.narrow(0, nr, np - nr).zero_();  // padding rows carry no gradient
        for (int64_t s = 0; s < np; s += G) dh.narrow(0, r0 + s, G).addmm_(z.narrow(0, s, G), w);
        if (weight_grad) {
          const at::Tensor hb = h.narrow(0, r0, np);
          if (r0 == 0) {
            at::mm_out(dw, z.t(), hb);
          } else {
            dw.addmm_(z.t(), hb);
          }
        }
        if (bias.has_value()) dB.narrow(0, v0, nv).add_(z.sum(0));
      }
    }
    grad_hidden.index_copy_(0, idx, dh.narrow(0, 0, Ng).to(hidden.scalar_type()));
  }
  at::Tensor grad_weight = dW.to(weight.scalar_type());
  at::Tensor grad_bias = bias.has_value() ? dB.to(bias->scalar_type()) : dB;
  return {grad_hidden, grad_weight, grad_bias};
}

}  // namespace
}  // namespace gspo

TORCH_LIBRARY_IMPL(gspo_kernels, CPU, m) {
  m.impl("linear_fwd", &gspo::linear_fwd);
  m.impl("linear_bwd", &gspo::linear_bwd);
}
