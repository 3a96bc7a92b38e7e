"""The mixed-precision policy (gspo_kernels.precision), on every backend available here, both paths.

Each case is checked against the float64 reference computed from the operands *rounded to the dtype
the policy prescribes*; the same outputs are also shown to be far (more than 10x the tolerance) from
the reference of the other plausible reading (unrounded fp32 operands, or rounded when fp32 was asked),
so a backend that ignored the policy would fail.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from gspo_kernels import GSPOConfig, available_backends, fused_linear_gspo_loss, linear_logprobs, reference
from gspo_kernels.precision import apply_precision, operand_dtype

BACKENDS = available_backends("cpu")
N, H, V = 12, 48, 80
TOL = 2e-5  # fp32 accumulation of H=48 products of rounded operands, logits of std ~3


def _inputs(hidden_dtype, weight_dtype, bias=True):
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(N, H, generator=g).to(hidden_dtype)
    weight = (torch.randn(V, H, generator=g) * 0.45).to(weight_dtype)  # logits with std ~3, like a trained head
    b = (torch.randn(V, generator=g) * 0.5).to(weight_dtype) if bias else None
    labels = torch.randint(0, V, (N,), generator=g)
    return hidden, weight, b, labels


def _ref(hidden, weight, bias, labels, dtype):
    """float64 reference of the operands rounded to ``dtype``."""
    def r(x):
        return None if x is None else x.to(dtype).double()
    return reference.linear_logprobs(r(hidden), r(weight), labels, bias=r(bias), return_entropy=True)


# (name, hidden dtype, weight dtype, autocast dtype or None, fp32_head, operand dtype, other reading)
CASES = [
    ("autocast-bf16-fp32-inputs", torch.float32, torch.float32, torch.bfloat16, False, torch.bfloat16, torch.float32),
    ("autocast-fp16-fp32-inputs", torch.float32, torch.float32, torch.float16, False, torch.float16, torch.float32),
    ("autocast-bf16-bf16-hidden", torch.bfloat16, torch.float32, torch.bfloat16, False, torch.bfloat16, torch.float32),
    ("mixed-fp32-hidden-bf16-weight", torch.float32, torch.bfloat16, None, False, torch.bfloat16, torch.float32),
    ("mixed-bf16-hidden-fp32-weight", torch.bfloat16, torch.float32, None, False, torch.bfloat16, torch.float32),
    ("mixed-fp16-hidden-fp32-weight", torch.float16, torch.float32, None, False, torch.float16, torch.float32),
    ("plain-bf16", torch.bfloat16, torch.bfloat16, None, False, torch.bfloat16, None),
    ("fp32-head-under-autocast", torch.float32, torch.float32, torch.bfloat16, True, torch.float32, torch.bfloat16),
    ("fp32-head-mixed", torch.float32, torch.bfloat16, None, True, torch.float32, None),
]


def _autocast(dtype):
    return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_operand_dtype_rule(case):
    _, hd, wd, ac, fp32_head, want, _ = case
    with _autocast(ac):
        assert operand_dtype(hd, wd, fp32_head=fp32_head, device_type="cpu") == want


def test_fp64_and_refused_pairs():
    assert operand_dtype(torch.float64, torch.float64) == torch.float64
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert operand_dtype(torch.float64, torch.float64) == torch.float64
    with pytest.raises(TypeError, match="hidden is torch.float16 and weight is torch.bfloat16"):
        operand_dtype(torch.float16, torch.bfloat16)
    with pytest.raises(TypeError, match="fp32_head"):
        apply_precision(torch.zeros(2, 3), torch.zeros(4, 3), None, fp32_head=1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_linear_logprobs_follow_policy(backend, case):
    _, hd, wd, ac, fp32_head, want, other = case
    hidden, weight, bias, labels = _inputs(hd, wd)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    with _autocast(ac):
        logp, ent = linear_logprobs(hidden, weight, labels, bias=bias, return_entropy=True, backend=backend,
                                    fp32_head=fp32_head)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    ref_logp, ref_ent = _ref(hidden.detach(), weight.detach(), bias, labels, want)
    torch.testing.assert_close(logp.double(), ref_logp.double(), rtol=0, atol=TOL)
    torch.testing.assert_close(ent.double(), ref_ent.double(), rtol=0, atol=TOL)
    if other is not None:  # the other reading is measurably different: the test can tell them apart
        other_logp, _ = _ref(hidden.detach(), weight.detach(), bias, labels, other)
        assert (logp.double() - other_logp.double()).abs().max() > 10 * TOL

    # gradients: those of the reference at the rounded operands, in the inputs' own dtypes
    (logp.sum() + 0.5 * ent.sum()).backward()
    assert hidden.grad.dtype == hd and weight.grad.dtype == wd
    h64 = hidden.detach().to(want).double().requires_grad_(True)
    w64 = weight.detach().to(want).double().requires_grad_(True)
    b64 = None if bias is None else bias.to(want).double()
    r_logp, r_ent = reference.linear_logprobs(h64, w64, labels, bias=b64, return_entropy=True)
    (r_logp.double().sum() + 0.5 * r_ent.double().sum()).backward()
    # the operands' gradients are rounded to the operand dtype (as autocast's matmul does): 2^-8 for bf16
    # and to the input's own dtype when it is lower
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}
    torch.testing.assert_close(hidden.grad.double(), h64.grad, rtol=max(tol[want], tol[hd]), atol=max(tol[want], tol[hd]))
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=max(tol[want], tol[wd]), atol=max(tol[want], tol[wd]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", [c for c in CASES if c[3] is not None or c[1] != c[2]], ids=lambda c: c[0])
def test_fused_loss_follows_policy(backend, case):
    _, hd, wd, ac, fp32_head, want, _ = case
    hidden, weight, bias, labels = _inputs(hd, wd)
    labels = labels.reshape(3, 4)
    hidden = hidden.reshape(3, 4, H)
    ref_logp, _ = _ref(hidden, weight, bias, labels, want)
    # old log-probs equal to the policy's own at the prescribed precision: every weight must be 1
    old = ref_logp.float()
    adv = torch.tensor([1.0, -0.5, 0.25])
    config = GSPOConfig(importance_sampling_level="sequence", epsilon_low=3e-4, epsilon_high=4e-4)
    with _autocast(ac):
        out = fused_linear_gspo_loss(hidden, weight, labels, adv, old, bias=bias, config=config, backend=backend,
                                     fp32_head=fp32_head)
    assert out.loss.dtype == torch.float32
    assert abs(out.metrics["importance_weight/min"].item() - 1) < 1e-6
    assert abs(out.metrics["importance_weight/max"].item() - 1) < 1e-6
    assert out.metrics["clip_ratio/region_mean"].item() == 0
    r = lambda x: None if x is None else x.to(want).double()  # noqa: E731
    ref = reference.fused_linear_gspo_loss(r(hidden), r(weight), labels, adv.double(), old.double(), bias=r(bias),
                                           config=config)
    torch.testing.assert_close(out.loss.double(), ref.loss.double(), rtol=0, atol=1e-6)


_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
# The documented table (gspo_kernels/precision.py), written out pair by pair outside autocast:
# fp64 anywhere -> fp64; equal -> that dtype; half vs fp32 -> the half; fp16 vs bf16 -> refused.
_TABLE = {
    ("fp16", "fp16"): "fp16", ("fp16", "bf16"): None, ("fp16", "fp32"): "fp16", ("fp16", "fp64"): "fp64",
    ("bf16", "fp16"): None, ("bf16", "bf16"): "bf16", ("bf16", "fp32"): "bf16", ("bf16", "fp64"): "fp64",
    ("fp32", "fp16"): "fp16", ("fp32", "bf16"): "bf16", ("fp32", "fp32"): "fp32", ("fp32", "fp64"): "fp64",
    ("fp64", "fp16"): "fp64", ("fp64", "bf16"): "fp64", ("fp64", "fp32"): "fp64", ("fp64", "fp64"): "fp64",
}


@pytest.mark.parametrize("pair", sorted(_TABLE), ids=lambda p: f"{p[0]}-{p[1]}")
def test_every_dtype_pair_has_one_decision(pair):
    """Every (hidden, weight) dtype pair: one operand dtype from ``operand_dtype`` (or a TypeError), both
    operands cast to it by ``apply_precision``, fp32 with ``fp32_head`` unless fp64 is involved, and the
    Triton kernels' dtype (``kernel_operand_dtype``) derived from that decision without a second opinion."""
    from gspo_kernels.precision import kernel_operand_dtype

    hd, wd = _DTYPES[pair[0]], _DTYPES[pair[1]]
    want = _TABLE[pair]
    if want is None:
        with pytest.raises(TypeError, match="hidden is"):
            apply_precision(torch.zeros(2, 3, dtype=hd), torch.zeros(4, 3, dtype=wd), None)
    else:
        h, w, _ = apply_precision(torch.zeros(2, 3, dtype=hd), torch.zeros(4, 3, dtype=wd), None)
        assert h.dtype == w.dtype == _DTYPES[want]
        assert kernel_operand_dtype(h.dtype, w.dtype) == (torch.float32 if want == "fp64" else _DTYPES[want])
    head = operand_dtype(hd, wd, fp32_head=True)
    assert head == (torch.float64 if "fp64" in pair else torch.float32)
    as_kernel = {hd: hd, wd: wd, torch.float64: torch.float32}
    if as_kernel[hd] != as_kernel[wd]:  # a pair the policy did not cast first is refused, never re-decided
        with pytest.raises(TypeError, match="hidden is"):
            kernel_operand_dtype(hd, wd)
