"""``backend="torch"``: the portable chunked heavy stage (any device), and the blueprint of the others.

fp32 math (fp64 for fp64 inputs); no ``[N, V]`` fp32 intermediate exists.
Logits path: blocks of whole rows through ATen's fused ``log_softmax`` / ``softmax`` kernels into two
scratch blocks: forward 1 fused pass + 3 for the entropy; backward 2 passes (5 when the entropy carries
gradient), writing the gradient directly. Block size: on CPU about ``LOGITS_BLOCK_ELEMENTS`` elements; on an
accelerator (CUDA) the scratch blocks fill ``DEFAULT_MEMORY_BUDGET`` (bf16 [16384, 151936] logits: 32 blocks,
~15 kernels each, where 55-row blocks made 304). Rows to compute (the forward's ``active``, the backward's rows
with gradient) are read to the host once per call, never per block; no op sorts (``scatter_add``, not
``index_put(accumulate=True)``); ``tests/backends/torch/test_torch_backend_launches.py`` counts both.
On an accelerator (CUDA) the logits path's forward is max(dim=1) + one softmax + entr + sum (log p_y from the max's
column, :func:`_rows_forward_accelerated`) and a ``[B, T + 1, V]`` base read as ``[:, :-1]`` takes its gradient
directly; fp16/bf16 rows that no softmax kernel reads into fp32 (bf16 on CUDA) get their gradient from a softmax in
their own dtype written into it (:func:`_rows_backward_direct`). The hidden-state path there: row chunks sized from
``memory_budget``, one GEMM per chunk with fp32 output, no vocabulary tiles, dZ cast once, dW in one fp32
accumulator, one host read per call (:func:`_linear_forward_accelerated`, :func:`_linear_backward_accelerated`);
when ``p`` of all rows takes no more bytes than that accumulator, the forward keeps it and the backward makes no
logits GEMM (:func:`_keeps_probabilities`, :func:`_linear_backward_kept`).
``benchmarks/count_torch_backend.py`` counts the accelerator route's ops, bytes and GEMM FLOPs on CPU tensors.
Hidden-state path on CPU: rows x vocabulary tiles, an online softmax (running max ``m``,
``s = sum e^(x-m)``, ``a = sum e^(x-m)(x-m)``) with the label's logit and the entropy folded in;
one ``[rows, vocab_block]`` logits tile exists at a time.
Both keep the row max and ``log s`` apart (never one fp32 ``lse = m + log s``): log-probs and the
entropy come from shifted logits, so logits offset by 1e4 or divided by a temperature of 1e-6 keep
fp32 accuracy. Backward: recomputes from the logits (or tiles from the saved ``(m, log s)``),
accumulates in fp32, and visits only the rows whose incoming gradient (of log-prob or entropy) is
non-zero; the others get exactly zero gradient. ``-inf`` logits on non-label columns give ``p = 0`` and a zero gradient (never NaN).
Labels outside ``[0, V)`` are never read (possible only when the public checks are skipped, under
``torch.compile``): that row's log-prob is NaN.
Soft cap ``c`` (``softcap=``): the scaled logits are ``x = c tanh(z / c) / tau`` (a scratch tile), the bias is
not shifted, and each tile's gradient is multiplied by ``sech^2(z / c)`` (from ``cosh``, accurate where
``tanh`` saturates and ``1 - tanh^2`` would cancel); the uncapped path runs exactly the code it ran before.
"""

from __future__ import annotations

from gspo_kernels.backends.contract import Backend
from gspo_kernels.backends.torch.linear import linear_logprobs
from gspo_kernels.backends.torch.logits import logits_logprobs

__all__ = ["linear_logprobs", "logits_logprobs", "make_backend"]


def make_backend() -> Backend:
    return Backend("torch", logits_logprobs, linear_logprobs)
