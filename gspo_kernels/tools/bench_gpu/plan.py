"""What ``bench --gpu`` measures: its sections, shapes, time limits and targets; the GSPO formula the
peers are completed with."""

from __future__ import annotations

import os

from gspo_kernels.tools.peers import Skip  # noqa: F401  (a case that cannot run here)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # holds gspo_kernels/
RESULT = "BENCH-GPU-CASE "
SECTIONS = ("hidden", "logits", "trl-step", "torch-backend")
PEERS = ("trl", "liger", "cce")  # the optional peers (--peers, hidden)
DEFAULT_BUDGET_S = 215.0
GIB = float(2**30)

# The measured shapes, and tiny ones for the CPU smoke test (--tiny).
SHAPES = {
    False: dict(B=16, T=1024, H=4096, V=151936, V_small=50257, gemm=8192, copy_mib=4096,
                torch_logits=dict(B=8, T=1024, V=151936), torch_hidden=dict(B=4, T=1024, H=4096, V=151936)),
    True: dict(B=2, T=16, H=32, V=256, V_small=200, gemm=64, copy_mib=4,
               torch_logits=dict(B=2, T=8, V=128), torch_hidden=dict(B=2, T=8, H=16, V=128)),
}
# Seconds a section may take at most on an H100 (its own timeout), and the least it needs to be worth starting.
SECTION_LIMIT_S = {"hidden": 100.0, "logits": 45.0, "trl-step": 150.0, "torch-backend": 40.0}
SECTION_MIN_S = {"hidden": 40.0, "logits": 15.0, "trl-step": 45.0, "torch-backend": 10.0}

# The targets: (key, what is measured and its limit, limit); value <= limit is met.
TARGETS = (
    ("hidden_all", "hidden one-pass, all rows active: ours <= 0.80x plain PyTorch", 0.80),
    ("hidden_half", "hidden one-pass, half the responses at zero advantage: ours <= 0.55x plain PyTorch (same inputs)", 0.55),
    ("hidden_peak", "hidden one-pass peak extra memory (default budget, max of both cases) <= 8 GiB", 8.0),
    ("two_pass_fwd", "two-pass linear_logprobs forward <= 1.0x TRL ChunkedLogProbFunction forward", 1.0),
    ("trl_time", "TRL drop-in loss step time <= 0.85x stock TRL", 0.85),
    ("trl_peak", "TRL drop-in loss step peak memory <= 0.80x stock TRL", 0.80),
    ("logits_host", "logits path host work per call (time to issue it, GPU busy), V = 151936 <= 0.5 ms", 0.5),
    ("logits_host_small", "logits path host work per call (time to issue it, GPU busy), V = 50257 <= 0.5 ms", 0.5),
    ("logits_floor", "logits path: 3-pass floor / wall at V = 151936 >= 0.85 (shown as 0.85 / share <= 1)", 1.0),
    ("logits_floor_small", "logits path: 3-pass floor / wall at V = 50257 >= 0.75 (shown as 0.75 / share <= 1)", 1.0),
    ("torch_logits", "backend='torch' on CUDA, logits path <= 1.0x plain PyTorch", 1.0),
    ("torch_hidden", "backend='torch' on CUDA, hidden path <= 1.0x plain PyTorch", 1.0),
)


def gspo_formula(logp, old, advantages, mask, eps_low: float = 3e-4, eps_high: float = 4e-4):
    """GSPO (sequence level, ``"grpo"`` aggregation) in PyTorch on ``[B, T]`` fp32 log-probs, as TRL computes it:
    what plain PyTorch and the peers that give log-probs only are completed with (here and in bench.py, which
    imports it; this module does not import bench.py)."""
    import torch

    lengths = mask.sum(-1).clamp(min=1.0)
    seq_log_ratio = ((logp - old) * mask).sum(-1) / lengths
    w = torch.exp(seq_log_ratio)[:, None]
    a = advantages[:, None]
    per_token = -torch.min(w * a, torch.clamp(w, 1 - eps_low, 1 + eps_high) * a)
    return ((per_token * mask).sum(-1) / lengths).mean()

