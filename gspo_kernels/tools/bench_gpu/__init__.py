"""``gspo-kernels bench --gpu``: the GPU measurements in one run, as ratios against plain PyTorch and the peers.

Sections, each in a fresh subprocess (a crash or a poisoned CUDA context stays in its section; each
case's figures are streamed back as they come, so a section stopped at its time limit keeps them):

* ``hidden``: N = 16 x 1024 tokens, H = 4096, V = 151936, bf16, GSPO sequence level (eps 3e-4 / 4e-4):
  the bare cuBLAS bf16 GEMM ceiling (8192^3, and ``hidden @ weight.T`` at the shape), then fwd + bwd of
  ``fused_linear_gspo_loss`` (one pass; all rows active, and half the responses at zero advantage),
  plain PyTorch (bf16 GEMM, fp32 ``log_softmax`` + gather, autograd, the same GSPO formula) on the same
  two inputs, TRL's ``ChunkedLogProbFunction`` + the GSPO formula, Cut Cross-Entropy's
  ``linear_cross_entropy`` (cross-entropy log-probs + the GSPO formula) and Liger's
  ``LigerFusedLinearGRPOLoss`` (eager; last, skipped when the time budget is short). For ours: the CUDA
  kernel total of one call (torch.profiler) against the event wall time, the host time to issue one call
  while the GPU is held busy by a spin kernel (a call that reads the device waits for the spin: reported as
  a host read), the synchronizing ops PyTorch flags (``torch.cuda.set_sync_debug_mode``), and the relative
  error of dH / dW against plain PyTorch's. Then the two-pass ``linear_logprobs`` forward (no grad, the old
  log-prob pass) against ``ChunkedLogProbFunction``'s forward.
* ``logits``: ``gspo_loss`` from bf16 logits ``[16, 1025, V]`` read through ``[:, :-1]``, at V = 151936 and
  50257: wall ms per fwd + bwd, the 3-pass floor (forward read + backward read + gradient write of
  ``N * V`` bf16 at the device-to-device copy bandwidth measured in the same section), the host work per
  call (issue time with the GPU held busy; and wall minus kernel time), plain PyTorch, Liger's
  ``triton_grpo_loss`` (sequence level, not in place).
* ``torch-backend``: ``backend="torch"`` on CUDA against plain PyTorch, both paths, at smaller shapes
  (logits ``[8, 1025, 151936]``; hidden N = 4096, H = 4096, V = 151936).
* ``trl-step``: ``benchmarks/trl_step.py`` at the client shape (Qwen3 architecture, 2 layers, hidden 2048,
  V = 151936 untied, bf16 autocast, 8 x 1024 completions after 64-token prompts), stock ``trl.GRPOTrainer``
  then the drop-in, each in a fresh process: ``_compute_loss`` + backward and the old-log-prob pass (medians
  of 3 after a warm-up), the step's peak memory, both losses. Needs trl and a source checkout.

Method: CUDA events around each step, median of 5 after 2 warm-ups (fewer for the slow peers: the JSON
says how many), gradients set to None before each step; peak extra = ``torch.cuda.max_memory_allocated``
above the allocation at the step's start (the gradients count), max over the timed steps;
``torch.cuda.empty_cache`` between cases. TFLOP/s on ``6 N H V`` whatever share of rows carries gradient.
Peers are optional: a missing one is listed as skipped with the reason. The whole run keeps to
``--budget-s`` (default 215 s): a section starts only with time left, slow optional cases
are skipped when their section's deadline is near.

Output: a table of ratios and of the targets (met / MISSED; ``plan.TARGETS``), ``<out>.json`` and ``<out>.md``
(``--out``, default ``results/bench_gpu``). Without CUDA: a message and exit status 2. ``--device cpu
--tiny`` (hidden) runs every code path on tiny shapes on the CPU: a smoke test, not a measurement.
"""

from __future__ import annotations

from .command import add_arguments, run
from .driver import run_section, run_trl_step
from .measure import profiled_busy
from .plan import SECTIONS, TARGETS, gspo_formula
from .report import add_ratios, evaluate_targets
from .sections import chunk_gemm_hidden_sizes, chunk_gemm_rows

__all__ = ["SECTIONS", "TARGETS", "add_arguments", "add_ratios", "chunk_gemm_hidden_sizes", "chunk_gemm_rows",
           "evaluate_targets", "gspo_formula", "profiled_busy", "run", "run_section", "run_trl_step"]
