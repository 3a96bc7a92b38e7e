"""The Triton backend's ``torch.library`` operators (``backends/triton/operators.py``): ``torch.library.opcheck``
(schema, fake implementation against the real one, autograd registration, AOT dispatch with dynamic shapes) on
the inputs the backend gives them, through the interpreter on CPU tensors (compiled kernels on CUDA)."""

from __future__ import annotations

import pytest
import torch

from tests.support import triton_test_device

DEVICE = triton_test_device()

from gspo_kernels.backends.triton import operators  # noqa: E402,F401  (registers torch.ops.gspo_triton)

N, V, H = 6, 40, 8


def _draw(requires_grad: bool = True):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.3
    bias = torch.randn(V, generator=g) * 0.1
    logits = (hidden @ weight.T).detach()
    labels = torch.randint(0, V, (N,), generator=g)
    active = torch.tensor([True, True, False, True, False, True])
    t = dict(hidden=hidden, weight=weight, bias=bias, logits=logits, labels=labels, active=active)
    t = {k: v.to(DEVICE) for k, v in t.items()}
    if requires_grad:
        for k in ("hidden", "weight", "bias", "logits"):
            t[k].requires_grad_()
    return t


def _forward_args():
    t = _draw()
    return {
        "logits_fwd": [
            (t["logits"], t["labels"], t["active"], 0.7, True, None),
            (t["logits"], t["labels"], None, 1.0, False, 3.0),
            (t["logits"].detach().reshape(2, 3, V).requires_grad_(), t["labels"], None, 1.0, True, None),
        ],
        "linear_fwd": [
            (t["hidden"], t["weight"], t["bias"], t["labels"], t["active"], 0.7, None, None, True),
            (t["hidden"], t["weight"], None, t["labels"], None, 1.0, 1 << 12, 4.0, True),
        ],
        "invariant_linear_fwd": [
            (t["hidden"], t["weight"], t["bias"], t["labels"], t["active"], 0.7, None, None),
            (t["hidden"].detach().reshape(2, 3, H).requires_grad_(), t["weight"], None, t["labels"], None, 1.0,
             1 << 12, 4.0),
        ],
    }


def _backward_args():
    t = _draw(requires_grad=False)
    lp, ent, stats = torch.ops.gspo_triton.logits_fwd(t["logits"], t["labels"], t["active"], 0.7, True, None)
    g, ge = torch.randn(N, device=DEVICE), torch.randn(N, device=DEVICE)
    llp, lent, lstats = torch.ops.gspo_triton.linear_fwd(t["hidden"], t["weight"], t["bias"], t["labels"], None,
                                                          1.0, None, None, True)
    ilp, ient, istats = torch.ops.gspo_triton.invariant_linear_fwd(t["hidden"], t["weight"], t["bias"], t["labels"],
                                                                   t["active"], 0.7, None, 4.0)
    return {
        "logits_bwd": [
            (t["logits"], t["labels"], stats, ent, g, ge, t["active"], 0.7, None),
            (t["logits"], t["labels"], stats, None, g, None, None, 0.7, None),
        ],
        "linear_bwd": [
            (t["hidden"], t["weight"], t["bias"], t["labels"], None, lstats, lent, g, ge, 1.0, None, None,
             True, True, True),
            (t["hidden"], t["weight"], None, t["labels"], None, lstats, lent, g, None, 1.0, None, None,
             True, False, False),
        ],
        "invariant_linear_bwd": [
            (t["hidden"], t["weight"], t["bias"], t["labels"], t["active"], istats, ient, g, ge, 0.7, None, 4.0,
             True, True, True),
            (t["hidden"].reshape(2, 3, H), t["weight"], None, t["labels"], None, istats, ient, None, ge, 0.7,
             1 << 12, 4.0, True, False, False),
        ],
    }


def _cases():
    for table in (_forward_args, _backward_args):
        for name, arg_lists in table().items():
            for i in range(len(arg_lists)):
                yield pytest.param(name, i, table, id=f"{name}-{i}")


@pytest.mark.parametrize("name, index, table", list(_cases()))
def test_operator_passes_opcheck(name, index, table):
    """Schema, fake implementation (shapes, dtypes, strides of the real outputs), autograd registration and AOT
    dispatch (static and dynamic shapes) of every operator, on inputs the backend passes them."""
    op = getattr(torch.ops.gspo_triton, name)
    torch.library.opcheck(op, table()[name][index])


@pytest.mark.parametrize("softcap", [None, 4.0])
def test_operator_gradients_equal_the_eager_functions(softcap):
    """The operators' autograd (``logits_fwd`` / ``linear_fwd`` / ``invariant_linear_fwd`` differentiated through
    their registered backward operators) gives the eager autograd Functions' outputs and gradients bit for bit: the
    same launchers (the batch-invariant path's with a bias, an entropy gradient and ``active`` rows)."""
    from gspo_kernels.backends.triton import linear as linear_path
    from gspo_kernels.backends.triton import linear_invariant
    from gspo_kernels.backends.triton import logits as logits_path
    from gspo_kernels.options import CallOptions

    options = CallOptions(temperature=0.7, return_entropy=True, softcap=softcap)
    w_lp, w_ent = torch.linspace(0.5, 1.5, N, device=DEVICE), torch.linspace(-1.0, 1.0, N, device=DEVICE)
    t = _draw()
    results = []
    for traced in (False, True):
        logits = t["logits"].detach().clone().requires_grad_()
        lead, inv = ((t["hidden"].detach().clone().requires_grad_(), t["weight"].detach().clone().requires_grad_(),
                      t["bias"].detach().clone().requires_grad_()) for _ in range(2))
        if traced:
            a = operators.traced_logits_logprobs(logits, t["labels"], t["active"], options)
            b = operators.traced_linear_logprobs(*lead, t["labels"], t["active"], options)
            c = operators.traced_invariant_linear_logprobs(*inv, t["labels"], t["active"], options)
        else:
            a = logits_path.logits_logprobs(logits, t["labels"], t["active"], options)
            b = linear_path.linear_logprobs(*lead, t["labels"], t["active"], options)
            c = linear_invariant.linear_logprobs(*inv, t["labels"], t["active"], options)
        loss = sum((lp * w_lp).sum() + (ent * w_ent).sum() for lp, ent in (a, b, c))
        results.append((*a, *b, *c, *torch.autograd.grad(loss, (logits, *lead, *inv))))
    for eager, traced in zip(*results):
        assert torch.equal(eager, traced)
