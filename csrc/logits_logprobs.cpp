// Logits path: per-token log-probability and entropy from materialized logits, and its backward.
//
// Forward, per row (OpenMP over rows via at::parallel_for): one pass over memory, chunk by chunk
// (a chunk is converted to fp32 in L1, then a max pass and an exp pass fold it into the running
// max / sum-exp / entropy sums); the label logit is gathered directly. Saves stats [2, N] fp32:
// the row max m and log s (kept apart, see gspo_cpu.h).
// Backward, per row: from the saved stats, grad = (g/tau)(onehot - p) - (ge/tau) p (log p + H),
// written into a new tensor or into the logits' own storage; rows with g = ge = 0 (or inactive)
// are zero-filled without reading the logits.
// Soft cap c > 0 (softcap; 0 = none): the logits are capped, x = c tanh(z / c) / tau, and the backward
// multiplies each logit's gradient by sech^2(z / c) (the kCap instantiations; see gspo_cpu.h).
// Labels are not range-checked here (the Python layer does it, except under torch.compile): a row
// whose label is outside [0, V) reads nothing outside its row and gets a NaN log-prob.
// Every row is computed by one thread in a fixed order: results are the same bits on every run
// and do not depend on the other rows.
// Extra position (extra_position = true): the tensor passed is the [B, T + 1, V] base of a model's
// output read as base[:, :-1]; the ops read its first T positions, and the backward writes the
// gradient of the whole base (zeros at position T), so autograd's slice_backward never allocates and
// zero-fills a second [B, T + 1, V] buffer (gspo_kernels/backends/cpu.py recognises the view).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <tuple>
#include <vector>

#include "gspo_cpu.h"

namespace gspo {
namespace {

// Row r of a [N, V] or [B, T, V] tensor whose last stride is 1 (T = N, sb = 0 for 2-D).
struct RowIndex {
  int64_t T, sb, st;
  explicit RowIndex(const at::Tensor& x) {
    if (x.dim() == 3) {
      T = std::max<int64_t>(x.size(1), 1);
      sb = x.stride(0);
      st = x.stride(1);
    } else {
      T = std::max<int64_t>(x.size(0), 1);
      sb = 0;
      st = x.stride(0);
    }
  }
  int64_t offset(int64_t r) const { return (r / T) * sb + (r % T) * st; }
};

// The [B, T, V] rows read by the kernels: base[:, :-1] of a [B, T + 1, V] base with extra_position.
at::Tensor read_rows(const at::Tensor& logits, bool extra_position) {
  if (!extra_position) return logits;
  TORCH_CHECK(logits.dim() == 3 && logits.size(1) >= 1,
              "extra_position needs [B, T + 1, V] logits with T + 1 >= 1, got ", logits.sizes());
  return logits.slice(1, 0, logits.size(1) - 1);
}

// Zero position T of every sequence of a [B, T + 1, V] gradient (the extra position has no token).
void zero_extra_position(at::Tensor& out) {
  const int64_t B = out.size(0), last = out.size(1) - 1, V = out.size(2);
  const int64_t bytes = V * static_cast<int64_t>(out.element_size());
  char* base = static_cast<char*>(out.data_ptr());
  const int64_t sb = out.stride(0) * out.element_size(), st = out.stride(1) * out.element_size();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) std::memset(base + b * sb + last * st, 0, bytes);
  });
}

// The out-of-place gradient's memory, kept from one backward to the next. A fresh logits-sized buffer is new
// memory on every step: its first touch costs page faults and the kernel's zero-fill, and where the OS returns
// freed memory to a hypervisor (free page reporting in a VM, as on the development machine), the next fresh
// buffer often lands on pages the host has discarded, whose first touch costs host faults as well: a step of
// the same inputs then took 1x to 4x as long from process to process and step to step (docs/cpu_backends.md,
// "A steady out-of-place backward"). So the backward keeps the storage of the last gradient it returned and
// writes the next gradient into it when nothing else holds it any more (the caller dropped the previous
// gradient, e.g. zero_grad(set_to_none=True) or the LM head's backward consumed it) and it is large enough
// (and at most twice the size needed); otherwise it allocates a fresh one, which becomes the kept one.
// Every element of the gradient is written, so the old contents never show. The hidden-state path's saved
// logits (linear_fwd, read by linear_bwd) are kept the same way in a slot of their own: the forward writes every
// entry the backward reads. Memory: one buffer of each kind stays allocated between steps (released by
// release_buffers(), never kept with GSPO_KERNELS_CPU_KEEP_GRADIENT=0).
constexpr size_t kKeepMinBytes = size_t(4) << 20;  // smaller buffers come from malloc's heap anyway

struct KeptStorage {
  std::mutex mu;
  c10::Storage storage;
};

KeptStorage& kept_gradient() {
  static KeptStorage kept;
  return kept;
}

KeptStorage& kept_saved_logits() {
  static KeptStorage kept;
  return kept;
}

bool keep_gradient_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("GSPO_KERNELS_CPU_KEEP_GRADIENT");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return enabled;
}

// A contiguous tensor of `sizes`, on `slot`'s storage when nothing else holds it and it fits (at most twice the
// bytes needed), else fresh (then kept in `slot`).
at::Tensor kept_buffer(KeptStorage& slot, at::IntArrayRef sizes, const at::TensorOptions& opts) {
  int64_t numel = 1;
  for (const int64_t d : sizes) numel *= d;
  const size_t bytes = static_cast<size_t>(numel) * opts.dtype().itemsize();
  if (bytes < kKeepMinBytes || !keep_gradient_enabled()) return at::empty(sizes, opts);
  std::lock_guard<std::mutex> lock(slot.mu);
  if (slot.storage && slot.storage.use_count() == 1 && slot.storage.nbytes() >= bytes &&
      slot.storage.nbytes() / 2 <= bytes) {
    std::vector<int64_t> strides(sizes.size(), 1);
    for (int64_t d = static_cast<int64_t>(sizes.size()) - 2; d >= 0; --d)
      strides[d] = strides[d + 1] * std::max<int64_t>(sizes[d + 1], 1);
    at::Tensor out = at::empty({0}, opts);
    out.set_(slot.storage, 0, sizes, strides);
    return out;
  }
  at::Tensor out = at::empty(sizes, opts);
  advise_huge_pages(out.data_ptr(), out.nbytes());
  slot.storage = out.storage();  // the previous one is freed once its holder drops it
  return out;
}

// A contiguous tensor shaped like `like`, on the kept storage when it is free and fits, else fresh.
at::Tensor gradient_buffer(const at::Tensor& like) {
  return kept_buffer(kept_gradient(), like.sizes(), like.options().memory_format(at::MemoryFormat::Contiguous));
}

void release_buffers() {
  for (KeptStorage* slot : {&kept_gradient(), &kept_saved_logits()}) {
    std::lock_guard<std::mutex> lock(slot->mu);
    slot->storage = c10::Storage();
  }
}

void check_logits_inputs(const at::Tensor& logits, const at::Tensor& labels, const c10::optional<at::Tensor>& active) {
  TORCH_CHECK(logits.device().is_cpu(), "gspo_kernels cpu ops need CPU tensors, got logits on ", logits.device());
  TORCH_CHECK(logits.dim() == 2 || logits.dim() == 3, "logits must be [N, V] or [B, T, V], got ", logits.sizes());
  TORCH_CHECK(logits.size(-1) >= 1, "logits must have V >= 1");
  TORCH_CHECK(logits.stride(-1) == 1 || logits.size(-1) == 1, "logits must have a unit last stride");
  const int64_t N = logits.numel() / logits.size(-1);
  TORCH_CHECK(labels.dim() == 1 && labels.size(0) == N && labels.scalar_type() == at::kLong && labels.is_contiguous(),
              "labels must be a contiguous [N] int64 tensor with N = ", N, ", got ", labels.sizes());
  if (active.has_value()) {
    TORCH_CHECK(active->dim() == 1 && active->size(0) == N && active->scalar_type() == at::kBool &&
                    active->is_contiguous(),
                "active must be a contiguous [N] bool tensor");
  }
}

template <typename T, bool kEntropy, bool kCap>
void forward_rows(const at::Tensor& logits, const int64_t* y, const bool* act, float inv_t, const Cap& cap,
                  float* logp, float* ent, float* stats, int64_t N) {
  const T* base = logits.data_ptr<T>();
  const RowIndex rows(logits);
  const int64_t V = logits.size(-1);
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    alignas(64) float buf[kChunk];
    for (int64_t r = r0; r < r1; ++r) {
      if (act != nullptr && !act[r]) {
        logp[r] = 0.0f;
        ent[r] = 0.0f;
        stats[r] = 0.0f;
        stats[N + r] = 0.0f;
        continue;
      }
      const T* row = base + rows.offset(r);
      RowStats st;
      for (int64_t c0 = 0; c0 < V; c0 += kChunk) {
        const int64_t n = std::min(kChunk, V - c0);
        st.fold<kEntropy, false, kCap>(load_chunk(row + c0, n, buf), nullptr, n, inv_t, cap);
      }
      const float ls = st.log_s();
      stats[r] = st.m;
      stats[N + r] = ls;
      const int64_t label = y[r];
      if (label >= 0 && label < V) {
        const float zl = to_float(row[label]);
        const float xl = kCap ? capped<false>(&zl, nullptr, 0, cap) : scaled<false>(&zl, nullptr, 0, inv_t);
        logp[r] = (xl - st.m) - ls;
      } else {
        logp[r] = std::numeric_limits<float>::quiet_NaN();
      }
      ent[r] = kEntropy ? st.entropy() : 0.0f;
    }
  });
}

// out may alias in (in-place backward); out_rows describes out's layout.
template <typename T, bool kEntropy, bool kCap>
void backward_rows(const T* in, const RowIndex& in_rows, T* out, const RowIndex& out_rows, int64_t V, const int64_t* y,
                   const bool* act, const float* g, const float* ge, const float* stats, const float* ent, float inv_t,
                   const Cap& cap, int64_t N) {
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    alignas(64) float buf[kChunk];
    alignas(64) float obuf[kChunk];
    for (int64_t r = r0; r < r1; ++r) {
      T* orow = out + out_rows.offset(r);
      const float gr = g[r];
      const float ger = kEntropy ? ge[r] : 0.0f;
      if ((act != nullptr && !act[r]) || (gr == 0.0f && ger == 0.0f)) {
        std::memset(static_cast<void*>(orow), 0, sizeof(T) * V);
        continue;
      }
      const T* irow = in + in_rows.offset(r);
      const int64_t label = y[r];
      // under the cap, the label's term inv_t * g times sech^2 of its logit (read before out overwrites it)
      const float glabel = kCap && label >= 0 && label < V ? inv_t * gr * cap_slope(to_float(irow[label]), cap) : 0.0f;
      for (int64_t c0 = 0; c0 < V; c0 += kChunk) {
        const int64_t n = std::min(kChunk, V - c0);
        const float* x = load_chunk(irow + c0, n, buf);
        float* o = std::is_same<T, float>::value ? reinterpret_cast<float*>(orow + c0) : obuf;
        softmax_grad<kEntropy, false, kCap>(x, nullptr, o, n, inv_t, stats[r], stats[N + r], gr, ger, ent[r], cap);
        if (label >= c0 && label < c0 + n) o[label - c0] += kCap ? glabel : inv_t * gr;
        if (!std::is_same<T, float>::value) {
          T* dst = orow + c0;
#pragma omp simd
          for (int64_t i = 0; i < n; ++i) dst[i] = from_float<T>(o[i]);
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> logits_fwd(const at::Tensor& input, const at::Tensor& labels,
                                                          const c10::optional<at::Tensor>& active, double temperature,
                                                          bool return_entropy, bool /*inplace_backward*/,
                                                          double softcap, bool extra_position) {
  const at::Tensor logits = read_rows(input, extra_position);
  check_logits_inputs(logits, labels, active);
  const int64_t N = labels.size(0);
  auto opts = logits.options().dtype(at::kFloat);
  at::Tensor logp = at::empty({N}, opts), ent = at::empty({N}, opts), stats = at::empty({2, N}, opts);
  const float inv_t = static_cast<float>(1.0 / temperature);
  const bool* act = active.has_value() ? active->data_ptr<bool>() : nullptr;
  const bool has_cap = softcap > 0.0;
  const Cap cap = has_cap ? Cap(softcap, temperature) : Cap();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "gspo_logits_fwd", [&] {
    const int64_t* y = labels.data_ptr<int64_t>();
    float *lp = logp.data_ptr<float>(), *ep = ent.data_ptr<float>(), *sp = stats.data_ptr<float>();
    if (has_cap) {
      return_entropy ? forward_rows<scalar_t, true, true>(logits, y, act, inv_t, cap, lp, ep, sp, N)
                     : forward_rows<scalar_t, false, true>(logits, y, act, inv_t, cap, lp, ep, sp, N);
    } else {
      return_entropy ? forward_rows<scalar_t, true, false>(logits, y, act, inv_t, cap, lp, ep, sp, N)
                     : forward_rows<scalar_t, false, false>(logits, y, act, inv_t, cap, lp, ep, sp, N);
    }
  });
  return {logp, ent, stats};
}

void run_backward(const at::Tensor& grad_logp, const c10::optional<at::Tensor>& grad_entropy, const at::Tensor& logits,
                  at::Tensor& out, const at::Tensor& labels, const c10::optional<at::Tensor>& active,
                  const at::Tensor& stats, const at::Tensor& entropy, double temperature, double softcap) {
  check_logits_inputs(logits, labels, active);
  const int64_t N = labels.size(0);
  auto as_f32 = [N](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.numel() == N, name, " must have N = ", N, " elements, got ", t.sizes());
    return t.reshape({N}).to(at::kFloat).contiguous();
  };
  const at::Tensor g = as_f32(grad_logp, "grad_logp");
  TORCH_CHECK(stats.dim() == 2 && stats.size(0) == 2 && stats.size(1) == N, "stats must be [2, N], got ",
              stats.sizes());
  const at::Tensor l = stats.to(at::kFloat).contiguous();
  const at::Tensor h = as_f32(entropy, "entropy");
  const bool has_ge = grad_entropy.has_value() && grad_entropy->defined();
  const at::Tensor ge = has_ge ? as_f32(*grad_entropy, "grad_entropy") : at::Tensor();
  const float inv_t = static_cast<float>(1.0 / temperature);
  const bool* act = active.has_value() ? active->data_ptr<bool>() : nullptr;
  const RowIndex in_rows(logits), out_rows(out);
  const int64_t V = logits.size(-1);
  const bool has_cap = softcap > 0.0;
  const Cap cap = has_cap ? Cap(softcap, temperature) : Cap();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "gspo_logits_bwd", [&] {
    const scalar_t* in = logits.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t* y = labels.data_ptr<int64_t>();
    const float *gp = g.data_ptr<float>(), *gep = has_ge ? ge.data_ptr<float>() : nullptr;
    const float *lp = l.data_ptr<float>(), *hp = h.data_ptr<float>();
    if (has_cap) {
      has_ge ? backward_rows<scalar_t, true, true>(in, in_rows, o, out_rows, V, y, act, gp, gep, lp, hp, inv_t, cap, N)
             : backward_rows<scalar_t, false, true>(in, in_rows, o, out_rows, V, y, act, gp, gep, lp, hp, inv_t, cap, N);
    } else {
      has_ge ? backward_rows<scalar_t, true, false>(in, in_rows, o, out_rows, V, y, act, gp, gep, lp, hp, inv_t, cap, N)
             : backward_rows<scalar_t, false, false>(in, in_rows, o, out_rows, V, y, act, gp, gep, lp, hp, inv_t, cap,
                                                    N);
    }
  });
}

at::Tensor logits_bwd(const at::Tensor& grad_logp, const c10::optional<at::Tensor>& grad_entropy,
                      const at::Tensor& input, const at::Tensor& labels, const c10::optional<at::Tensor>& active,
                      const at::Tensor& stats, const at::Tensor& entropy, double temperature, double softcap,
                      bool extra_position) {
  const at::Tensor logits = read_rows(input, extra_position);
  at::Tensor full = gradient_buffer(input);
  at::Tensor out = read_rows(full, extra_position);
  run_backward(grad_logp, grad_entropy, logits, out, labels, active, stats, entropy, temperature, softcap);
  if (extra_position) zero_extra_position(full);
  return full;
}

void logits_bwd_(at::Tensor& input, const at::Tensor& grad_logp, const c10::optional<at::Tensor>& grad_entropy,
                 const at::Tensor& labels, const c10::optional<at::Tensor>& active, const at::Tensor& stats,
                 const at::Tensor& entropy, double temperature, double softcap, bool extra_position) {
  at::Tensor logits = read_rows(input, extra_position);
  run_backward(grad_logp, grad_entropy, logits, logits, labels, active, stats, entropy, temperature, softcap);
  if (extra_position) zero_extra_position(input);
}

}  // namespace

// The hidden-state forward's saved logits ([numel] fp32), on their kept storage when it is free (see above).
at::Tensor saved_logits_buffer(int64_t numel, const at::TensorOptions& opts) {
  return kept_buffer(kept_saved_logits(), {numel}, opts);
}
}  // namespace gspo

TORCH_LIBRARY_IMPL(gspo_kernels, CPU, m) {
  m.impl("logits_fwd", &gspo::logits_fwd);
  m.impl("logits_bwd", &gspo::logits_bwd);
  m.impl("logits_bwd_", &gspo::logits_bwd_);
}

TORCH_LIBRARY_IMPL(gspo_kernels, CatchAll, m) { m.impl("release_buffers", &gspo::release_buffers); }
