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
