"""Bad input raises a clear error naming the argument, before any kernel runs."""

import dataclasses

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels import GSPOConfig

B, T, V, H = 2, 3, 11, 4


def padded(**over):
    kw = dict(logits=torch.randn(B, T, V), labels=torch.randint(0, V, (B, T)), advantages=torch.randn(B))
    kw.update(over)
    return kw


def call(**kw):
    logits, labels, adv = kw.pop("logits"), kw.pop("labels"), kw.pop("advantages")
    return gk.gspo_loss(logits, labels, adv, kw.pop("old_logprobs", None), backend="torch", **kw)


@pytest.mark.parametrize("over, error, words", [
    (dict(logits=torch.randn(B, T + 1, V)), ValueError, "logits must have shape"),
    (dict(logits=torch.randint(0, 5, (B, T, V))), TypeError, "logits must be a floating-point"),
    (dict(labels=torch.randn(B, T)), TypeError, "labels must be an integer"),
    (dict(labels=torch.full((B, T), V)), ValueError, "labels must lie in \\[0, 11\\)"),
    (dict(labels=torch.full((B, T), -1)), ValueError, "labels must lie"),
    (dict(advantages=torch.randn(B + 1)), ValueError, "advantages must be"),
    (dict(advantages=[1.0, 2.0]), TypeError, "advantages must be a torch.Tensor"),
    (dict(old_logprobs=torch.randn(B, T + 1)), ValueError, "old_logprobs must have the token shape"),
    (dict(mask=torch.ones(B, T + 1)), ValueError, "mask must have shape"),
    (dict(is_ratio=torch.ones(B + 2)), ValueError, "is_ratio must be"),
    (dict(ref_logprobs=torch.randn(1, T), config=GSPOConfig(beta=0.1)), ValueError, "ref_logprobs must have"),
    (dict(config=GSPOConfig(beta=0.1)), ValueError, "ref_logprobs is required"),
    (dict(config={"beta": 0.1}), TypeError, "config must be a GSPOConfig"),
    (dict(num_items_in_batch=0), ValueError, "num_items_in_batch must be a finite number > 0"),
    (dict(advantages=torch.randn(B, device="meta")), ValueError, "advantages is on meta"),
])
def test_padded_errors(over, error, words):
    with pytest.raises(error, match=words):
        call(**padded(**over))


def test_masked_labels_may_be_out_of_range():
    labels = torch.randint(0, V, (B, T))
    labels[0, 2] = -100
    mask = torch.ones(B, T)
    mask[0, 2] = 0
    out = call(**padded(labels=labels, mask=mask))
    assert torch.isfinite(out.loss)


def packed(cu, N=5, **over):
    kw = dict(logits=torch.randn(N, V), labels=torch.randint(0, V, (N,)), advantages=torch.randn(len(cu) - 1),
              cu_seqlens=cu)
    kw.update(over)
    return kw


@pytest.mark.parametrize("cu, error, words", [
    (torch.tensor([0.0, 2.0, 5.0]), TypeError, "cu_seqlens must be int32 or int64"),
    (torch.tensor([1, 2, 5], dtype=torch.int32), ValueError, "cu_seqlens must start at 0"),
    (torch.tensor([0, 3, 2, 5], dtype=torch.int32), ValueError, "cu_seqlens must be non-decreasing"),
    (torch.tensor([0, 2, 4], dtype=torch.int32), ValueError, "cu_seqlens must end at N = 5"),
    (torch.tensor([[0, 5]], dtype=torch.int32), ValueError, "cu_seqlens must be a 1-D"),
])
def test_packed_errors(cu, error, words):
    with pytest.raises(error, match=words):
        call(**packed(cu))


def test_layout_mismatch_errors():
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="labels must be \\[N\\] when cu_seqlens"):
        call(**padded(cu_seqlens=cu))
    with pytest.raises(ValueError, match="labels must be \\[B, T\\]"):
        call(**{k: v for k, v in packed(cu).items() if k != "cu_seqlens"})
    with pytest.raises(ValueError, match="advantages must be"):
        call(**packed(cu, advantages=torch.randn(3)))


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="max_completion_length is required"):
        GSPOConfig(loss_type="dr_grpo")
    for field, value in [("importance_sampling_level", "seq"), ("loss_type", "sum"), ("epsilon_low", -1.0),
                         ("epsilon_high", float("nan")), ("delta", 0.5), ("beta", -0.1), ("temperature", 0.0),
                         ("max_completion_length", 0), ("entropy_coef", float("inf"))]:
        with pytest.raises(ValueError, match=field):
            GSPOConfig(**{field: value})
    with pytest.raises(dataclasses.FrozenInstanceError):
        GSPOConfig().beta = 1.0  # frozen


def test_linear_errors():
    labels = torch.randint(0, V, (B, T))
    adv = torch.randn(B)
    with pytest.raises(ValueError, match="weight must be \\[V, H\\]"):
        gk.fused_linear_gspo_loss(torch.randn(B, T, H), torch.randn(V, H + 1), labels, adv, backend="torch")
    with pytest.raises(ValueError, match="hidden must have shape"):
        gk.fused_linear_gspo_loss(torch.randn(B * T, H), torch.randn(V, H), labels, adv, backend="torch")
    with pytest.raises(ValueError, match="bias must be \\[V\\]"):
        gk.fused_linear_gspo_loss(torch.randn(B, T, H), torch.randn(V, H), labels, adv, bias=torch.randn(V + 1),
                                  backend="torch")
    with pytest.raises(ValueError, match="weight is on meta"):
        gk.fused_linear_gspo_loss(torch.randn(B, T, H), torch.randn(V, H, device="meta"), labels, adv,
                                  backend="torch")
    with pytest.raises(ValueError, match="labels must lie"):
        gk.linear_logprobs(torch.randn(B, T, H), torch.randn(V, H), torch.full((B, T), V), backend="torch")
    with pytest.raises(ValueError, match="backend must be one of"):
        gk.token_logprobs(torch.randn(B, V), torch.zeros(B, dtype=torch.long), backend="cuda-magic")


# --- one rule per check: the same input gets the same answer from every entry point ----------


@pytest.mark.parametrize("temperature", [float("inf"), float("nan"), 0.0, -1.0, True, "1"])
def test_temperature_has_one_rule(temperature):
    x, y = torch.randn(2, V), torch.zeros(2, dtype=torch.long)
    rule = "temperature must be a finite number > 0"
    with pytest.raises(ValueError, match=rule):
        GSPOConfig(temperature=temperature)
    with pytest.raises(ValueError, match=rule):
        gk.token_logprobs(x, y, temperature=temperature, backend="torch")
    with pytest.raises(ValueError, match=rule):
        gk.linear_logprobs(torch.randn(2, H), torch.randn(V, H), y, temperature=temperature, backend="torch")


def test_call_options_hold_one_temperature_and_cap_the_configs():
    """A loss's options carry the config's temperature and soft cap, the one copy the stages read: options built
    with a config and another temperature or cap are refused, so the two can never disagree."""
    from gspo_kernels.options import CallOptions

    cfg = GSPOConfig(temperature=0.7, final_logit_softcapping=30)
    options = CallOptions(config=cfg, temperature=0.7, softcap=30)
    assert (options.temperature, options.softcap) == (0.7, 30.0) and type(options.softcap) is float
    for temperature, softcap in ((1.0, None), (0.7, None), (0.5, 30.0), (0.7, 29.0)):
        with pytest.raises(ValueError, match="must be the config's temperature 0.7 and final_logit_softcapping 30"):
            CallOptions(config=cfg, temperature=temperature, softcap=softcap)
    assert CallOptions(config=GSPOConfig()).temperature == 1.0  # the defaults agree with the default config


def test_label_range_has_one_rule():
    labels = torch.randint(0, V, (B, T))
    labels[1, 2] = V + 4  # flat position 5
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 11\) \(the vocabulary size\); flat position 5 "
                                         r"holds 15"):
        gk.token_logprobs(torch.randn(B, T, V), labels, backend="torch")
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 11\) .*; flat position 5 holds 15"):
        gk.linear_logprobs(torch.randn(B, T, H), torch.randn(V, H), labels, backend="torch")
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 11\) \(the vocabulary size\) at unmasked "
                                         r"positions; flat position 5 holds 15"):
        call(**padded(labels=labels))
    mask = torch.ones(B, T)
    mask[1, 2] = 0
    assert torch.isfinite(call(**padded(labels=labels, mask=mask)).loss)  # masked: never read


def test_beta_decides_whether_ref_logprobs_is_required():
    from gspo_kernels.layout import LossTensors, prepare_loss_inputs

    labels, adv = torch.randint(0, V, (B, T)), torch.randn(B)
    with pytest.raises(ValueError, match="ref_logprobs is required"):
        prepare_loss_inputs(labels, V, LossTensors(adv), beta=0.1)
    with pytest.raises(ValueError, match="ref_logprobs is required"):
        gk.gspo_loss(torch.randn(B, T, V), labels, adv, config=GSPOConfig(beta=0.1))
    assert prepare_loss_inputs(labels, V, LossTensors(adv)).ref_logprobs is None


def test_value_checks_read_the_device_once(monkeypatch):
    """Eager validation of valid inputs: all value rules (labels, mask, cu_seqlens, num_items_in_batch,
    finiteness) are read back with a single ``tolist`` and no other host read."""
    from gspo_kernels.layout import LossTensors, prepare_loss_inputs

    reads = []
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _n=name, _f=original, **k: (reads.append(_n),
                                                                                             _f(self, *a, **k))[1])
    N = 7
    labels, cu = torch.randint(0, V, (N,)), torch.tensor([0, 3, 3, 7])
    prepare_loss_inputs(labels, V, LossTensors(torch.randn(3), mask=torch.tensor([1, 1, 0, 1, 1, 1, 0]), cu_seqlens=cu,
                        old_logprobs=torch.randn(N), is_ratio=torch.rand(3), num_items_in_batch=torch.tensor(9.0)),
                        check_finite=True)
    assert reads == ["tolist"]


def test_token_to_response_index_stays_in_bounds_whatever_cu_seqlens_holds():
    """The guarantee behind torch.compile's asserts: even before a check fires, no index leaves [0, S)."""
    from gspo_kernels.checks import ValueChecks
    from gspo_kernels.layout import flatten_token_layout

    labels = torch.zeros(6, dtype=torch.long)
    for cu in ([0, 9, 2, 6], [3, 1, 2, 8], [0, 2, 4, 5], [-4, 0, 0, 100], [0, 0, 0, 0]):
        checks = ValueChecks()  # never run: the values are not checked
        batch = flatten_token_layout(labels, cu_seqlens=torch.tensor(cu), checks=checks)
        assert batch.seq_index.shape == (6,)
        assert int(batch.seq_index.min()) >= 0 and int(batch.seq_index.max()) < 3
        with pytest.raises(ValueError, match="cu_seqlens"):
            checks.run()


def test_seq_index_of_a_well_formed_layout():
    from gspo_kernels.layout import flatten_token_layout

    batch = flatten_token_layout(torch.zeros(6, dtype=torch.long), cu_seqlens=torch.tensor([0, 2, 2, 6]))
    assert batch.seq_index.tolist() == [0, 0, 2, 2, 2, 2]
    assert batch.cu_seqlens.dtype == torch.int32 and batch.num_seqs == 3


def test_padded_layout_kept_per_shape_is_never_an_inference_tensor():
    """The padded layout's ``cu_seqlens`` / ``seq_index`` are kept per ``(B, T, device)`` between calls, but not
    when built in inference mode: a later call with autograd (the torch backend saves ``seq_index`` for its
    backward) must still work, and every call sees the right boundaries."""
    from gspo_kernels.layout import flatten_token_layout

    shape = (3, 7)  # a shape no other test uses first
    labels = torch.randint(0, V, shape)
    with torch.inference_mode():
        first = flatten_token_layout(labels)
        gk.gspo_loss(torch.randn(*shape, V), labels, torch.randn(3), backend="torch")
    logits = torch.randn(*shape, V, requires_grad=True)
    gk.gspo_loss(logits, labels, torch.randn(3), backend="torch").loss.backward()
    again = flatten_token_layout(labels)
    assert not again.seq_index.is_inference() and not again.cu_seqlens.is_inference()
    for batch in (first, again, flatten_token_layout(labels)):
        assert batch.cu_seqlens.tolist() == [0, 7, 14, 21]
        assert batch.seq_index.tolist() == [0] * 7 + [1] * 7 + [2] * 7


@pytest.mark.parametrize("bad", [-1, V, V + 4, -(2 ** 62), 2 ** 62])
def test_label_range_rule_at_the_int64_extremes(bad):
    """The range rule (one floor division by V) catches a label far outside ``[0, V)`` as well as next to it."""
    labels = torch.randint(0, V, (B, T))
    labels[0, 1] = bad
    with pytest.raises(ValueError, match=rf"flat position 1 holds {bad}"):
        call(**padded(labels=labels))
