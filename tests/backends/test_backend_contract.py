"""Every registered backend's stage functions against the contract's Protocols (``gspo_kernels.backends.contract``).

For each entry a backend provides, the function's parameters (names, kinds, defaults, in order) are those of the
Protocol's ``__call__`` without ``self``. The triton backend is loaded with the Triton interpreter active on a
machine without a GPU (``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` before triton is imported); loading a
backend runs no kernel.
"""

from __future__ import annotations

import inspect

import pytest

from gspo_kernels import backends
from gspo_kernels.backends.contract import ENTRIES, SequenceStage
from gspo_kernels.objectives.stage import gspo_objective

# Keywords a backend's function takes beyond the contract, named one by one (anything else that differs fails).
# Each is keyword-only with the default None, so a call written to the contract never passes it. None today: every
# backend takes exactly the contract's parameters (``leaves`` is the contract's, for every backend).
EXTRAS: dict = {}


def parameters(fn, method: bool = False) -> list:
    """``[(name, kind, default, type of the default)]`` of ``fn``'s parameters (``method``: without ``self``)."""
    params = list(inspect.signature(fn).parameters.values())
    if method:
        assert params[0].name == "self"
        params = params[1:]
    return [(p.name, p.kind, p.default, type(p.default)) for p in params]


def loaded(name: str):
    backend = backends.load(name)
    if backend is None:
        pytest.skip(f"backend {name!r} is not available here: {backends.unavailable_reason(name)}")
    return backend


@pytest.mark.parametrize("name", backends.BACKENDS)
def test_backend_entries_have_the_contract_signatures(name):
    backend = loaded(name)
    assert backend.logits_logprobs is not None and backend.linear_logprobs is not None, "the two required entries"
    checked = []
    for entry, protocol in ENTRIES.items():
        fn = getattr(backend, entry)
        if fn is None:
            continue
        expected = parameters(protocol.__call__, method=True)
        got = parameters(fn)
        extras = EXTRAS.get((name, entry), ())
        extra = [p for p in got if p[0] in extras]
        assert [p[0] for p in extra] == list(extras), f"{name}.{entry}: the extra keywords named in EXTRAS"
        for p_name, kind, default, _ in extra:
            assert kind is inspect.Parameter.KEYWORD_ONLY and default is None, f"{name}.{entry}: extra {p_name!r}"
        assert [p for p in got if p[0] not in extras] == expected, (
            f"backend {name!r}: {entry}{inspect.signature(fn)} is not the contract's "
            f"{protocol.__name__}{inspect.signature(protocol.__call__)}")
        checked.append(entry)
    assert checked[:2] == ["logits_logprobs", "linear_logprobs"]


def test_the_objective_protocol_is_gspo_objective():
    """A backend's ``objective`` replaces :func:`gspo_kernels.objectives.stage.gspo_objective`: the same parameters."""
    assert parameters(gspo_objective) == parameters(SequenceStage.__call__, method=True)


def test_every_backend_field_is_a_contract_entry():
    """The Backend's stage fields are the Protocols' entries, none more, none less."""
    fields = [p for p in inspect.signature(backends.Backend).parameters if p not in ("name", "supports")]
    assert sorted(fields) == sorted(ENTRIES)


def test_a_backend_receives_the_calls_options_object(monkeypatch):
    """The public function's checked options reach the backend's stage as one ``CallOptions``: the per-token
    function's keywords, and for a loss the config itself with its temperature and soft cap."""
    import torch

    import gspo_kernels as gk
    from gspo_kernels.options import CallOptions

    impl = backends.load("torch")
    seen = []
    for entry in ("logits_logprobs", "linear_logprobs"):
        real = getattr(impl, entry)

        def spy(*args, real=real, **keywords):  # keywords: the contract's keyword-only leaves
            seen.append(args[-1])
            return real(*args, **keywords)

        monkeypatch.setattr(impl, entry, spy)
    hidden, weight, labels = torch.randn(5, 4), torch.randn(7, 4), torch.randint(0, 7, (5,))
    gk.linear_logprobs(hidden, weight, labels, temperature=0.7, return_entropy=True, memory_budget=4096,
                       final_logit_softcapping=9.0, backend="torch")
    config = gk.GSPOConfig(temperature=1.3, final_logit_softcapping=11.0)
    logits = torch.randn(2, 3, 7)
    gk.gspo_loss(logits, torch.randint(0, 7, (2, 3)),
                 torch.tensor([1.0, -1.0]), config=config, backend="torch", inplace_backward=False)
    assert len(seen) == 2 and all(isinstance(options, CallOptions) for options in seen)
    first, second = seen
    assert (first.temperature, first.return_entropy, first.memory_budget, first.softcap) == (0.7, True, 4096, 9.0)
    assert first.config is None and first.backend == "torch"
    assert second.config is config and (second.temperature, second.softcap, second.return_entropy) == (1.3, 11.0, True)
