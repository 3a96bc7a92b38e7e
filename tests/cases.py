"""Random loss inputs shared by the backend tests (fresh per call; seeded by conftest)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import torch

from gspo_kernels import GSPOConfig

LEVELS = ("sequence", "sequence_token", "token")
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


@dataclass
class Case:
    labels: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    is_ratio: torch.Tensor
    mask: Optional[torch.Tensor]
    cu_seqlens: Optional[torch.Tensor]
    vocab: int

    def kwargs(self, with_ref: bool = True) -> dict:
        kw = dict(mask=self.mask, cu_seqlens=self.cu_seqlens, is_ratio=self.is_ratio)
        if with_ref:
            kw["ref_logprobs"] = self.ref_logprobs
        return kw


def make_case(logp_of, vocab: int, *, packed: bool, lengths=(5, 1, 0, 7), pad_to: int = 8,
              per_token_adv: bool = False, spread: float = 3e-4) -> Case:
    """Inputs whose old log-probs sit within ``spread`` of the policy's, so some responses clip.

    ``logp_of(labels)`` gives the current policy's per-token log-probs (float64) for the labels.
    Includes a length-1 and an empty response; in the padded layout the mask also covers padding.
    """
    S = len(lengths)
    if packed:
        N = sum(lengths)
        labels = torch.randint(0, vocab, (N,))
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        mask = (torch.rand(N) > 0.15).to(torch.float32)
        token_shape = (N,)
    else:
        labels = torch.randint(0, vocab, (S, pad_to))
        cu = None
        mask = (torch.arange(pad_to)[None, :] < torch.tensor(lengths)[:, None]).to(torch.float32)
        labels[mask == 0] = -100  # padding labels outside the vocabulary must be ignored
        token_shape = (S, pad_to)
    current = logp_of(labels.clamp(min=0))
    seq_shift = torch.randn(S) * spread
    if packed:
        shift = seq_shift.repeat_interleave(torch.tensor(lengths))
    else:
        shift = seq_shift[:, None].expand(token_shape)
    old = (current - shift - torch.randn(token_shape) * spread * 0.5).float()
    adv = torch.randn(token_shape if per_token_adv else (S,))
    adv[..., 0] = 0.0  # a zero advantage
    # 0.3 apart: the KL gradient (1 - e^d) stays well above the fp32 rounding of logp
    ref = (current + torch.randn(token_shape) * 0.3).float()
    is_ratio = (1 + 0.1 * torch.rand(token_shape)).float()
    return Case(labels, adv, old, ref, is_ratio, mask, cu, vocab)


def configs(levels=LEVELS, loss_types=LOSS_TYPES):
    """Every level x loss type, each with a different mix of the optional terms."""
    out = []
    for i, (level, loss_type) in enumerate(itertools.product(levels, loss_types)):
        out.append(GSPOConfig(
            importance_sampling_level=level,
            loss_type=loss_type,
            max_completion_length=9,
            beta=0.04 if i % 2 == 0 else 0.0,
            use_bias_correction_kl=i % 4 == 0,
            delta=1.0002 if i % 3 == 0 else None,
            temperature=0.7 if i % 5 == 0 else 1.0,
            entropy_coef=0.01 if i % 3 == 1 else 0.0,
        ))
    return out


RTOL = 1e-5
LENGTHS = (5, 1, 0, 7)  # includes a length-1 and an empty response


def rel_err(a, b) -> float:
    """Largest absolute difference relative to the largest reference entry."""
    a, b = a.detach().double(), b.detach().double()
    if b.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def check_against_reference(out, expected, grads, ref_grads, rtol: float = RTOL) -> None:
    """Loss (relative to max(|loss|, 1): it sums terms of either sign), metrics and gradients."""
    assert torch.isfinite(out.loss)
    loss_err = abs(out.loss.item() - expected.loss.item()) / max(abs(expected.loss.item()), 1.0)
    assert loss_err < rtol, (out.loss.item(), expected.loss.item())
    assert set(out.metrics) == set(expected.metrics)
    for name, value in expected.metrics.items():
        assert abs(float(out.metrics[name]) - float(value)) <= rtol * max(1.0, abs(float(value))), name
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < rtol


def logits_loss_vs_reference(backend: str, config, packed: bool, V: int = 97):
    """``gspo_loss(backend=...)`` and the float64 oracle on one fresh case: ``(out, expected, [grad], [ref])``."""
    import gspo_kernels as gk
    from gspo_kernels import reference

    shape = (sum(LENGTHS), V) if packed else (len(LENGTHS), 8, V)
    logits = torch.randn(*shape) * 2
    case = make_case(lambda y: reference.token_logprobs(logits.double(), y, temperature=config.temperature), V,
                     packed=packed, lengths=LENGTHS)
    x = logits.clone().requires_grad_()
    out = gk.gspo_loss(x, case.labels, case.advantages, case.old_logprobs, config=config, backend=backend,
                       **case.kwargs(config.beta > 0))
    grads = torch.autograd.grad(out.loss, (x,))
    x64 = logits.double().requires_grad_()
    expected = reference.gspo_loss(x64, case.labels, case.advantages, case.old_logprobs, config=config,
                                   **case.kwargs(config.beta > 0))
    return out, expected, grads, torch.autograd.grad(expected.loss, (x64,))


def linear_loss_vs_reference(backend: str, config, packed: bool, V: int = 75, H: int = 24):
    """``fused_linear_gspo_loss(backend=...)`` (with a bias) and the float64 oracle: grads of (hidden, W, b)."""
    import gspo_kernels as gk
    from gspo_kernels import reference

    tokens = (sum(LENGTHS),) if packed else (len(LENGTHS), 8)
    hidden, weight, bias = torch.randn(*tokens, H), torch.randn(V, H) * 0.3, torch.randn(V) * 0.1
    case = make_case(
        lambda y: reference.linear_logprobs(hidden, weight, y, bias=bias, temperature=config.temperature), V,
        packed=packed, lengths=LENGTHS,
    )
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    out = gk.fused_linear_gspo_loss(h, w, case.labels, case.advantages, case.old_logprobs, bias=b, config=config,
                                    backend=backend, **case.kwargs(config.beta > 0))
    grads = torch.autograd.grad(out.loss, (h, w, b))
    h64, w64, b64 = (t.double().requires_grad_() for t in (hidden, weight, bias))
    expected = reference.fused_linear_gspo_loss(h64, w64, case.labels, case.advantages, case.old_logprobs, bias=b64,
                                                config=config, **case.kwargs(config.beta > 0))
    return out, expected, grads, torch.autograd.grad(expected.loss, (h64, w64, b64))


def assert_zero_rows_get_zero_dh(config, grads, ref_grads) -> None:
    """Rows that carry no gradient (masked, clipped, zero advantage) get exactly zero dH."""
    if config.beta == 0 and config.entropy_coef == 0:
        H = ref_grads[0].shape[-1]
        zero_rows = ref_grads[0].reshape(-1, H).abs().amax(dim=1) == 0
        assert bool(zero_rows.any())
        assert torch.all(grads[0].reshape(-1, H)[zero_rows] == 0)


def assert_bf16_no_worse_than_plain_bf16(backend: str, path: str) -> None:
    """bf16 inputs: error vs float64 no worse than the plain bf16 PyTorch path's, plus 2^-8.

    The plain path is ``log_softmax`` + ``gather`` in bf16, then the same objective in fp32. On the
    hidden-state path the compared gradient is dH (the reference's and the plain path's logits
    gradients are mapped through ``@ W``).
    """
    import gspo_kernels as gk
    from gspo_kernels import reference
    from gspo_kernels.objective import gspo_objective
    from gspo_kernels.validation import prepare_loss_inputs

    torch.manual_seed(7)
    B, T, V, H = 4, 16, 1000, 64
    if path == "logits":
        logits16 = (torch.randn(B, T, V) * 3).bfloat16()
        base = logits16.double()
    else:
        hidden16, weight16 = torch.randn(B, T, H).bfloat16(), (torch.randn(V, H) * 0.2).bfloat16()
        base = hidden16.double() @ weight16.double().T
    labels = torch.randint(0, V, (B, T))
    old = (reference.token_logprobs(base, labels) - torch.randn(B, 1) * 2e-4).float()
    adv = torch.randn(B)
    cfg = gk.GSPOConfig()
    x64 = base.clone().requires_grad_()
    expected = reference.gspo_loss(x64, labels, adv, old, config=cfg)
    (ref_grad,) = torch.autograd.grad(expected.loss, x64)
    plain_in = base.bfloat16().requires_grad_()
    plain_logp = plain_in.log_softmax(-1).gather(-1, labels[..., None])[..., 0].float()
    plain = gspo_objective(plain_logp.reshape(-1), None, prepare_loss_inputs(labels, adv, V, old_logprobs=old), cfg)
    (plain_grad,) = torch.autograd.grad(plain.loss, plain_in)
    if path == "logits":
        x = logits16.clone().requires_grad_()
        out = gk.gspo_loss(x, labels, adv, old, config=cfg, backend=backend)
        (grad,) = torch.autograd.grad(out.loss, x)
    else:
        h, w = hidden16.clone().requires_grad_(), weight16.clone().requires_grad_()
        out = gk.fused_linear_gspo_loss(h, w, labels, adv, old, config=cfg, backend=backend)
        (grad,) = torch.autograd.grad(out.loss, h)
        ref_grad = ref_grad @ weight16.double()  # dH = dZ @ W
        plain_grad = plain_grad.double() @ weight16.double()
    margin = 2**-8 * abs(expected.loss.item())
    assert abs(out.loss.item() - expected.loss.item()) <= abs(plain.loss.item() - expected.loss.item()) + margin
    assert rel_err(grad, ref_grad) <= rel_err(plain_grad, ref_grad) + 2**-8
