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
// Two modes, chosen by `gemm_rows`:
// * gemm_rows = 0 (the default, speed): every product is one GEMM shaped by the block's actual row
//   count (no zero padding), in blocks of `row_block` rows and `vocab_block` vocabulary columns chosen
//   by the caller for the shape. Deterministic run to run (same shapes, same thread count: the same
//   BLAS kernels and summation orders), but a row's last bits may depend on how many rows share its
//   GEMM, and the backward's recomputed tiles (over the rows with gradient) may round differently from
//   the forward's.
// * gemm_rows > 0 (batch invariance): BLAS libraries pick kernels (and summation orders) by the shape
//   of the product, so a row's logits computed among 1000 rows may differ in the last bit from the
//   same row computed alone. Every row-dependent product (the logits tile z = h W^T, and dH = dZ W)
//   is then issued as a GEMM of exactly `gemm_rows` rows, zero-padded, with the vocabulary tile width
//   fixed: a row's log-prob, entropy and dH row are the same bits whatever the other rows are, where
//   the row sits, and whether its logits were saved or recomputed. The price: fewer active rows than
//   gemm_rows cost as much as gemm_rows. The GEMMs run as single-threaded tasks of fixed shapes
//   (for_each_fixed_task): a multi-threaded BLAS call may sum in an order that follows its thread count.
// In both modes the per-row folds run in a fixed order (gspo_cpu.h), and dW and dbias sum over rows in
// a fixed order (fixed chunks and shapes): the same bits on every run with the same thread count.
//
// Memory for speed: the forward may keep the first `save_cols` vocabulary columns of the logits
// (a budget chosen by the caller); the backward then reads those tiles instead of recomputing them,
// which saves one of the four N x H x V GEMMs for that share of the vocabulary. The saved buffer holds
// N * save_cols floats; vocabulary tile v0 starts at offset v0 * N and holds the active rows in order
// (the i-th active row at row i of the [rows, width] tile), so in the unpadded mode the forward's GEMM
// writes a tile straight into it.
// Soft cap c > 0 (softcap; 0 = none): each logit v = z + b becomes c tanh(v / c) / tau (the bias is then
// not shifted: the cap is not shift-invariant), and its gradient is multiplied by sech^2(v / c); the
// uncapped loops are unchanged (gspo_cpu.h).
// Labels are not range-checked here (the Python layer does it, except under torch.compile): a row
// whose label is outside [0, V) reads nothing out of bounds and gets a NaN log-prob.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <dlfcn.h>
#include <omp.h>
#include <torch/library.h>

#include <cstdlib>

#include <exception>
#include <mutex>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "gspo_cpu.h"

namespace gspo {
// The saved logits' buffer, kept from one step to the next (defined in logits_logprobs.cpp).
at::Tensor saved_logits_buffer(int64_t numel, const at::TensorOptions& opts);

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

// The bias as the kernels add it: shifted (shifted_bias) without a cap, as given with one.
at::Tensor kernel_bias(const at::Tensor& bias, bool has_cap) {
  return has_cap ? bias.to(at::kFloat).contiguous() : shifted_bias(bias);
}

// The capped (kCap) row fold, its label logit and its gradient, dispatched on entropy / bias at run time.
inline void fold_capped(RowStats& rs, bool entropy, const float* z, const float* b, int64_t n, const Cap& cap) {
  if (entropy) {
    b ? rs.fold<true, true, true>(z, b, n, 0.0f, cap) : rs.fold<true, false, true>(z, nullptr, n, 0.0f, cap);
  } else {
    b ? rs.fold<false, true, true>(z, b, n, 0.0f, cap) : rs.fold<false, false, true>(z, nullptr, n, 0.0f, cap);
  }
}

inline float label_capped(const float* z, const float* b, int64_t j, const Cap& cap) {
  return b ? capped<true>(z, b, j, cap) : capped<false>(z, nullptr, j, cap);
}

// dlogits of one row under the cap into out (which may alias src), the label's term included.
inline void grad_capped(bool has_ge, const float* src, const float* b, float* out, int64_t n, int64_t label,
                        float inv_t, float m, float ls, float g, float ge, float ent, const Cap& cap) {
  const bool inside = label >= 0 && label < n;
  const float glabel = inside ? inv_t * g * cap_slope(b ? src[label] + b[label] : src[label], cap) : 0.0f;
  if (has_ge) {
    b ? softmax_grad<true, true, true>(src, b, out, n, inv_t, m, ls, g, ge, ent, cap)
      : softmax_grad<true, false, true>(src, nullptr, out, n, inv_t, m, ls, g, ge, ent, cap);
  } else {
    b ? softmax_grad<false, true, true>(src, b, out, n, inv_t, m, ls, g, 0.0f, 0.0f, cap)
      : softmax_grad<false, false, true>(src, nullptr, out, n, inv_t, m, ls, g, 0.0f, 0.0f, cap);
  }
  if (inside) out[label] += glabel;
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

// Row blocking of one call: `gemm_rows` > 0 pads every block to a multiple of it and issues GEMMs of
// exactly that many rows (batch invariance); 0 issues one GEMM per block of its actual row count.
struct RowBlocks {
  int64_t G;  // rows per GEMM, 0: the block's own count
  int64_t R;  // rows per block
  RowBlocks(int64_t row_block, int64_t gemm_rows)
      : G(std::max<int64_t>(gemm_rows, 0)),
        R(gemm_rows > 0 ? round_up(std::max<int64_t>(row_block, 1), gemm_rows) : std::max<int64_t>(row_block, 1)) {}
  int64_t padded(int64_t n) const { return G > 0 ? round_up(n, G) : n; }  // rows of a block of n, padded
};

// fp32 out = a @ b (accumulate: out += a @ b) for the default mode. Through oneDNN's matmul when
// this torch build has it: oneDNN picks AVX-512 kernels on any x86 CPU that has them, while MKL's
// sgemm (what at::mm calls for fp32) takes its AVX2 path on AMD CPUs; on the 2-core AMD EPYC (Zen 5)
// of the development machine, single-threaded, 140-235 GFLOP/s against 58-83 for the tile shapes
// used here. The entry point (at::native::mkldnn_matmul, exported by libtorch_cpu but not in the
// installed headers) is looked up at run time, so a torch build without it falls back to at::mm.
// GSPO_KERNELS_CPU_GEMM=aten forces at::mm (read on every call: tests compare both).
// That entry point refuses fp32 operands (a RuntimeError, "bf16 path needs the cpu support ...") on a CPU
// without AVX-512 BW/VL/DQ, e.g. an AVX2-only x86 machine: there at::mm runs, which takes the same
// AVX2 path oneDNN would have had.
using DnnlMatmul = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, float, float);

bool dnnl_takes_fp32() {
#if defined(__x86_64__) || defined(_M_X64)
  return __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512dq");
#else
  return false;  // the Arm builds' oneDNN route is not measured here: at::mm
#endif
}

DnnlMatmul dnnl_matmul() {
  static const DnnlMatmul fn = []() -> DnnlMatmul {
    if (!at::hasMKLDNN() || !dnnl_takes_fp32()) return nullptr;
    void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    if (lib == nullptr) return nullptr;
    return reinterpret_cast<DnnlMatmul>(dlsym(lib, "_ZN2at6native13mkldnn_matmulERKNS_6TensorES3_S3_ff"));
  }();
  const char* choice = std::getenv("GSPO_KERNELS_CPU_GEMM");
  return (choice != nullptr && std::strcmp(choice, "aten") == 0) ? nullptr : fn;
}

void gemm_out(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, bool accumulate, DnnlMatmul dnnl) {
  if (dnnl != nullptr) {
    dnnl(a, b, out, accumulate ? 1.0f : 0.0f, 1.0f);
  } else if (accumulate) {
    out.addmm_(a, b);
  } else {
    at::mm_out(out, a, b);
  }
}

// Default (unpadded) mode: the threads share out the vocabulary tiles of a row block, one tile at a
// time (dynamic schedule), and each tile's GEMMs run single-threaded inside the parallel region: no
// BLAS-internal barriers, and a thread slowed down by a busy machine simply takes fewer tiles. Every
// tile writes only its own outputs (partial row statistics, dW rows, a dH partial), combined
// afterwards in tile order, so the results do not depend on which thread ran which tile.
int tile_threads(int64_t ntiles) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), ntiles)));
}

template <typename F>
void for_each_tile(int64_t ntiles, int nthreads, const F& f) {
  const at::ThreadLocalState tls;  // the dispatcher state of the calling thread (autograd off, ...)
  std::exception_ptr error;
  std::mutex error_mutex;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
  for (int64_t t = 0; t < ntiles; ++t) {
    try {
      at::ThreadLocalStateGuard guard(tls);
      f(t, omp_get_thread_num());
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

// Batch-invariant mode: a GEMM's bits must depend only on its inputs and its shape. A BLAS call made
// outside a parallel region splits its work over as many threads as it gets, and MKL's sgemm splits
// the summed dimension too (an [8, 1024] x [1024, 256] product rounds differently with 1 and 2 threads);
// with MKL's dynamic threading the count it gets can follow the machine's load, so the same product
// changed bits from call to call on a loaded 16-core host. So every GEMM of this mode is cut into
// tasks of a fixed shape (G rows by kTaskCols vocabulary columns, or by kTaskHidden hidden columns:
// shapes that depend on G, the vocabulary tile and H only), the threads share out the tasks, and each
// task's GEMM runs on its own thread (SingleThreadedGemm): a task's bits do not depend on the thread
// count, nor on which thread ran it.
constexpr int64_t kTaskCols = 512;    // vocabulary columns per task (logits z = h W^T, dW = dZ^T H)
constexpr int64_t kTaskHidden = 128;  // hidden columns per task (dH = dZ W)

// MKL's mkl_set_num_threads_local (C entry point MKL_Set_Num_Threads_Local; the lowercase symbol is the
// Fortran one, which takes a pointer), looked up at run time (torch builds that link MKL export it), or null.
using MklSetLocal = int (*)(int);

MklSetLocal mkl_set_local() {
  static const MklSetLocal fn = []() -> MklSetLocal {
    void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    return lib == nullptr ? nullptr : reinterpret_cast<MklSetLocal>(dlsym(lib, "MKL_Set_Num_Threads_Local"));
  }();
  return fn;
}

// While alive, the GEMMs the calling thread issues run on that thread alone, whatever the global
// settings. Inside an active parallel region MKL and oneDNN already run sequentially, but a team of one
// thread (one task, or one intra-op thread) is not active: there oneDNN would use omp_get_max_threads()
// threads and MKL its own count (torch sets it globally with mkl_set_num_threads). Hence the two
// thread-local settings: OpenMP's nthreads of the current task (what oneDNN reads) and MKL's local count.
class SingleThreadedGemm {
 public:
  SingleThreadedGemm() : omp_prev_(omp_get_max_threads()), mkl_(mkl_set_local()) {
    omp_set_num_threads(1);
    if (mkl_ != nullptr) mkl_prev_ = mkl_(1);
  }
  ~SingleThreadedGemm() {
    if (mkl_ != nullptr) mkl_(mkl_prev_);  // 0 (the usual previous value) restores the global count
    omp_set_num_threads(omp_prev_);
  }
  SingleThreadedGemm(const SingleThreadedGemm&) = delete;
  SingleThreadedGemm& operator=(const SingleThreadedGemm&) = delete;

 private:
  int omp_prev_;
  MklSetLocal mkl_;
  int mkl_prev_ = 0;
};

// f(t) for t in [0, ntasks), shared out over the intra-op threads, each call with single-threaded GEMMs.
template <typename F>
void for_each_fixed_task(int64_t ntasks, const F& f) {
  for_each_tile(ntasks, tile_threads(ntasks), [&](int64_t t, int) {
    const SingleThreadedGemm one_thread;
    f(t);
  });
}

// z[0:np, 0:nv] = h[r0:r0+np] @ w.T (w: [nv, H]) in tasks of G rows by kTaskCols columns.
void logits_tile(at::Tensor& z, const at::Tensor& h, int64_t r0, int64_t np, const at::Tensor& w, int64_t G,
                 DnnlMatmul dnnl) {
  const int64_t nv = w.size(0), slices = (nv + kTaskCols - 1) / kTaskCols;
  for_each_fixed_task(np / G * slices, [&](int64_t t) {
    const int64_t s = t / slices * G, c = t % slices * kTaskCols, nc = std::min(kTaskCols, nv - c);
    at::Tensor out = z.narrow(0, s, G).narrow(1, c, nc);
    gemm_out(out, h.narrow(0, r0 + s, G), w.narrow(0, c, nc).t(), false, dnnl);
  });
}

// dh[r0:r0+np] += z[0:np] @ w in tasks of G rows by kTaskHidden hidden columns (each sums over the whole
// vocabulary tile); with dw defined, dw (+)= z.T @ h[r0:r0+np] in tasks of kTaskCols rows of dw (each sums
// over the np rows of the block), overwritten when !accumulate_dw.
void grad_tile(at::Tensor& dh, at::Tensor& dw, const at::Tensor& z, const at::Tensor& h, int64_t r0, int64_t np,
               const at::Tensor& w, int64_t G, bool accumulate_dw, DnnlMatmul dnnl) {
  const int64_t nv = w.size(0), H = w.size(1);
  const int64_t hslices = (H + kTaskHidden - 1) / kTaskHidden;
  const int64_t dh_tasks = np / G * hslices;
  const int64_t dw_tasks = dw.defined() ? (nv + kTaskCols - 1) / kTaskCols : 0;
  const at::Tensor hb = h.narrow(0, r0, np);
  for_each_fixed_task(dh_tasks + dw_tasks, [&](int64_t t) {
    if (t < dh_tasks) {
      const int64_t s = t / hslices * G, c = t % hslices * kTaskHidden, nc = std::min(kTaskHidden, H - c);
      at::Tensor out = dh.narrow(0, r0 + s, G).narrow(1, c, nc);
      gemm_out(out, z.narrow(0, s, G), w.narrow(1, c, nc), true, dnnl);
    } else {
      const int64_t c = (t - dh_tasks) * kTaskCols, nc = std::min(kTaskCols, nv - c);
      at::Tensor out = dw.narrow(0, c, nc);
      gemm_out(out, z.narrow(1, c, nc).t(), hb, accumulate_dw, dnnl);
    }
  });
}

// A pass of the default mode over the vocabulary tiles of the rows h [Nr, H] (fp32, contiguous) in row blocks of
// R: the tile count, the threads and the GEMM route, and per thread a logits tile buffer (when `z_tiles`) and an
// fp32 weight tile buffer (when the weight is not fp32). for_each_block runs tile(r0, nr, hb, t, th, v0, nv, w)
// on every tile of each row block (the threads share out the tiles), then done(r0, nr) once they are all done.
struct TilePass {
  const at::Tensor& h;
  const at::Tensor& weight;
  const int64_t R, VB, ntiles, rmax;
  const int nthreads;
  const DnnlMatmul dnnl;
  std::vector<at::Tensor> zbuf, wbuf;

  TilePass(const at::Tensor& h_, const at::Tensor& weight_, int64_t R_, int64_t VB_, bool z_tiles)
      : h(h_), weight(weight_), R(R_), VB(VB_), ntiles((weight_.size(0) + VB_ - 1) / VB_),
        rmax(std::min(R_, h_.size(0))), nthreads(tile_threads(ntiles)), dnnl(dnnl_matmul()), zbuf(nthreads),
        wbuf(nthreads) {
    for (int th = 0; th < nthreads; ++th) {
      if (z_tiles) zbuf[th] = at::empty({rmax * VB}, h.options());
      if (weight.scalar_type() != at::kFloat) wbuf[th] = at::empty({VB, h.size(1)}, h.options());
    }
  }

  template <typename Tile, typename Done>
  void for_each_block(const Tile& tile, const Done& done) {
    const int64_t Nr = h.size(0), V = weight.size(0);
    for (int64_t r0 = 0; r0 < Nr; r0 += R) {
      const int64_t nr = std::min(R, Nr - r0);
      const at::Tensor hb = h.narrow(0, r0, nr);
      for_each_tile(ntiles, nthreads, [&](int64_t t, int th) {
        const int64_t v0 = t * VB, nv = std::min(VB, V - v0);
        tile(r0, nr, hb, t, th, v0, nv, weight_tile(weight, v0, nv, wbuf[th]));
      });
      done(r0, nr);
    }
  }
};

// Forward of the default mode over the rows h [Na, H] (fp32, contiguous): per-row statistics `st` and
// scaled label logits `label_x`; tiles v0 < save_cols are written straight into `saved`
// (tile v0 at offset v0 * N, row i at i * width).
void fast_forward(const at::Tensor& h, const at::Tensor& weight, const float* bp, const int64_t* yp, int64_t N,
                  int64_t R, int64_t VB, int64_t save_cols, at::Tensor& saved, bool return_entropy, float inv_t,
                  const Cap* cap, std::vector<RowStats>& st, std::vector<float>& label_x) {
  const int64_t V = weight.size(0);
  TilePass pass(h, weight, R, VB, save_cols < V);
  const int64_t ntiles = pass.ntiles;
  std::vector<RowStats> part(ntiles * pass.rmax);
  pass.for_each_block(
      [&](int64_t r0, int64_t nr, const at::Tensor& hb, int64_t t, int th, int64_t v0, int64_t nv,
          const at::Tensor& w) {
        at::Tensor z = v0 < save_cols ? saved.narrow(0, v0 * N + r0 * nv, nr * nv).view({nr, nv})
                                      : tile_view(pass.zbuf[th], nr, nv);
        gemm_out(z, hb, w.t(), false, pass.dnnl);
        const float* zp = z.data_ptr<float>();
        const float* btile = bp != nullptr ? bp + v0 : nullptr;
        for (int64_t i = 0; i < nr; ++i) {
          const float* zrow = zp + i * nv;
          RowStats rs;
          if (cap != nullptr) {
            fold_capped(rs, return_entropy, zrow, btile, nv, *cap);
            part[t * nr + i] = rs;
            const int64_t label = yp[r0 + i];
            if (label >= v0 && label < v0 + nv) label_x[r0 + i] = label_capped(zrow, btile, label - v0, *cap);
            continue;
          }
          if (return_entropy) {
            btile ? rs.fold<true, true>(zrow, btile, nv, inv_t) : rs.fold<true, false>(zrow, nullptr, nv, inv_t);
          } else {
            btile ? rs.fold<false, true>(zrow, btile, nv, inv_t) : rs.fold<false, false>(zrow, nullptr, nv, inv_t);
          }
          part[t * nr + i] = rs;
          const int64_t label = yp[r0 + i];
          if (label >= v0 && label < v0 + nv) {
            label_x[r0 + i] = btile ? scaled<true>(zrow, btile, label - v0, inv_t)
                                    : scaled<false>(zrow, nullptr, label - v0, inv_t);
          }
        }
      },
      [&](int64_t r0, int64_t nr) {
        at::parallel_for(0, nr, 64, [&](int64_t a, int64_t e) {
          for (int64_t i = a; i < e; ++i) {
            RowStats acc = part[i];
            for (int64_t t = 1; t < ntiles; ++t) acc.merge(part[t * nr + i]);
            st[r0 + i] = acc;
          }
        });
      });
}

// Backward of the default mode over the rows with gradient h [Ng, H] (fp32, contiguous). Row k of
// the saved tiles is srow[k]. Writes dh [Ng, H], dW (when defined) and adds into dB (when not null).
struct GradRows {
  const int64_t* y;
  const int64_t* srow;
  const float *g, *ge, *m, *ls, *ent;
};

void fast_backward(const at::Tensor& h, const at::Tensor& weight, const float* bp, const GradRows& rows, int64_t N,
                   int64_t R, int64_t VB, int64_t save_cols, const float* saved_p, float inv_t, const Cap* cap,
                   at::Tensor& dh, at::Tensor& dW, float* dB) {
  const int64_t H = h.size(1), V = weight.size(0);
  TilePass pass(h, weight, R, VB, true);
  const int64_t ntiles = pass.ntiles, rmax = pass.rmax;
  at::Tensor dpart = at::empty({ntiles, rmax, H}, h.options());  // dH of each tile, summed in tile order
  const bool has_ge = rows.ge != nullptr;
  pass.for_each_block(
      [&](int64_t r0, int64_t nr, const at::Tensor& hb, int64_t t, int th, int64_t v0, int64_t nv,
          const at::Tensor& w) {
        at::Tensor z = tile_view(pass.zbuf[th], nr, nv);
        const bool from_saved = v0 < save_cols;
        if (!from_saved) gemm_out(z, hb, w.t(), false, pass.dnnl);
        float* zp = z.data_ptr<float>();
        const float* btile = bp != nullptr ? bp + v0 : nullptr;
        for (int64_t i = 0; i < nr; ++i) {
          const int64_t k = r0 + i;
          float* zrow = zp + i * nv;
          const float* src = from_saved ? saved_p + v0 * N + rows.srow[k] * nv : zrow;
          const float gk = rows.g[k], gek = has_ge ? rows.ge[k] : 0.0f;
          const float mk = rows.m[k], lsk = rows.ls[k];
          const int64_t label = rows.y[k];
          if (cap != nullptr) {
            grad_capped(has_ge, src, btile, zrow, nv, label - v0, inv_t, mk, lsk, gk, gek, rows.ent[k], *cap);
          } else {
            if (has_ge) {
              btile ? softmax_grad<true, true>(src, btile, zrow, nv, inv_t, mk, lsk, gk, gek, rows.ent[k])
                    : softmax_grad<true, false>(src, nullptr, zrow, nv, inv_t, mk, lsk, gk, gek, rows.ent[k]);
            } else {
              btile ? softmax_grad<false, true>(src, btile, zrow, nv, inv_t, mk, lsk, gk, 0.0f, 0.0f)
                    : softmax_grad<false, false>(src, nullptr, zrow, nv, inv_t, mk, lsk, gk, 0.0f, 0.0f);
            }
            if (label >= v0 && label < v0 + nv) zrow[label - v0] += inv_t * gk;
          }
          if (dB != nullptr) {
            float* db = dB + v0;
  #pragma omp simd
            for (int64_t j = 0; j < nv; ++j) db[j] += zrow[j];
          }
        }
        if (dW.defined()) {
          at::Tensor dw = dW.narrow(0, v0, nv);
          gemm_out(dw, z.t(), hb, r0 > 0, pass.dnnl);
        }
        at::Tensor dp = dpart.select(0, t).narrow(0, 0, nr);
        gemm_out(dp, z, w, false, pass.dnnl);
      },
      [&](int64_t r0, int64_t nr) {
        const float* pp = dpart.data_ptr<float>();
        float* out = dh.data_ptr<float>() + r0 * H;
        const int64_t stride = rmax * H, count = nr * H;
        at::parallel_for(0, count, 4096, [&](int64_t a, int64_t e) {
    #pragma omp simd
          for (int64_t j = a; j < e; ++j) {
            float acc = pp[j];
            for (int64_t t = 1; t < ntiles; ++t) acc += pp[t * stride + j];
            out[j] = acc;
          }
        });
      });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_fwd(const at::Tensor& hidden, const at::Tensor& weight,
                                                          const c10::optional<at::Tensor>& bias,
                                                          const at::Tensor& labels,
                                                          const c10::optional<at::Tensor>& active, double temperature,
                                                          bool return_entropy, int64_t row_block, int64_t gemm_rows,
                                                          int64_t vocab_block, int64_t save_cols, double softcap) {
  check_linear_inputs(hidden, weight, bias, labels, active);
  const int64_t N = hidden.size(0), H = hidden.size(1), V = weight.size(0);
  const float inv_t = static_cast<float>(1.0 / temperature);
  const Cap cap_value = softcap > 0.0 ? Cap(softcap, temperature) : Cap();
  const Cap* cap = softcap > 0.0 ? &cap_value : nullptr;
  auto f32 = hidden.options().dtype(at::kFloat);
  at::Tensor logp = at::zeros({N}, f32), ent = at::zeros({N}, f32), stats = at::zeros({2, N}, f32);
  const int64_t VB = std::min(std::max<int64_t>(vocab_block, 1), V);
  TORCH_CHECK(save_cols >= 0 && save_cols <= V && (save_cols % VB == 0 || save_cols == V),
              "save_cols must be a multiple of vocab_block in [0, V], or V; got ", save_cols);
  at::Tensor saved = saved_logits_buffer(N * save_cols, f32);  // kept from step to step (logits_logprobs.cpp)
  float* saved_p = save_cols > 0 ? saved.data_ptr<float>() : nullptr;

  const bool all_rows = !active.has_value();
  const at::Tensor idx = all_rows ? at::Tensor() : at::nonzero(*active).flatten();
  const int64_t Na = all_rows ? N : idx.size(0);
  if (Na == 0) return {logp, ent, stats, saved};
  const RowBlocks rb(row_block, gemm_rows);
  const int64_t R = rb.R;
  const int64_t* idx_p = all_rows ? nullptr : idx.data_ptr<int64_t>();
  const at::Tensor h = padded_rows(hidden, idx, Na, rb.padded(Na));
  const at::Tensor y = (all_rows ? labels : labels.index_select(0, idx)).contiguous();
  const at::Tensor b = bias.has_value() ? kernel_bias(*bias, cap != nullptr) : at::Tensor();
  const int64_t* yp = y.data_ptr<int64_t>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;

  const bool direct = rb.G == 0;
  const DnnlMatmul dnnl = dnnl_matmul();
  at::Tensor zbuf = at::empty({direct ? 0 : std::min(R, rb.padded(Na)) * VB}, f32);
  at::Tensor wbuf = weight.scalar_type() == at::kFloat || direct ? at::Tensor() : at::empty({VB, H}, f32);
  std::vector<RowStats> st(Na);
  std::vector<float> label_x(Na, std::numeric_limits<float>::quiet_NaN());  // stays NaN: label not in [0, V)

  if (direct) {
    fast_forward(h, weight, bp, yp, N, R, VB, save_cols, saved, return_entropy, inv_t, cap, st, label_x);
  }
  for (int64_t r0 = 0; r0 < Na && !direct; r0 += R) {
    const int64_t nr = std::min(R, Na - r0);
    const int64_t np = rb.padded(nr);
    for (int64_t v0 = 0; v0 < V; v0 += VB) {
      const int64_t nv = std::min(VB, V - v0);
      const bool save = v0 < save_cols;
      at::Tensor z = tile_view(zbuf, np, nv);
      logits_tile(z, h, r0, np, weight_tile(weight, v0, nv, wbuf), rb.G, dnnl);
      const float* zp = z.data_ptr<float>();
      const float* btile = bp != nullptr ? bp + v0 : nullptr;
      at::parallel_for(0, nr, 4, [&](int64_t a, int64_t e) {
        for (int64_t i = a; i < e; ++i) {
          const float* zrow = zp + i * nv;
          RowStats& rs = st[r0 + i];
          const int64_t label = yp[r0 + i];
          if (cap != nullptr) {
            fold_capped(rs, return_entropy, zrow, btile, nv, *cap);
            if (label >= v0 && label < v0 + nv) label_x[r0 + i] = label_capped(zrow, btile, label - v0, *cap);
          } else {
            if (return_entropy) {
              btile ? rs.fold<true, true>(zrow, btile, nv, inv_t) : rs.fold<true, false>(zrow, nullptr, nv, inv_t);
            } else {
              btile ? rs.fold<false, true>(zrow, btile, nv, inv_t) : rs.fold<false, false>(zrow, nullptr, nv, inv_t);
            }
            if (label >= v0 && label < v0 + nv) {
              label_x[r0 + i] = btile ? scaled<true>(zrow, btile, label - v0, inv_t)
                                      : scaled<false>(zrow, nullptr, label - v0, inv_t);
            }
          }
          if (save) {  // keep the tile row (still in cache)
            std::memcpy(saved_p + v0 * N + (r0 + i) * nv, zrow, sizeof(float) * nv);
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
    int64_t save_cols, bool weight_grad, double softcap) {
  check_linear_inputs(hidden, weight, bias, labels, active);
  const int64_t N = hidden.size(0), H = hidden.size(1), V = weight.size(0);
  const float inv_t = static_cast<float>(1.0 / temperature);
  const Cap cap_value = softcap > 0.0 ? Cap(softcap, temperature) : Cap();
  const Cap* cap = softcap > 0.0 ? &cap_value : nullptr;
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
    const RowBlocks rb(row_block, gemm_rows);
    const int64_t R = rb.R;
    const int64_t Np = rb.padded(Ng);
    const at::Tensor h = padded_rows(hidden, idx, Ng, Np);
    const at::Tensor y = labels.index_select(0, idx).contiguous();
    const at::Tensor g = g_all.index_select(0, idx).contiguous();
    const at::Tensor ge = has_ge ? ge_all.index_select(0, idx).contiguous() : at::Tensor();
    const at::Tensor s32 = stats.to(at::kFloat);
    const at::Tensor mrow = s32.select(0, 0).index_select(0, idx).contiguous();
    const at::Tensor lsrow = s32.select(0, 1).index_select(0, idx).contiguous();
    const at::Tensor ent = entropy.reshape({N}).to(at::kFloat).index_select(0, idx).contiguous();
    const at::Tensor b = bias.has_value() ? kernel_bias(*bias, cap != nullptr) : at::Tensor();
    const int64_t* yp = y.data_ptr<int64_t>();
    // Row of each gradient row in the saved tiles: its rank among the active rows.
    const at::Tensor srow = (save_cols > 0 && active.has_value())
                                ? (at::cumsum(active->to(at::kLong), 0) - 1).index_select(0, idx).contiguous()
                                : idx;
    const int64_t* srow_p = srow.data_ptr<int64_t>();
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
    const bool direct = rb.G == 0;
    const DnnlMatmul dnnl = dnnl_matmul();
    at::Tensor zbuf = at::empty({direct ? 0 : std::min(R, Np) * VB}, f32);
    at::Tensor wbuf = weight.scalar_type() == at::kFloat || direct ? at::Tensor() : at::empty({VB, H}, f32);
    at::Tensor dh = direct ? at::empty({Np, H}, f32) : at::zeros({Np, H}, f32);
    if (direct) {
      const GradRows rows{yp, srow_p, gp, gep, mp, lsp, entp};
      at::Tensor dw_all = weight_grad ? dW : at::Tensor();
      fast_backward(h, weight, bp, rows, N, R, VB, save_cols, saved_p, inv_t, cap, dh, dw_all,
                    bias.has_value() ? dB.data_ptr<float>() : nullptr);
    }
    for (int64_t v0 = 0; v0 < V && !direct; v0 += VB) {
      const int64_t nv = std::min(VB, V - v0);
      const at::Tensor w = weight_tile(weight, v0, nv, wbuf);
      at::Tensor dw = weight_grad ? dW.narrow(0, v0, nv) : at::Tensor();
      const float* btile = bp != nullptr ? bp + v0 : nullptr;
      for (int64_t r0 = 0; r0 < Ng; r0 += R) {
        const int64_t nr = std::min(R, Ng - r0);
        const int64_t np = rb.padded(nr);
        at::Tensor z = tile_view(zbuf, np, nv);
        const bool from_saved = v0 < save_cols;
        if (!from_saved) logits_tile(z, h, r0, np, w, rb.G, dnnl);
        float* zp = z.data_ptr<float>();
        at::parallel_for(0, nr, 4, [&](int64_t a, int64_t e) {
          for (int64_t i = a; i < e; ++i) {
            const int64_t k = r0 + i;
            float* zrow = zp + i * nv;
            const float* src = from_saved ? saved_p + v0 * N + srow_p[k] * nv : zrow;
            const float gk = gp[k], gek = has_ge ? gep[k] : 0.0f;
            if (cap != nullptr) {
              grad_capped(has_ge, src, btile, zrow, nv, yp[k] - v0, inv_t, mp[k], lsp[k], gk, gek, entp[k], *cap);
              continue;
            }
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
        grad_tile(dh, dw, z, h, r0, np, w, rb.G, r0 > 0, dnnl);
        if (bias.has_value()) {  // column sums over the rows in row order (at::sum's order may follow the threads)
          float* db = dB.data_ptr<float>() + v0;
          at::parallel_for(0, nv, 256, [&](int64_t a, int64_t e) {
            for (int64_t i = 0; i < nr; ++i) {
              const float* zrow = zp + i * nv;
#pragma omp simd
              for (int64_t j = a; j < e; ++j) db[j] += zrow[j];
            }
          });
        }
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
