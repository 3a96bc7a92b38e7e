// The gspo_kernels._C extension module: declares the torch.ops.gspo_kernels.* operator schemas.
// The CPU kernels register their implementations in logits_logprobs.cpp and linear_logprobs.cpp;
// gspo_kernels/backends/cpu.py registers the fake (meta) implementations and the autograd formulas.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(gspo_kernels, m) {
  // logits [N, V] or [B, T, V] (last stride 1), labels [N] int64, active [N] bool.
  // Returns logp [N] fp32, entropy [N] fp32 (zeros unless return_entropy), stats [2, N] fp32 (the
  // row max and log-sum-exp offset, saved for the backward). inplace_backward is only recorded for
  // the autograd formula. Labels outside [0, V) are not read: that row's logp is NaN. softcap > 0: the
  // logits are soft-capped, z -> softcap * tanh(z / softcap), before the temperature (0: no cap); the
  // backward ops take the same value. extra_position: logits is the [B, T + 1, V] base of a model's output
  // read as logits[:, :-1] (labels etc. have N = B * T); the ops read its first T positions and the
  // backward ops write the gradient of the whole base, zeros at position T.
  m.def(
      "logits_fwd(Tensor logits, Tensor labels, Tensor? active, float temperature, bool return_entropy, "
      "bool inplace_backward, float softcap=0., bool extra_position=False) -> (Tensor, Tensor, Tensor)");
  // Gradient of sum(grad_logp * logp + grad_entropy * entropy) w.r.t. logits, in logits' dtype.
  m.def(
      "logits_bwd(Tensor grad_logp, Tensor? grad_entropy, Tensor logits, Tensor labels, Tensor? active, "
      "Tensor stats, Tensor entropy, float temperature, float softcap=0., bool extra_position=False) -> Tensor");
  // Frees the gradient memory logits_bwd keeps from one call to the next (logits_logprobs.cpp).
  m.def("release_buffers() -> ()");
  // Same, written into logits' own storage.
  m.def(
      "logits_bwd_(Tensor(a!) logits, Tensor grad_logp, Tensor? grad_entropy, Tensor labels, Tensor? active, "
      "Tensor stats, Tensor entropy, float temperature, float softcap=0., bool extra_position=False) -> ()");
  // hidden [N, H], weight [V, H], bias [V]; logits = hidden @ weight.T + bias, never materialized in
  // full. The 4th output keeps the first save_cols vocabulary columns of the logits (without bias)
  // of the active rows for the backward: [N * save_cols] fp32, vocabulary tile v0 stored at offset
  // v0 * N as a contiguous [active rows, width] block, active rows in order (save_cols = 0: recompute
  // everything). gemm_rows > 0: row-dependent products run as GEMMs of exactly gemm_rows rows
  // (zero-padded), in chunks of row_block rows (rounded up to a multiple of gemm_rows): a row's
  // results do not depend on the batch. gemm_rows = 0: one GEMM per chunk of row_block rows, shaped by
  // its actual row count (faster, deterministic, not batch invariant).
  m.def(
      "linear_fwd(Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, Tensor? active, float temperature, "
      "bool return_entropy, int row_block, int gemm_rows, int vocab_block, int save_cols, float softcap=0.) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  // Returns (grad_hidden [N, H], grad_weight [V, H] fp32-accumulated (or [0, H] when not
  // weight_grad), grad_bias [V] (or [0] fp32 without a bias)).
  m.def(
      "linear_bwd(Tensor grad_logp, Tensor? grad_entropy, Tensor hidden, Tensor weight, Tensor? bias, "
      "Tensor labels, Tensor? active, Tensor stats, Tensor entropy, Tensor saved, float temperature, int row_block, "
      "int gemm_rows, int vocab_block, int save_cols, bool weight_grad, float softcap=0.) -> (Tensor, Tensor, Tensor)");
}

extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "gspo_kernels CPU operators", -1,
                                          nullptr};
  return PyModule_Create(&module_def);
}
