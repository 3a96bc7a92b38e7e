"""Adversarial inputs, eleven classes of them, over every available backend (and the float64 oracle).

Each case ends in one of two ways: a clear error naming the argument, or a match with the float64
reference (fp32: 1e-5 relative, ``tests.support.check_against_reference``). The policies pinned here are
written in ``docs/policies.md``. The Triton backend runs in the interpreter on CPU-only machines
(``tests/conftest.py`` sets ``TRITON_INTERPRET=1``), so ``available_backends("cpu")`` lists it.
"""

from __future__ import annotations

import math

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels import reference
from gspo_kernels.loss import DOUBLE_BACKWARD_ERROR
from tests.support import check_against_reference, device_for, rel_err

C = gk.GSPOConfig
DEVICE = device_for("auto")  # CUDA where it exists, else CPU (the Triton backend in the interpreter)
BACKENDS = tuple(gk.available_backends(DEVICE))
RTOL = 1e-5


def backends(*, with_reference: bool = False):
    """``pytest.param`` per available backend (plus ``"reference"``, the float64 oracle)."""
    names = BACKENDS + (("reference",) if with_reference else ())
    return [pytest.param(n, id=n) for n in names]


def with_first(value, params):
    """``(value, backend)`` parameters from :func:`backends`' list, marks and ids kept."""
    return [pytest.param(value, p.values[0], marks=p.marks, id=f"{value}-{p.id}") for p in params]


def dev(*tensors):
    """To the test device (meta tensors stay on meta)."""
    out = tuple(t.to(DEVICE) if isinstance(t, torch.Tensor) and not t.is_meta else t for t in tensors)
    return out if len(out) > 1 else out[0]


def logits_case(B=3, T=5, V=13, scale=2.0, spread=3e-4):
    """Logits, labels, per-response advantages and old log-probs near the policy's (some responses clip)."""
    logits = torch.randn(B, T, V) * scale
    labels = torch.randint(0, V, (B, T))
    logp = reference.token_logprobs(logits.double(), labels)
    old = (logp - spread * torch.randn(B, 1, dtype=torch.float64)).float()
    adv = torch.randn(B)
    return logits, labels, adv, old


def run_logits(backend, logits, labels, adv, old=None, **kw):
    """Loss and logits gradient of ``backend`` (the reference runs in float64)."""
    if backend == "reference":
        x = logits.double().requires_grad_()
        out = reference.gspo_loss(x, labels, adv, old, **kw)
    else:
        x = dev(logits).clone().requires_grad_()
        out = gk.gspo_loss(x, dev(labels), dev(adv), dev(old), backend=backend,
                           **{k: dev(v) for k, v in kw.items()})
    (grad,) = torch.autograd.grad(out.loss, x)
    return out, grad


def expected_logits(logits, labels, adv, old=None, **kw):
    """The float64 oracle; ``-inf`` logits become ``-1e300`` (``exp`` gives exactly 0 and ``0 * -1e300 = 0``,
    the limit the oracle's ``0 * -inf`` misses), so the expectation does not depend on the oracle's fix."""
    x = logits.double().masked_fill(logits == float("-inf"), -1e300).requires_grad_()
    out = reference.gspo_loss(x, labels, adv, old, **kw)
    (grad,) = torch.autograd.grad(out.loss, x)
    return out, grad


def close_to_reference(out, grad, expected, ref_grad, rtol=RTOL):
    check_against_reference(out, expected, [grad.cpu()], [ref_grad], rtol=rtol)


# ---------------------------------------------------------------------------------------------
# 1. -inf logits on non-label columns (vocabulary masking, padded vocabulary rows): valid input.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", backends(with_reference=True))
def test_minus_inf_logits_give_finite_loss_and_zero_gradient(backend):
    x = torch.randn(2, 4, 11)
    x[..., 0] = float("-inf")
    y = torch.randint(1, 11, (2, 4))
    cfg = C(entropy_coef=0.01)
    old = (reference.token_logprobs(x.double(), y) - 0.01 * torch.randn(2, 1, dtype=torch.float64)).float()
    out, grad = run_logits(backend, x, y, torch.tensor([1.0, -1.0]), old, config=cfg)
    expected, ref_grad = expected_logits(x, y, torch.tensor([1.0, -1.0]), old, config=cfg)
    assert torch.isfinite(grad).all()
    close_to_reference(out, grad, expected, ref_grad)
    assert torch.all(grad[..., 0] == 0)



@pytest.mark.parametrize("backend", backends())
def test_token_logprobs_with_masked_vocabulary(backend):
    V = 19
    x = torch.randn(6, V) * 3
    x[:, ::3] = float("-inf")  # a third of the vocabulary masked; labels never there
    y = torch.tensor([1, 2, 4, 5, 7, 8])
    xl = dev(x).clone().requires_grad_()
    logp, ent = gk.token_logprobs(xl, dev(y), return_entropy=True, backend=backend)
    (logp.sum() + 0.3 * ent.sum()).backward()
    x64 = x.double().masked_fill(x == float("-inf"), -1e300).requires_grad_()
    rlogp, rent = reference.token_logprobs(x64, y, return_entropy=True)
    (rlogp.sum() + 0.3 * rent.sum()).backward()
    assert rel_err(logp.cpu(), rlogp) < RTOL and rel_err(ent.cpu(), rent) < RTOL
    assert rel_err(xl.grad.cpu(), x64.grad) < RTOL



@pytest.mark.parametrize("backend", backends())
def test_minus_inf_bias_entry_on_the_hidden_state_path(backend):
    B, T, V, H = 2, 4, 17, 8
    hidden, weight, bias = torch.randn(B, T, H), torch.randn(V, H) * 0.3, torch.randn(V) * 0.1
    bias[[0, 5]] = float("-inf")
    labels = torch.randint(6, V, (B, T))
    adv = torch.tensor([0.7, -1.2])
    cfg = C(entropy_coef=0.02, epsilon_low=0.2, epsilon_high=0.2)
    h, w, b = (dev(t).clone().requires_grad_() for t in (hidden, weight, bias))
    out = gk.fused_linear_gspo_loss(h, w, dev(labels), dev(adv), bias=b, config=cfg, backend=backend)
    grads = torch.autograd.grad(out.loss, (h, w, b))
    b_safe = bias.double().masked_fill(bias == float("-inf"), -1e300)
    h64, w64, b64 = hidden.double().requires_grad_(), weight.double().requires_grad_(), b_safe.requires_grad_()
    expected = reference.fused_linear_gspo_loss(h64, w64, labels, adv, bias=b64, config=cfg)
    ref_grads = torch.autograd.grad(expected.loss, (h64, w64, b64))
    check_against_reference(out, expected, [g.cpu() for g in grads], ref_grads)


# ---------------------------------------------------------------------------------------------
# 2. Strided (non-contiguous) bias on the hidden-state path.
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", backends())
def test_strided_bias_is_read_with_its_stride(backend):
    B, T, V, H = 2, 3, 11, 8
    hidden, weight = torch.randn(B, T, H), torch.randn(V, H) * 0.3
    bias = torch.randn(2 * V)[::2]  # the reported reproducer: stride 2
    assert not bias.is_contiguous()
    labels = torch.randint(0, V, (B, T))
    logp = gk.linear_logprobs(dev(hidden), dev(weight), dev(labels), bias=dev(bias), backend=backend)
    expected = reference.linear_logprobs(hidden, weight, labels, bias=bias.contiguous())
    assert rel_err(logp.cpu(), expected) < RTOL
    h, w = dev(hidden).clone().requires_grad_(), dev(weight).clone().requires_grad_()
    bias_leaf = dev(torch.randn(2 * V)).requires_grad_()
    out = gk.fused_linear_gspo_loss(h, w, dev(labels), dev(torch.tensor([1.0, -0.5])), bias=bias_leaf[::2],
                                    config=C(entropy_coef=0.01), backend=backend)
    grads = torch.autograd.grad(out.loss, (h, w, bias_leaf))
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    b64 = bias_leaf.detach().cpu().double().requires_grad_()
    ref = reference.fused_linear_gspo_loss(h64, w64, labels, torch.tensor([1.0, -0.5]), bias=b64[::2],
                                           config=C(entropy_coef=0.01))
    ref_grads = torch.autograd.grad(ref.loss, (h64, w64, b64))
    check_against_reference(out, ref, [g.cpu() for g in grads], ref_grads)
    assert torch.all(grads[2][1::2] == 0)  # the skipped entries of the strided view get no gradient


# ---------------------------------------------------------------------------------------------
# 3. Double backward: refused with one clear RuntimeError on every backend; first order untouched.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", backends())
def test_double_backward_is_refused(backend):
    logits, labels, adv, old = logits_case()
    x = dev(logits).clone().requires_grad_()
    out = gk.gspo_loss(x, dev(labels), dev(adv), dev(old), config=C(entropy_coef=0.01), backend=backend)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        (g,) = torch.autograd.grad(out.loss, x, create_graph=True)
        torch.autograd.grad(g.sum(), x)
    # the same graph still gives the right first-order gradient afterwards
    (grad,) = torch.autograd.grad(out.loss, x)
    expected, ref_grad = expected_logits(logits, labels, adv, old, config=C(entropy_coef=0.01))
    close_to_reference(out, grad, expected, ref_grad)


@pytest.mark.parametrize("backend", backends())
def test_double_backward_refused_on_every_public_function(backend):
    B, T, V, H = 2, 3, 11, 8
    labels, adv = dev(torch.randint(0, V, (B, T))), dev(torch.randn(B))
    old = dev(torch.randn(B, T) - 2.5)
    h, w, b = dev(torch.randn(B, T, H)).requires_grad_(), dev(torch.randn(V, H)).requires_grad_(), \
        dev(torch.randn(V)).requires_grad_()
    x = dev(torch.randn(B, T, V)).requires_grad_()
    outputs = {
        "token_logprobs": lambda: sum(t.sum() for t in gk.token_logprobs(x, labels, return_entropy=True,
                                                                         backend=backend)),
        "linear_logprobs": lambda: gk.linear_logprobs(h, w, labels, bias=b, backend=backend).sum(),
        "gspo_loss": lambda: gk.GSPOLoss(backend=backend)(x, labels, adv, old).loss,
        "fused_linear_gspo_loss": lambda: gk.FusedLinearGSPOLoss(backend=backend)(h, w, labels, adv, old,
                                                                                 bias=b).loss,
        "policy_loss": lambda: gk.policy_loss(gk.token_logprobs(x.detach(), labels).requires_grad_() * 1.0, adv, old,
                                              backend=backend).loss,
    }
    for name, make in outputs.items():
        with pytest.raises(RuntimeError) as err:
            make().backward(create_graph=True)
        assert str(err.value) == DOUBLE_BACKWARD_ERROR, name
        for t in (x, h, w, b):
            t.grad = None


def test_first_order_guard_adds_nothing_to_gradients():
    """The guard is an identity: first-order gradients are bit-identical with and without it, and rows
    the objective gives no gradient are still skipped (``None`` stays ``None`` through the guard)."""
    from gspo_kernels.loss import first_order_only

    t = torch.randn(5, requires_grad=True)
    (guarded,) = first_order_only(t)
    g = torch.randn(5)
    (a,) = torch.autograd.grad(guarded * 1.0, t, g)
    assert torch.equal(a, g)
    untouched = torch.randn(3)  # no grad: returned as is, no node added
    assert first_order_only(untouched)[0] is untouched


# ---------------------------------------------------------------------------------------------
# 4. Precision: fp32 logits near 1e4, temperature 1e-6 (kernel numerics of each backend).
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", backends())
def test_logits_offset_by_1e4_match_the_reference(backend):
    logits, labels, adv, old = logits_case(V=64)
    logits = logits + 1e4
    cfg = C(entropy_coef=0.01)
    out, grad = run_logits(backend, logits, labels, adv, old, config=cfg)
    expected, ref_grad = expected_logits(logits, labels, adv, old, config=cfg)
    close_to_reference(out, grad, expected, ref_grad)


@pytest.mark.parametrize("backend", backends())
def test_tiny_temperature_logits(backend):
    """``temperature = 1e-6`` on random fp32 logits: the softmax is one-hot (logit gaps far above fp32
    rounding), so on-policy (weights exactly 1) the loss and the gradient ``(onehot(label) - onehot(argmax))
    / temperature`` are exact in fp32, as plain fp32 ``log_softmax(logits / temperature)`` gets them."""
    B, T, V = 2, 4, 32
    logits = torch.randn(B, T, V)
    labels = torch.randint(0, V, (B, T))
    labels[0, :2] = logits[0, :2].argmax(-1)  # two greedy tokens: log-prob 0, no gradient
    adv = torch.tensor([1.0, -0.7])
    cfg = C(temperature=1e-6, entropy_coef=0.01)
    out, grad = run_logits(backend, logits, labels, adv, None, config=cfg)
    expected, ref_grad = expected_logits(logits, labels, adv, None, config=cfg)
    assert ref_grad.abs().max() > 1e4  # gradients of size 1/temperature
    close_to_reference(out, grad, expected, ref_grad)


@pytest.mark.parametrize("backend", backends())
def test_tiny_temperature_hidden_states(backend):
    """``temperature = 1e-6`` on the hidden-state path, on-policy: the softmax is one-hot (logit gaps are far
    above fp32 rounding), the gradient ``(W[label] - W[argmax]) / temperature`` is exact in fp32."""
    B, T, V, H = 2, 4, 24, 8
    hidden, weight = torch.randn(B, T, H), torch.randn(V, H) * 0.3
    labels = torch.randint(0, V, (B, T))
    adv = torch.tensor([1.0, -1.0])
    cfg = C(temperature=1e-6)
    h, w = dev(hidden).clone().requires_grad_(), dev(weight).clone().requires_grad_()
    out = gk.fused_linear_gspo_loss(h, w, dev(labels), dev(adv), config=cfg, backend=backend)
    grads = torch.autograd.grad(out.loss, (h, w))
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    expected = reference.fused_linear_gspo_loss(h64, w64, labels, adv, config=cfg)
    ref_grads = torch.autograd.grad(expected.loss, (h64, w64))
    assert ref_grads[0].abs().max() > 1e4
    check_against_reference(out, expected, [g.cpu() for g in grads], ref_grads)


# ---------------------------------------------------------------------------------------------
# 5. Overflow: importance weights of e^100 that are clipped or capped by delta.
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", backends(with_reference=True))
@pytest.mark.parametrize("level", ["sequence", "sequence_token", "token"])
@pytest.mark.parametrize("clip", ["clipped", "delta"])
def test_overflowing_importance_weight_gives_finite_results(backend, level, clip):
    """``old = logp - 100``: w = e^100 (inf in fp32). Response 0 overflows and is clipped (A > 0) or capped
    by ``delta = 2`` (A < 0, where the unclipped branch would otherwise win); response 1 is ordinary, so
    the gradient is not zero everywhere."""
    logits, labels, _, _ = logits_case(B=2, T=4, V=11)
    logp = reference.token_logprobs(logits.double(), labels)
    old = (logp - torch.tensor([[100.0], [1e-4]], dtype=torch.float64)).float()
    if clip == "clipped":
        adv, cfg = torch.tensor([1.0, -0.5]), C(importance_sampling_level=level)
    else:
        adv, cfg = torch.tensor([-1.0, 0.5]), C(importance_sampling_level=level, delta=2.0)
    out, grad = run_logits(backend, logits, labels, adv, old, config=cfg)
    expected, ref_grad = expected_logits(logits, labels, adv, old, config=cfg)
    assert torch.isfinite(grad).all() and torch.isfinite(out.loss)
    assert torch.all(grad[0] == 0) and bool((grad[1] != 0).any())
    if backend == "reference":
        return  # the expectation is the oracle itself: finite is what it had to show
    assert abs(out.loss.item() - expected.loss.item()) <= RTOL * max(1.0, abs(expected.loss.item()))
    assert rel_err(grad.cpu(), ref_grad) < RTOL
    # the weight metrics overflow in fp32 (e^100 > 3.4e38) exactly as the float64 values cast to fp32 do
    for name, value in expected.metrics.items():
        torch.testing.assert_close(out.metrics[name].double().cpu(), value.float().double(), rtol=RTOL, atol=1e-6,
                                   msg=name)


def test_live_weight_keeps_the_reference_gradient_in_band():
    """The stand-in is used only where the loss is constant in the weight: in-band tokens, ties and the
    unclipped branch keep the exact float64 gradient of ``-min(c1 A, c2 A)`` (ties split by torch.minimum)."""
    from gspo_kernels.objectives.clipped import live_log_weight

    cfg = C(epsilon_low=0.2, epsilon_high=0.2, delta=1.5)
    log_w = torch.tensor([0.0, math.log(1.2), math.log(1.5), math.log(3.0), math.log(0.5), 80.0, 800.0],
                         dtype=torch.float64, requires_grad=True)
    for A in (1.0, -1.0, 0.0):
        adv = torch.full_like(log_w, A)

        def surrogate(lw, adv=adv):
            w = torch.exp(lw)
            c1, c2 = torch.clamp(w, max=cfg.delta), torch.clamp(w, 0.8, 1.2)
            return -torch.minimum(c1 * adv, c2 * adv)

        live = surrogate(live_log_weight(log_w, adv, cfg))
        plain = surrogate(log_w)
        assert torch.equal(live.detach(), plain.detach())  # same values, e^800 = inf included
        (g_live,) = torch.autograd.grad(live.sum(), log_w)
        (g_plain,) = torch.autograd.grad(plain[:-1].sum(), log_w)
        torch.testing.assert_close(g_live[:-1], g_plain[:-1], rtol=0, atol=0)
        assert g_live[-1] == 0


# ---------------------------------------------------------------------------------------------
# 6. NaN at masked positions of is_ratio / per-token advantages never spreads.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("level, backend", with_first("sequence", backends(with_reference=True))
                         + with_first("token", backends(with_reference=True)))
@pytest.mark.parametrize("poisoned", ["is_ratio", "advantages"])
def test_masked_nan_does_not_spread(backend, poisoned, level):
    logits, labels, _, old = logits_case(B=3, T=5, V=13)
    mask = torch.ones(3, 5)
    mask[0, 3:] = 0
    mask[2, 0] = 0
    adv = torch.randn(3, 5)
    is_ratio = 1 + 0.1 * torch.rand(3, 5)
    clean = dict(advantages=adv.clone(), is_ratio=is_ratio.clone())
    bad = {"advantages": adv, "is_ratio": is_ratio}[poisoned]
    bad[mask == 0] = float("nan")
    cfg = C(importance_sampling_level=level, beta=0.05)
    ref_lp = (old + 0.1 * torch.randn(3, 5)).float()
    out, grad = run_logits(backend, logits, labels, adv, old, mask=mask, is_ratio=is_ratio, ref_logprobs=ref_lp,
                           config=cfg)
    clean_adv = torch.where(mask > 0, clean["advantages"], 0.0)
    clean_ratio = torch.where(mask > 0, clean["is_ratio"], 0.0)
    expected, ref_grad = expected_logits(logits, labels, clean_adv, old, mask=mask, is_ratio=clean_ratio,
                                         ref_logprobs=ref_lp, config=cfg)
    assert torch.isfinite(grad).all()
    close_to_reference(out, grad, expected, ref_grad)


# ---------------------------------------------------------------------------------------------
# 7. num_items_in_batch: one rule for ints, floats and tensors: a finite number > 0, used as given.
# ---------------------------------------------------------------------------------------------

BAD_ITEMS = [0, -3, 0.0, -5.0, float("nan"), float("inf"), torch.tensor(0.0), torch.tensor(-5.0),
             torch.tensor(float("nan")), torch.tensor(float("inf")), torch.tensor(-2)]


@pytest.mark.parametrize("backend", backends(with_reference=True))
@pytest.mark.parametrize("items", BAD_ITEMS, ids=lambda v: repr(v))
def test_bad_num_items_in_batch_is_refused(backend, items):
    logits, labels, adv, old = logits_case(B=2, T=3, V=7)
    with pytest.raises(ValueError, match="num_items_in_batch must be a finite number > 0"):
        run_logits(backend, logits, labels, adv, old, num_items_in_batch=items, config=C(loss_type="dapo"))


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("items, error", [
    (True, TypeError), (torch.tensor([3.0, 4.0]), ValueError), (torch.tensor(True), TypeError),
    ("7", TypeError), (torch.tensor(3.0, device="meta"), ValueError),
], ids=["bool", "two-elements", "bool-tensor", "str", "meta"])
def test_num_items_in_batch_of_wrong_structure_is_refused(backend, items, error):
    logits, labels, adv, old = logits_case(B=2, T=3, V=7)
    with pytest.raises(error, match="num_items_in_batch"):
        run_logits(backend, logits, labels, adv, old, num_items_in_batch=items, config=C(loss_type="dapo"))



@pytest.mark.parametrize("backend", backends(with_reference=True))
@pytest.mark.parametrize("items", [0.5, 0.25], ids=lambda v: repr(v))
def test_fractional_num_items_is_used_as_given(backend, items):
    """TRL passes ``num_items_in_batch / num_processes``: below 1 on a small batch over many processes."""
    logits, labels, adv, old = logits_case(B=2, T=3, V=7)
    cfg = C(loss_type="dapo", epsilon_low=0.2, epsilon_high=0.2)
    out, grad = run_logits(backend, logits, labels, adv, old, num_items_in_batch=items, config=cfg)
    one, ref_grad = expected_logits(logits, labels, adv, old, num_items_in_batch=1, config=cfg)
    expected = one._replace(loss=one.loss / items)
    close_to_reference(out, grad, expected, ref_grad / items)


@pytest.mark.parametrize("backend", backends(with_reference=True))
@pytest.mark.parametrize("items", [7, 7.0, torch.tensor(7), torch.tensor(7.0, dtype=torch.float64),
                                   torch.tensor([7.0])], ids=["int", "float", "int-tensor", "fp64-tensor", "1-elem"])
def test_every_spelling_of_a_count_agrees(backend, items):
    logits, labels, adv, old = logits_case(B=2, T=3, V=7)
    cfg = C(loss_type="dapo", epsilon_low=0.2, epsilon_high=0.2)
    out, grad = run_logits(backend, logits, labels, adv, old, num_items_in_batch=items, config=cfg)
    expected, ref_grad = expected_logits(logits, labels, adv, old, num_items_in_batch=7, config=cfg)
    close_to_reference(out, grad, expected, ref_grad)


# ---------------------------------------------------------------------------------------------
# 8. Masks hold only 0 and 1 (bool, integer or float); anything else is an error naming `mask`.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", backends(with_reference=True))
@pytest.mark.parametrize("value", [0.5, 2.0, -1.0, float("nan"), float("inf")])
def test_non_binary_mask_is_an_error(backend, value):
    logits, labels, adv, old = logits_case(B=2, T=4, V=7)
    mask = torch.ones(2, 4)
    mask[1, 2] = value
    # the oracle has its own checks and words; the library names the position too
    words = "mask must hold only 0 and 1" + ("" if backend == "reference" else r" .*flat position 6 holds")
    with pytest.raises(ValueError, match=words):
        run_logits(backend, logits, labels, adv, old, mask=mask)


@pytest.mark.parametrize("backend", backends(with_reference=True))
def test_non_binary_integer_mask_in_packed_layout_is_an_error(backend):
    logits, labels = torch.randn(6, 7), torch.randint(0, 7, (6,))
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="mask must hold only 0 and 1"):
        run_logits(backend, logits, labels, torch.randn(2), None, cu_seqlens=cu,
                   mask=torch.tensor([1, 1, 0, 3, 1, 1]))


@pytest.mark.parametrize("backend", backends(with_reference=True))
def test_binary_masks_of_every_dtype_agree(backend):
    logits, labels, adv, old = logits_case(B=3, T=5, V=7)
    base = torch.rand(3, 5) > 0.3
    base[2] = False  # an empty response
    expected, ref_grad = expected_logits(logits, labels, adv, old, mask=base.double())
    for mask in (base, base.to(torch.uint8), base.to(torch.int64), base.float(), base.to(torch.bfloat16)):
        out, grad = run_logits(backend, logits, labels, adv, old, mask=mask)
        close_to_reference(out, grad, expected, ref_grad)


# ---------------------------------------------------------------------------------------------
# 9. Meta tensors: refused with a clear error (no values to check or compute with).
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", backends() + [pytest.param("auto", id="auto")])
def test_meta_tensors_are_refused(backend):
    B, T, V, H = 2, 3, 7, 4
    m = dict(device="meta")
    logits, labels, adv = torch.randn(B, T, V, **m), torch.zeros(B, T, dtype=torch.long, **m), torch.randn(B, **m)
    with pytest.raises(ValueError, match="logits is on the meta device"):
        gk.gspo_loss(logits, labels, adv, backend=backend)
    with pytest.raises(ValueError, match="logits is on the meta device"):
        gk.token_logprobs(logits, labels, backend=backend)
    hidden, weight = torch.randn(B, T, H, **m), torch.randn(V, H, **m)
    with pytest.raises(ValueError, match="labels is on the meta device"):
        gk.fused_linear_gspo_loss(hidden, weight, labels, adv, backend=backend)
    with pytest.raises(ValueError, match="labels is on the meta device"):
        gk.linear_logprobs(hidden, weight, labels, backend=backend)
    real = dict(device=DEVICE)
    with pytest.raises(ValueError, match="old_logprobs is on meta but labels is on"):
        gk.gspo_loss(torch.randn(B, T, V, **real), torch.zeros(B, T, dtype=torch.long, **real),
                     torch.randn(B, **real), torch.randn(B, T, **m), backend=backend)
    with pytest.raises(ValueError, match="num_items_in_batch is on meta"):
        gk.gspo_loss(torch.randn(B, T, V, **real), torch.zeros(B, T, dtype=torch.long, **real),
                     torch.randn(B, **real), num_items_in_batch=torch.tensor(4.0, **m),
                     config=C(loss_type="dapo"), backend=backend)


# ---------------------------------------------------------------------------------------------
# 10. Under torch.compile the value checks still run (as asserts in the graph).
# ---------------------------------------------------------------------------------------------

# Dynamo does not trace the Triton interpreter's kernels; the cpu backend's custom ops have fake kernels.
COMPILE_CASES = [c for c in [("cpu", "eager"), ("cpu", "aot_eager"), ("torch", "eager")] if c[0] in BACKENDS]


def _compiled_loss(backend, compiler):
    torch._dynamo.reset()

    def step(x, labels, adv, **kw):
        return gk.gspo_loss(x, labels, adv, backend=backend, **kw).loss

    # the checks add no graph break: the cpu backend's custom ops trace in one graph
    return torch.compile(step, backend=compiler, fullgraph=backend == "cpu")


BAD_CU_SEQLENS = [([0, 2, 5], "cu_seqlens must end at N"), ([0, 7, 6], "cu_seqlens must be non-decreasing"),
                  ([1, 2, 6], "cu_seqlens must start at 0"), ([0, 2, 7], "cu_seqlens must end at N")]

# One bad cu_seqlens through the compiled loss, in a process of its own (argv: backend, compiler, device, the
# cu_seqlens as "0,2,5"): on CUDA the in-graph check is a device-side assert, which leaves the process's CUDA
# context unusable, so it must not run inside the test process (every later CUDA test of that process would
# fail). Prints a line after the good case, and another if the bad one gave no error.
_BAD_CU_SEQLENS_SCRIPT = """
import sys
import torch
import gspo_kernels as gk
backend, compiler, device, cu = sys.argv[1], sys.argv[2], sys.argv[3], [int(v) for v in sys.argv[4].split(",")]
torch.manual_seed(0)
N, V = 6, 9
x, labels = torch.randn(N, V, device=device), torch.randint(0, V, (N,), device=device)
adv = torch.randn(2, device=device)
step = torch.compile(lambda x, labels, adv, **kw: gk.gspo_loss(x, labels, adv, backend=backend, **kw).loss,
                     backend=compiler, fullgraph=backend == "cpu")
good = torch.tensor([0, 2, 6], dtype=torch.int32, device=device)
eager = gk.gspo_loss(x, labels, adv, cu_seqlens=good, backend=backend).loss
torch.testing.assert_close(step(x, labels, adv, cu_seqlens=good), eager, rtol=1e-6, atol=1e-7)
print("good cu_seqlens: the eager loss", flush=True)
loss = step(x, labels, adv, cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device))
if device == "cuda":
    torch.cuda.synchronize()
print("bad cu_seqlens: no error, loss", float(loss), flush=True)
"""


def run_bad_cu_seqlens_in_subprocesses(backend: str, compiler: str, device: str, cases=BAD_CU_SEQLENS):
    """``[(returncode, stdout, stderr)]`` of :data:`_BAD_CU_SEQLENS_SCRIPT`, one process per case, all at once."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    procs = [subprocess.Popen([sys.executable, "-c", _BAD_CU_SEQLENS_SCRIPT, backend, compiler, device,
                               ",".join(map(str, cu))], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=root) for cu, _ in cases]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        results.append((p.returncode, out, err))
    return results


@pytest.mark.parametrize("backend, compiler", COMPILE_CASES)
def test_bad_cu_seqlens_is_an_error_under_compile(backend, compiler):
    """The eager value checks become ``torch._assert_async`` graph nodes: a bad ``cu_seqlens`` is an error,
    never a silent plausible loss. On the CPU a ``RuntimeError`` with the rule's text; on CUDA a device-side
    assert (the README's promise), each case in a process of its own (:func:`run_bad_cu_seqlens_in_subprocesses`):
    it fails, after the good case matched the eager loss."""
    if DEVICE == "cuda":
        for (cu, _), (_, out, err) in zip(BAD_CU_SEQLENS,
                                          run_bad_cu_seqlens_in_subprocesses(backend, compiler, DEVICE)):
            assert "good cu_seqlens: the eager loss" in out, (cu, err[-3000:])
            assert "no error" not in out, (cu, out)
            assert "device-side assert" in err or "cu_seqlens must" in err, (cu, err[-3000:])
        return
    N, V = 6, 9
    x, labels, adv = dev(torch.randn(N, V)), dev(torch.randint(0, V, (N,))), dev(torch.randn(2))
    step = _compiled_loss(backend, compiler)
    good = dev(torch.tensor([0, 2, 6], dtype=torch.int32))
    eager = gk.gspo_loss(x, labels, adv, cu_seqlens=good, backend=backend).loss
    torch.testing.assert_close(step(x, labels, adv, cu_seqlens=good), eager, rtol=1e-6, atol=1e-7)
    for cu, words in BAD_CU_SEQLENS:
        with pytest.raises(RuntimeError, match=words):
            step(x, labels, adv, cu_seqlens=dev(torch.tensor(cu, dtype=torch.int32)))


@pytest.mark.slow
def test_the_bad_cu_seqlens_subprocess_reports_the_error():
    """The subprocess the CUDA case above relies on, run here on the CPU (where the error is a ``RuntimeError``
    with the rule's text): it fails with the text after the good case; a good ``cu_seqlens`` passes."""
    results = run_bad_cu_seqlens_in_subprocesses("torch", "eager", "cpu",
                                                 cases=[BAD_CU_SEQLENS[0], ([0, 2, 6], "no error")])
    (rc, out, err), (rc_good, out_good, err_good) = results
    assert rc != 0 and "good cu_seqlens: the eager loss" in out and "cu_seqlens must end at N" in err, err[-3000:]
    assert rc_good == 0 and "bad cu_seqlens: no error" in out_good, err_good[-3000:]


@pytest.mark.parametrize("backend, compiler", COMPILE_CASES[1:2])
def test_labels_mask_and_num_items_checked_under_compile(backend, compiler):
    B, T, V = 2, 3, 7
    x, adv = dev(torch.randn(B, T, V)), dev(torch.randn(B))
    labels = dev(torch.randint(0, V, (B, T)))
    step = _compiled_loss(backend, compiler)
    with pytest.raises(RuntimeError, match="labels must lie in"):
        step(x, labels.masked_fill(labels == labels[0, 0], V), adv)
    with pytest.raises(RuntimeError, match="mask must hold only 0 and 1"):
        step(x, labels, adv, mask=dev(torch.tensor([[1.0, 0.5, 1.0], [1.0, 1.0, 0.0]])))
    with pytest.raises(RuntimeError, match="num_items_in_batch must be a finite number > 0"):
        step(x, labels, adv, num_items_in_batch=dev(torch.tensor(float("nan"))), config=C(loss_type="dapo"))
    with pytest.raises(RuntimeError, match="advantages must be finite"):
        step(x, labels, adv.masked_fill(adv == adv[1], float("nan")), check_finite=True)
    with pytest.raises(RuntimeError, match="logits must hold no NaN"):
        step(x.masked_fill(x == x[1, 1, 1], float("inf")), labels, adv, check_finite=True)
    masked = labels.clone()
    masked[1, 2] = -100  # out of range but masked: valid
    out = step(x, masked, adv, mask=dev(torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])))
    assert torch.isfinite(out)


@pytest.mark.slow
@pytest.mark.skipif("cpu" not in BACKENDS, reason="the cpu backend is for CPU tensors")
def test_bad_cu_seqlens_is_an_error_under_the_default_compiler():
    """``torch.compile`` with its default backend (inductor): the assert survives code generation."""
    N, V = 6, 9
    x, labels = torch.randn(N, V), torch.randint(0, V, (N,))
    step = _compiled_loss("cpu", "inductor")
    with pytest.raises(RuntimeError, match="cu_seqlens must end at N"):
        step(x, labels, torch.randn(2), cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32))


# ---------------------------------------------------------------------------------------------
# 11. Non-finite inputs at unmasked positions: NaN in, NaN out; check_finite=True makes it an error.
# ---------------------------------------------------------------------------------------------


def _poison(name):
    """Inputs of both paths with one unmasked non-finite value in ``name`` (masked garbage everywhere)."""
    B, T, V, H = 2, 4, 11, 6
    t = dict(
        logits=torch.randn(B, T, V), hidden=torch.randn(B, T, H), weight=torch.randn(V, H) * 0.3,
        bias=torch.randn(V) * 0.1, labels=torch.randint(1, V, (B, T)), advantages=torch.randn(B),
        old_logprobs=torch.randn(B, T) - 2.5, ref_logprobs=torch.randn(B, T) - 2.5, is_ratio=torch.ones(B, T),
        mask=torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]),
    )
    # masked positions hold garbage: never an error, never a leak
    t["logits"][0, 3] = float("nan")
    t["hidden"][1, 3] = float("inf")
    t["labels"][1, 2] = -100
    for k in ("old_logprobs", "ref_logprobs", "is_ratio"):
        t[k][0, 3] = float("nan")
    t["logits"][..., 0] = float("-inf")  # vocabulary masking: valid even with check_finite=True
    off_label = 1 if int(t["labels"][1, 1]) != 1 else 2  # a vocabulary column other than the label's
    bad = {
        "logits": lambda: t["logits"].__setitem__((1, 1, off_label), float("nan")),
        "logits+inf": lambda: t["logits"].__setitem__((1, 1, off_label), float("inf")),
        "logits-inf-label": lambda: t["logits"].__setitem__((1, 1, int(t["labels"][1, 1])), float("-inf")),
        "hidden": lambda: t["hidden"].__setitem__((0, 1, 2), float("nan")),
        "weight": lambda: t["weight"].__setitem__((3, 1), float("inf")),
        "bias": lambda: t["bias"].__setitem__(int(t["labels"][0, 0]), float("-inf")),
        "advantages": lambda: t["advantages"].__setitem__(1, float("nan")),
        "old_logprobs": lambda: t["old_logprobs"].__setitem__((0, 0), float("-inf")),
        "ref_logprobs": lambda: t["ref_logprobs"].__setitem__((1, 0), float("nan")),
        "is_ratio": lambda: t["is_ratio"].__setitem__((1, 1), float("inf")),
        None: lambda: None,
    }
    bad[name]()
    return {k: dev(v) for k, v in t.items()}


def _call(backend, path, t, **kw):
    cfg = C(beta=0.04, entropy_coef=0.01)
    common = dict(mask=t["mask"], ref_logprobs=t["ref_logprobs"], is_ratio=t["is_ratio"], config=cfg,
                  backend=backend, **kw)
    if path == "logits":
        return gk.gspo_loss(t["logits"], t["labels"], t["advantages"], t["old_logprobs"], **common)
    return gk.fused_linear_gspo_loss(t["hidden"], t["weight"], t["labels"], t["advantages"], t["old_logprobs"],
                                     bias=t["bias"], **common)


LOGITS_POISON = ["logits", "logits+inf", "logits-inf-label", "advantages", "old_logprobs", "ref_logprobs",
                 "is_ratio"]
LINEAR_POISON = ["hidden", "weight", "bias", "advantages", "old_logprobs", "ref_logprobs", "is_ratio"]

@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("path, name", [("logits", n) for n in LOGITS_POISON] + [("linear", n) for n in LINEAR_POISON])
def test_check_finite_names_the_argument(backend, path, name):
    t = _poison(name)
    with pytest.raises(ValueError, match=rf"^{name.split('+')[0].split('-')[0]} must "):
        _call(backend, path, t, check_finite=True)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("path, name", [("logits", n) for n in ("logits", "advantages", "ref_logprobs", "is_ratio")]
                         + [("linear", n) for n in ("hidden", "weight")])
def test_nan_input_gives_nan_loss_without_check_finite(backend, path, name):
    """Default (``check_finite=False``): a NaN / inf at an unmasked position makes the loss non-finite."""
    out = _call(backend, path, _poison(name))
    assert not torch.isfinite(out.loss)


@pytest.mark.parametrize("path, backend", with_first("logits", backends())
                         + with_first("linear", backends()))
def test_masked_garbage_and_masked_vocabulary_pass_check_finite(path, backend):
    t = _poison(None)
    checked = _call(backend, path, t, check_finite=True)
    plain = _call(backend, path, t)
    assert torch.isfinite(checked.loss) and torch.equal(checked.loss, plain.loss)


@pytest.mark.parametrize("backend", backends())
def test_check_finite_on_logprob_functions_and_modules(backend):
    t = _poison(None)
    labels = t["labels"].clamp(min=0)
    x = t["logits"].clone()
    x[0, 0, 3] = float("nan")
    with pytest.raises(ValueError, match="^logits must"):
        gk.token_logprobs(x, labels, check_finite=True, backend=backend)
    w, h = t["weight"].clone(), t["hidden"].clone()
    w[0, 0] = float("nan")
    h[1, 3] = 0.0  # linear_logprobs has no mask: every row counts
    with pytest.raises(ValueError, match="^weight must"):
        gk.linear_logprobs(h, w, labels, check_finite=True, backend=backend)
    adv = t["advantages"].clone()
    adv[0] = float("inf")
    with pytest.raises(ValueError, match="^advantages must"):
        gk.GSPOLoss(backend=backend, check_finite=True)(t["logits"], t["labels"], adv, mask=t["mask"])
    with pytest.raises(ValueError, match="^advantages must"):
        gk.FusedLinearGSPOLoss(backend=backend, check_finite=True)(t["hidden"], t["weight"], t["labels"], adv,
                                                                   mask=t["mask"])
    logp = gk.token_logprobs(t["logits"][..., 1:], (labels - 1).clamp(min=0), backend=backend).detach()
    logp[0, 1] = float("nan")
    with pytest.raises(ValueError, match="^logprobs must be finite at unmasked positions"):
        gk.policy_loss(logp, t["advantages"], mask=t["mask"], check_finite=True, backend=backend)
    logp[0, 1] = 0.0
    logp[0, 3] = float("nan")  # masked
    out = gk.policy_loss(logp, t["advantages"], mask=t["mask"], check_finite=True, backend=backend)
    assert torch.isfinite(out.loss)
    # an empty response's advantage is never used: not checked
    mask = t["mask"].clone()
    mask[0] = 0
    out = gk.gspo_loss(t["logits"][..., 1:], labels - 1, adv, mask=mask, check_finite=True, backend=backend)
    assert torch.isfinite(out.loss)
