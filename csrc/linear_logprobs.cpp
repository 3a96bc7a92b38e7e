// Hidden-state path: per-token log-probability and entropy of logits = hidden @ weight.T + bias,
// without materializing the [N, V] logits, and its backward.
//
// The rows that count (active ones in the forward, rows with a nonzero gradient in the backward)
// are gathered into an fp32 block. The vocabulary is walked in tiles; each [rows, vocab_block]
// tile of logits is produced by ATen's matmul (MKL/oneDNN) into one preallocated fp32 buffer, then
// folded in one pass per row (OpenMP over rows): running max / sum-exp / entropy sums and the label
// logit. The backward recomputes each tile for the rows with gradient only, turns it in place into
// dlogits, and accumulates dH += dZ @ W_tile and dW_tile = dZ.T @ H in fp32.
// Memory for speed: the forward may keep the first `save_cols` vocabulary columns of the logits
// (a budget chosen by the caller); the backward then reads those tiles instead of recomputing them,
// which saves one of the four N x H x V GEMMs for that share of the vocabulary.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
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
  const int64_t N = hidden.size(0), V = weight.size(0);
  TORCH_CHECK(labels.dim() == 1 && labels.size(0) == N && labels.scalar_type() == at::kLong,
              "labels must be [N] int64 with N = ", N);
  if (active.has_value()) {
    TORCH_CHECK(active->dim() == 1 && active->size(0) == N && active->scalar_type() == at::kBool,
                "active must be [N] bool");
  }
  const at::Tensor y = labels.contiguous();
  const int64_t* yp = y.data_ptr<int64_t>();
  const at::Tensor act = active.has_value() ? active->contiguous() : at::Tensor();
  const bool* ap = act.defined() ? act.data_ptr<bool>() : nullptr;
  for (int64_t r = 0; r < N; ++r) {
    TORCH_CHECK(!(ap == nullptr || ap[r]) || (yp[r] >= 0 && yp[r] < V), "labels[", r, "] = ", yp[r],
                " is outside [0, ", V, ")");
  }
}

// Rows of weight [v0, v0 + n) as an fp32 [n, H] tensor: a view when weight is fp32, else a
// conversion into `buf`.
at::Tensor weight_tile(const at::Tensor& weight, int64_t v0, int64_t n, at::Tensor& buf) {
  at::Tensor w = weight.narrow(0, v0, n);
  if (weight.scalar_type() == at::kFloat) return w;
  at::Tensor dst = buf.narrow(0, 0, n);
  dst.copy_(w);
  return dst;
}

// A [rows, cols] fp32 matrix in the front of a flat buffer.
at::Tensor tile_view(at::Tensor& flat, int64_t rows, int64_t cols) {
  return flat.narrow(0, 0, rows * cols).view({rows, cols});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_fwd(const at::Tensor& hidden, const at::Tensor& weight,
                                                          const c10::optional<at::Tensor>& bias,
                                                          const at::Tensor& labels,
                                                          const c10::optional<at::Tensor>& active, double temperature,
                                                          bool return_entropy, int64_t row_block,
                                                          int64_t vocab_block, int64_t save_cols) {
  check_linear_inputs(hidden, weight, bias, labels, active);
  const int64_t N = hidden.size(0), H = hidden.size(1), V = weight.size(0);
  const float inv_t = static_cast<float>(1.0 / temperature);
  auto f32 = hidden.options().dtype(at::kFloat);
  at::Tensor logp = at::zeros({N}, f32), ent = at::zeros({N}, f32), lse = at::zeros({N}, f32);
  const int64_t VB = std::min(std::max<int64_t>(vocab_block, 1), V);
  TORCH_CHECK(save_cols >= 0 && save_cols <= V && (save_cols % VB == 0 || save_cols == V),
              "save_cols must be a multiple of vocab_block in [0, V], or V; got ", save_cols);
  at::Tensor saved = at::empty({N * save_cols}, f32);
  advise_huge_pages(saved.data_ptr(), saved.nbytes());
  float* saved_p = save_cols > 0 ? saved.data_ptr<float>() : nullptr;

  const bool all_rows = !active.has_value();
  const at::Tensor idx = all_rows ? at::Tensor() : at::nonzero(*active).flatten();
  const int64_t Na = all_rows ? N : idx.size(0);
  if (Na == 0) return {logp, ent, lse, saved};
  const int64_t* idx_p = all_rows ? nullptr : idx.data_ptr<int64_t>();
  const at::Tensor h = (all_rows ? hidden : hidden.index_select(0, idx)).to(at::kFloat).contiguous();
  const at::Tensor y = (all_rows ? labels : labels.index_select(0, idx)).contiguous();
  const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const int64_t* yp = y.data_ptr<int64_t>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;

  const int64_t R = std::min(std::max<int64_t>(row_block, 1), Na);
  at::Tensor zbuf = at::empty({R * VB}, f32);
  at::Tensor wbuf = weight.scalar_type() == at::kFloat ? at::Tensor() : at::empty({VB, H}, f32);
  std::vector<RowStats> stats(Na);
  std::vector<float> label_x(Na, 0.0f);

  for (int64_t r0 = 0; r0 < Na; r0 += R) {
    const int64_t nr = std::min(R, Na - r0);
    const at::Tensor hb = h.narrow(0, r0, nr);
    for (int64_t v0 = 0; v0 < V; v0 += VB) {
      const int64_t nv = std::min(VB, V - v0);
      at::Tensor z = tile_view(zbuf, nr, nv);
      at::mm_out(z, hb, weight_tile(weight, v0, nv, wbuf).t());
      const float* zp = z.data_ptr<float>();
      const float* btile = bp != nullptr ? bp + v0 : nullptr;
      at::parallel_for(0, nr, 4, [&](int64_t a, int64_t e) {
        for (int64_t i = a; i < e; ++i) {
          const float* zrow = zp + i * nv;
          RowStats& st = stats[r0 + i];
          if (return_entropy) {
            btile ? st.fold<true, true>(zrow, btile, nv, inv_t) : st.fold<true, false>(zrow, nullptr, nv, inv_t);
          } else {
            btile ? st.fold<false, true>(zrow, btile, nv, inv_t) : st.fold<false, false>(zrow, nullptr, nv, inv_t);
          }
          const int64_t label = yp[r0 + i];
          if (label >= v0 && label < v0 + nv) {
            label_x[r0 + i] = (zrow[label - v0] + (btile ? btile[label - v0] : 0.0f)) * inv_t;
          }
          if (v0 < save_cols) {  // keep the tile row (still in cache) at the row's own position
            const int64_t row = idx_p ? idx_p[r0 + i] : r0 + i;
            std::memcpy(saved_p + v0 * N + row * nv, zrow, sizeof(float) * nv);
          }
        }
      });
    }
  }

  at::Tensor logp_a = at::empty({Na}, f32), ent_a = at::empty({Na}, f32), lse_a = at::empty({Na}, f32);
  float* lp = logp_a.data_ptr<float>();
  float* ep = ent_a.data_ptr<float>();
  float* sp = lse_a.data_ptr<float>();
  for (int64_t i = 0; i < Na; ++i) {
    sp[i] = stats[i].lse();
    lp[i] = label_x[i] - sp[i];
    ep[i] = return_entropy ? stats[i].entropy() : 0.0f;
  }
  if (all_rows) return {logp_a, ent_a, lse_a, saved};
  logp.index_copy_(0, idx, logp_a);
  ent.index_copy_(0, idx, ent_a);
  lse.index_copy_(0, idx, lse_a);
  return {logp, ent, lse, saved};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_bwd(
    const at::Tensor& grad_logp, const c10::optional<at::Tensor>& grad_entropy, const at::Tensor& hidden,
    const at::Tensor& weight, const c10::optional<at::Tensor>& bias, const at::Tensor& labels,
    const c10::optional<at::Tensor>& active, const at::Tensor& lse, const at::Tensor& entropy, const at::Tensor& saved,
    double temperature, int64_t row_block, int64_t vocab_block, int64_t save_cols, bool weight_grad) {
  check_linear_inputs(hidden, weight, bias, labels, active);
  const int64_t N = hidden.size(0), H = hidden.size(1), V = weight.size(0);
  const float inv_t = static_cast<float>(1.0 / temperature);
  auto f32 = hidden.options().dtype(at::kFloat);
  const bool has_ge = grad_entropy.has_value() && grad_entropy->defined();

  // Rows that carry gradient: active and (grad_logp != 0 or grad_entropy != 0).
  const at::Tensor g_all = grad_logp.reshape({N}).to(at::kFloat);
  const at::Tensor ge_all = has_ge ? grad_entropy->reshape({N}).to(at::kFloat) : at::Tensor();
  at::Tensor need = g_all != 0;
  if (has_ge) need = need.logical_or(ge_all != 0);
  if (active.has_value()) need = need.logical_and(*active);
  const at::Tensor idx = at::nonzero(need).flatten();
  const int64_t Ng = idx.size(0);

  // Every vocabulary tile of dW is overwritten by its first row block when some row has gradient.
  const int64_t VW = weight_grad ? V : 0;
  at::Tensor dW = Ng > 0 ? at::empty({VW, H}, f32) : at::zeros({VW, H}, f32);
  if (Ng > 0) advise_huge_pages(dW.data_ptr(), dW.nbytes());
  at::Tensor dB = at::zeros({bias.has_value() ? V : 0}, f32);
  at::Tensor grad_hidden = at::zeros({N, H}, hidden.options());
  if (Ng > 0) {
    const at::Tensor h = hidden.index_select(0, idx).to(at::kFloat).contiguous();
    const at::Tensor y = labels.index_select(0, idx).contiguous();
    const at::Tensor g = g_all.index_select(0, idx).contiguous();
    const at::Tensor ge = has_ge ? ge_all.index_select(0, idx).contiguous() : at::Tensor();
    const at::Tensor l = lse.reshape({N}).to(at::kFloat).index_select(0, idx).contiguous();
    const at::Tensor ent = entropy.reshape({N}).to(at::kFloat).index_select(0, idx).contiguous();
    const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
    const int64_t* yp = y.data_ptr<int64_t>();
    const int64_t* idx_p = idx.data_ptr<int64_t>();
    TORCH_CHECK(saved.numel() == N * save_cols && saved.scalar_type() == at::kFloat && saved.is_contiguous(),
                "saved must be the [N * save_cols] fp32 tensor returned by linear_fwd");
    const float* saved_p = save_cols > 0 ? saved.data_ptr<float>() : nullptr;
    const float* gp = g.data_ptr<float>();
    const float* gep = has_ge ? ge.data_ptr<float>() : nullptr;
    const float* lp = l.data_ptr<float>();
    const float* entp = ent.data_ptr<float>();
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;

    const int64_t R = std::min(std::max<int64_t>(row_block, 1), Ng);
    const int64_t VB = std::min(std::max<int64_t>(vocab_block, 1), V);
    at::Tensor zbuf = at::empty({R * VB}, f32);
    at::Tensor wbuf = weight.scalar_type() == at::kFloat ? at::Tensor() : at::empty({VB, H}, f32);
    at::Tensor dh = at::zeros({Ng, H}, f32);

    for (int64_t v0 = 0; v0 < V; v0 += VB) {
      const int64_t nv = std::min(VB, V - v0);
      const at::Tensor w = weight_tile(weight, v0, nv, wbuf);
      at::Tensor dw = weight_grad ? dW.narrow(0, v0, nv) : at::Tensor();
      const float* btile = bp != nullptr ? bp + v0 : nullptr;
      for (int64_t r0 = 0; r0 < Ng; r0 += R) {
        const int64_t nr = std::min(R, Ng - r0);
        const at::Tensor hb = h.narrow(0, r0, nr);
        at::Tensor z = tile_view(zbuf, nr, nv);
        const bool from_saved = v0 < save_cols;
        if (!from_saved) at::mm_out(z, hb, w.t());
        float* zp = z.data_ptr<float>();
        at::parallel_for(0, nr, 4, [&](int64_t a, int64_t e) {
          for (int64_t i = a; i < e; ++i) {
            const int64_t k = r0 + i;
            float* zrow = zp + i * nv;
            const float* src = from_saved ? saved_p + v0 * N + idx_p[k] * nv : zrow;
            const float gk = gp[k], gek = has_ge ? gep[k] : 0.0f;
            if (has_ge) {
              btile ? softmax_grad<true, true>(src, btile, zrow, nv, inv_t, lp[k], gk, gek, entp[k])
                    : softmax_grad<true, false>(src, nullptr, zrow, nv, inv_t, lp[k], gk, gek, entp[k]);
            } else {
              btile ? softmax_grad<false, true>(src, btile, zrow, nv, inv_t, lp[k], gk, 0.0f, 0.0f)
                    : softmax_grad<false, false>(src, nullptr, zrow, nv, inv_t, lp[k], gk, 0.0f, 0.0f);
            }
            const int64_t label = yp[k];
            if (label >= v0 && label < v0 + nv) zrow[label - v0] += inv_t * gk;
          }
        });
        dh.narrow(0, r0, nr).addmm_(z, w);
        if (weight_grad && r0 == 0) {
          at::mm_out(dw, z.t(), hb);
        } else if (weight_grad) {
          dw.addmm_(z.t(), hb);
        }
        if (bias.has_value()) dB.narrow(0, v0, nv).add_(z.sum(0));
      }
    }
    grad_hidden.index_copy_(0, idx, dh.to(hidden.scalar_type()));
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
