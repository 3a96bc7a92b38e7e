"""The compile matrix's cases: each public function called the way a compiled training step calls it.

A case is a function of fresh random tensors (drawn by :func:`draw`) that calls one public entry point and
returns one scalar (the loss, or a weighted sum of the per-token results), so that ``torch.compile(case,
fullgraph=True)`` of it, forward and backward, can be compared with the eager call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict

import torch

import gspo_kernels as gk
from gspo_kernels import GSPOConfig

B, T, V, H = 2, 5, 37, 8
LENGTHS = (4, 6)  # the packed responses (sum: N = B * T)


def draw(device: str, *, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Fresh inputs of every case, on ``device`` (fp32; labels in range; a mask with zeros)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    hidden, weight, bias = r(B, T, H), r(V, H) * 0.3, r(V) * 0.1
    labels = torch.randint(0, V, (B, T), generator=g)
    logits = hidden @ weight.T + bias
    lp = torch.log_softmax(logits.double(), -1).gather(-1, labels[..., None])[..., 0].float()
    old = (lp + 0.02 * r(B, T)).detach()
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    mask[:, 0] = 1.0
    t = dict(hidden=hidden, weight=weight, bias=bias, labels=labels, logits=logits.detach(), old=old,
             ref=(lp + 0.05 * r(B, T)).detach(), rollout=(old + 0.01 * r(B, T)).detach(), adv=r(B), adv_tok=r(B, T),
             mask=mask, logprobs=lp.detach(), entropy=r(B, T).abs(),
             cu=torch.tensor([0, LENGTHS[0], sum(LENGTHS)], dtype=torch.int32), adv_packed=r(len(LENGTHS)))
    return {k: v.to(device) for k, v in t.items()}


# The configurations the matrix runs (a GSPO sequence-level loss; GRPO token-level dapo with KL and entropy; the
# soft cap with a temperature; rollout correction).
GSPO = GSPOConfig()
GRPO_DAPO_KL = GSPOConfig(importance_sampling_level="token", loss_type="dapo", beta=0.04, entropy_coef=0.01)
SOFTCAP = GSPOConfig(final_logit_softcapping=3.0, temperature=0.7)
ROLLOUT = GSPOConfig(importance_sampling_level="token", loss_type="bnpo", rollout_correction="token_truncate")


@dataclass(frozen=True)
class Case:
    """One public call: ``grads`` names the tensors it differentiates; ``call(t, backend, **grad tensors)``."""

    name: str
    grads: tuple
    call: Callable


def _sum_of(out) -> torch.Tensor:
    """A scalar of the per-token results that every output reaches (weights fixed, so the gradient is not flat)."""
    outs = out if isinstance(out, tuple) else (out,)
    total = 0
    for i, o in enumerate(outs):
        w = torch.linspace(0.5, 1.5, o.numel(), device=o.device, dtype=o.dtype).reshape(o.shape)
        total = total + (o * w).sum() * (1.0 if i == 0 else 0.3)
    return total


def _gspo(t, backend, logits):
    return gk.gspo_loss(logits, t["labels"], t["adv"], t["old"], mask=t["mask"], config=GSPO, backend=backend).loss


def _grpo_packed(t, backend, logits):
    n = B * T
    return gk.gspo_loss(logits.reshape(n, V), t["labels"].reshape(n), t["adv_packed"], t["old"].reshape(n),
                        cu_seqlens=t["cu"], ref_logprobs=t["ref"].reshape(n), num_items_in_batch=7,
                        config=GRPO_DAPO_KL, backend=backend).loss


def _softcap(t, backend, logits):
    return gk.GSPOLoss(SOFTCAP, backend=backend)(logits, t["labels"], t["adv"], t["old"], mask=t["mask"]).loss


def _linear_gspo(t, backend, hidden, weight):
    return gk.fused_linear_gspo_loss(hidden, weight, t["labels"], t["adv"], t["old"], mask=t["mask"], config=GSPO,
                                     backend=backend).loss


def _linear_grpo(t, backend, hidden, weight, bias):
    return gk.fused_linear_gspo_loss(hidden, weight, t["labels"], t["adv_tok"], t["old"], bias=bias, mask=t["mask"],
                                     ref_logprobs=t["ref"], num_items_in_batch=7, config=GRPO_DAPO_KL,
                                     backend=backend).loss


def _linear_rollout(t, backend, hidden, weight):
    module = gk.FusedLinearGSPOLoss(ROLLOUT, backend=backend)
    return module(hidden, weight, t["labels"], t["adv"], t["old"], mask=t["mask"],
                  rollout_logprobs=t["rollout"]).loss


def _linear_softcap_packed(t, backend, hidden, weight):
    n = B * T
    return gk.fused_linear_gspo_loss(hidden.reshape(n, H), weight, t["labels"].reshape(n), t["adv_packed"],
                                     t["old"].reshape(n), cu_seqlens=t["cu"], config=SOFTCAP, backend=backend).loss


def _token_logprobs(t, backend, logits):
    return _sum_of(gk.token_logprobs(logits, t["labels"], temperature=0.8, return_entropy=True, backend=backend))


def _linear_logprobs(t, backend, hidden, weight, bias):
    return _sum_of(gk.linear_logprobs(hidden, weight, t["labels"], bias=bias, return_entropy=True,
                                      final_logit_softcapping=4.0, backend=backend))


def _invariant_logprobs(t, backend, hidden, weight, bias):
    return _sum_of(gk.linear_logprobs(hidden, weight, t["labels"], bias=bias, return_entropy=True, temperature=0.8,
                                      final_logit_softcapping=4.0, backend=backend, batch_invariant=True))


def _invariant_gspo(t, backend, hidden, weight):
    return gk.fused_linear_gspo_loss(hidden, weight, t["labels"], t["adv"], t["old"], mask=t["mask"], config=GSPO,
                                     backend=backend, batch_invariant=True).loss


def _invariant_grpo(t, backend, hidden, weight, bias):
    module = gk.FusedLinearGSPOLoss(GRPO_DAPO_KL, backend=backend, batch_invariant=True)
    return module(hidden, weight, t["labels"], t["adv_tok"], t["old"], bias=bias, mask=t["mask"],
                  ref_logprobs=t["ref"], num_items_in_batch=7).loss


def _policy(t, backend, logprobs, entropy):
    return gk.policy_loss(logprobs, t["adv_tok"], t["old"], mask=t["mask"], ref_logprobs=t["ref"], entropy=entropy,
                          num_items_in_batch=7, config=GRPO_DAPO_KL, backend=backend).loss


CASES = [
    Case("gspo_loss-gspo-mask", ("logits",), _gspo),
    Case("gspo_loss-grpo-dapo-kl-packed", ("logits",), _grpo_packed),
    Case("GSPOLoss-softcap", ("logits",), _softcap),
    Case("fused_linear-gspo-mask", ("hidden", "weight"), _linear_gspo),
    Case("fused_linear-grpo-dapo-kl-bias", ("hidden", "weight", "bias"), _linear_grpo),
    Case("FusedLinearGSPOLoss-rollout", ("hidden", "weight"), _linear_rollout),
    Case("fused_linear-softcap-packed", ("hidden", "weight"), _linear_softcap_packed),
    Case("token_logprobs-entropy", ("logits",), _token_logprobs),
    Case("linear_logprobs-entropy-softcap", ("hidden", "weight", "bias"), _linear_logprobs),
    Case("policy_loss-grpo-dapo-kl-entropy", ("logprobs", "entropy"), _policy),
]

# batch_invariant=True (the backends that have it: triton, cpu): per-token with a bias, an entropy gradient, a
# temperature and the soft cap; the loss with a mask (rows not active); the module with a bias and GRPO's KL and
# entropy terms.
INVARIANT_BACKENDS = ("triton", "cpu")
INVARIANT_CASES = [
    Case("linear_logprobs-invariant-entropy-softcap", ("hidden", "weight", "bias"), _invariant_logprobs),
    Case("fused_linear-invariant-gspo-mask", ("hidden", "weight"), _invariant_gspo),
    Case("FusedLinearGSPOLoss-invariant-grpo-dapo-kl-bias", ("hidden", "weight", "bias"), _invariant_grpo),
]


def run(case: Case, t: Dict[str, torch.Tensor], backend: str, fn=None):
    """``(value, *grads)`` of ``case`` on ``t`` (``fn``: the case's call, or a compiled form of it)."""
    fn = fn or case.call
    leaves = {k: t[k].clone().requires_grad_() for k in case.grads}
    out = fn(t, backend, **leaves)
    grads = torch.autograd.grad(out, list(leaves.values()))
    return (out.detach(), *grads)
