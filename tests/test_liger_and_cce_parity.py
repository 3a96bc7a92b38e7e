"""Value parity with two more peers, each imported and run here (``make test`` installs both: a missing one is a
collection error, never a skip):

- **Liger** 0.8.5's chunked GRPO loss, ``liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss`` (eager,
  ``compiled=False``; its loss math is the same code compiled or not), against ``fused_linear_gspo_loss`` on the same
  hidden states, lm_head, bias and loss inputs (the responses of ``tests/support.make_case``, padded: Liger has no
  packed layout): the loss, the gradients of the hidden states, the weight and the bias, and the metrics both
  report (its clip ratio at the token level, its KL), for every option the two share: the ``token`` and
  ``sequence`` levels (Liger has no ``sequence_token``), the aggregations, ``delta``, the KL with and without the
  bias correction, temperature, ``num_items_in_batch``, a per-token importance-sampling ratio, CISPO, SAPO, VESPO,
  LUSPO.
- **Cut Cross-Entropy** 25.1.1's PyTorch path (``linear_cross_entropy(..., impl="torch_compile", reduction="none")``)
  against ``linear_logprobs``: where their math overlaps, the per-token log-probs of a hidden-state head (its
  per-token cross-entropy with the sign flipped), with and without its logit soft cap, and the gradients of the
  hidden states and the weight. Its ``cce`` implementation is CUDA-only; its ``torch_compile`` one is run with the
  ``torch.compile`` wrappers of its two functions removed (inductor takes 20 s per shape on this CPU; the functions
  are the same).

Tolerances: both sides are fp32, each within 1e-5 (relative) of the float64 reference on these inputs (ours: the
conformance tests), so within 2e-5 of each other.
"""

from __future__ import annotations

import math

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels import reference
from tests.support import CASE_LENGTHS, CASE_T, RTOL, assert_case_covers, make_case, rel_err
from tests.test_conformance import _device, backend  # noqa: F401  (the backend fixture, small tiles included)

TOL = 2 * RTOL
C = gk.GSPOConfig
LIGER_CONFIGS = [
    C(importance_sampling_level="sequence", loss_type="grpo"),  # GSPO
    C(importance_sampling_level="token", loss_type="bnpo", beta=0.04, temperature=0.7),
    C(importance_sampling_level="token", loss_type="dapo", delta=1.0002),
    C(importance_sampling_level="sequence", loss_type="dr_grpo", max_completion_length=9, beta=0.04,
      use_bias_correction_kl=True),
    C(importance_sampling_level="token", loss_type="cispo", epsilon_high=1.0001),
    C(importance_sampling_level="token", loss_type="sapo", beta=0.04),
    C(importance_sampling_level="token", loss_type="vespo"),
    C(importance_sampling_level="sequence", loss_type="luspo"),
]
WITH_IS_RATIO = ("dapo", "vespo")  # a per-token ratio (VESPO folds it into its weight)


def _liger_case(config, V=75, H=24):
    """Hidden states ``[S, T, H]``, a head with a bias, and :func:`make_case`'s padded inputs (labels in the
    vocabulary everywhere: Liger gathers every position, masked ones included)."""
    hidden, weight, bias = torch.randn(len(CASE_LENGTHS), CASE_T, H), torch.randn(V, H) * 0.3, torch.randn(V) * 0.1
    case = make_case(lambda y: reference.linear_logprobs(hidden[:, : y.shape[1]], weight, y, bias=bias,
                                                         temperature=config.temperature), V, packed=False)
    assert hidden.shape[:2] == case.labels.shape
    labels = case.labels.clamp(min=0)
    is_ratio = None
    if config.loss_type in WITH_IS_RATIO:
        is_ratio = torch.where(case.mask > 0, 0.9 + 0.2 * torch.rand(case.mask.shape), 1.0)
    return hidden, weight, bias, labels, case, is_ratio


@pytest.mark.parametrize("config", LIGER_CONFIGS, ids=lambda c: f"{c.importance_sampling_level}-{c.loss_type}")
def test_fused_linear_loss_matches_liger_grpo_loss(config, case_seed):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    hidden, weight, bias, labels, case, is_ratio = _liger_case(config)
    num_items = 37.0 if config.loss_type == "dapo" else None
    liger = LigerFusedLinearGRPOLoss(
        beta=config.beta, compiled=False, use_ref_model=config.beta != 0, chunk_size=2,
        epsilon_low=config.epsilon_low, epsilon_high=config.epsilon_high, loss_type=config.loss_type,
        max_completion_length=config.max_completion_length,
        importance_sampling_level=config.importance_sampling_level, temperature=config.temperature,
        delta=config.delta, use_bias_correction_kl=config.use_bias_correction_kl)
    theirs_leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    their_loss, their_metrics = liger(
        theirs_leaves[0], theirs_leaves[1], labels, case.mask, case.advantages, bias=theirs_leaves[2],
        ref_per_token_logps=case.ref_logprobs if config.beta != 0 else None, old_per_token_logps=case.old_logprobs,
        vllm_is_ratio=is_ratio, num_items_in_batch=None if num_items is None else torch.tensor(num_items))
    their_grads = torch.autograd.grad(their_loss, theirs_leaves)

    ours_leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    ours = gk.fused_linear_gspo_loss(ours_leaves[0], ours_leaves[1], labels, case.advantages, case.old_logprobs,
                                     bias=ours_leaves[2], mask=case.mask, is_ratio=is_ratio, config=config,
                                     ref_logprobs=case.ref_logprobs if config.beta != 0 else None,
                                     num_items_in_batch=num_items, backend="torch")
    our_grads = torch.autograd.grad(ours.loss, ours_leaves)
    assert_case_covers(config, case, ours.metrics)

    scale = math.log(75) if config.loss_type in ("cispo", "vespo") else 1.0  # terms of size |A log pi|
    assert abs(ours.loss.item() - their_loss.item()) <= TOL * max(abs(their_loss.item()), scale)
    for name, got, want in zip(("hidden", "weight", "bias"), our_grads, their_grads):
        assert rel_err(got, want) <= TOL, name
    their_metrics = list(their_metrics)
    if config.beta != 0:
        assert abs(float(ours.metrics["kl"]) - float(their_metrics.pop(0))) <= TOL
    clip = ours.metrics.get("cispo_clip_ratio", ours.metrics.get("clip_ratio/region_mean"))
    if clip is not None and config.importance_sampling_level == "token":  # Liger counts tokens at both levels
        assert float(their_metrics[0]) > 0 and float(clip) == pytest.approx(float(their_metrics[0]), abs=1e-6)


@pytest.mark.parametrize("softcap", [None, 2.0], ids=["plain", "softcap"])
def test_linear_logprobs_match_cut_cross_entropy_torch_path(backend, softcap, monkeypatch):  # noqa: F811
    import cut_cross_entropy.torch_compile as cce_torch
    from cut_cross_entropy import linear_cross_entropy

    for name in ("torch_compile_linear_cross_entropy_apply", "softcapping"):  # its two torch.compile'd functions
        monkeypatch.setattr(cce_torch, name, getattr(cce_torch, name).__wrapped__)
    dev = _device(backend)
    B, T, V, H = 3, 7, 97, 16
    hidden, weight = torch.randn(B, T, H), torch.randn(V, H) * 0.4
    labels = torch.randint(0, V, (B, T))
    labels[1, 4:] = -100  # ignored by both (masked for us)
    active = labels >= 0
    g = torch.randn(B, T)

    theirs_leaves = [t.clone().requires_grad_() for t in (hidden, weight)]
    ce = linear_cross_entropy(theirs_leaves[0], theirs_leaves[1], labels, softcap=softcap, reduction="none",
                              impl="torch_compile")
    their_logp = -ce
    their_grads = torch.autograd.grad((their_logp * g * active).sum(), theirs_leaves)

    ours_leaves = [t.clone().to(dev).requires_grad_() for t in (hidden, weight)]
    logp = gk.linear_logprobs(ours_leaves[0], ours_leaves[1], labels.clamp(min=0).to(dev),
                              final_logit_softcapping=softcap, backend=backend)
    our_grads = [x.cpu() for x in torch.autograd.grad((logp * (g * active).to(dev)).sum(), ours_leaves)]
    assert rel_err(logp.cpu()[active], their_logp.detach()[active]) <= TOL
    for name, got, want in zip(("hidden", "weight"), our_grads, their_grads):
        assert rel_err(got, want) <= TOL, name
