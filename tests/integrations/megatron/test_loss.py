"""``integrations.megatron.fused_linear_gspo_loss`` with tensor parallelism (2 gloo processes, TP=2), against the
library's one-process loss on the full weight and against megatron's own logits path.

One launch runs every config of ``tests.support.configs()`` and ``objective_configs()`` (every level, loss type and
objective, the optional terms mixed) in megatron's padded layout (``hidden [S, B, H]``, ``labels [B, S]``) and its
packed ``thd`` layout (``hidden [T, 1, H]``, ``labels [1, T]``, ``cu_seqlens``), on a ``ColumnParallelLinear`` output
layer (64 vocabulary rows, 32 each). The inputs are :func:`tests.support.make_case`'s (the designed responses clip,
mask and bite for every config). Each rank returns its errors; the tests check them.

The one-process reference is ``gspo_kernels.fused_linear_gspo_loss`` on the gathered weight ``[64, H]`` (``[B, S, H]``
/ ``[T, H]`` hidden states). Megatron's path: the layer's own logits shard, megatron's ``vocab_parallel_cross_entropy``
for the log-probs (the temperature applied to the logits first), the entropy of the logits gathered by megatron's
``gather_from_tensor_model_parallel_region``, and ``gspo_kernels.policy_loss`` for the sequence stage.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.integrations.megatron.harness import column_parallel_head, run_ranks
from tests.support import RTOL, configs, make_case, objective_configs, objective_id, rel_err

V, H = 64, 32
CONFIGS = configs() + objective_configs()


def _full_weight(head) -> torch.Tensor:
    parts = [torch.empty_like(head.weight) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, head.weight.detach().contiguous())
    return torch.cat(parts)


def _case(config, packed: bool, weight: torch.Tensor, seed: int):
    """A case and its hidden states ``[B, T, H]`` / ``[N, H]`` (the same on every rank)."""
    from gspo_kernels import reference

    torch.manual_seed(seed)
    hidden = None

    def logp_of(labels):
        nonlocal hidden
        hidden = torch.randn(*labels.shape, H)
        return reference.linear_logprobs(hidden, weight, labels, temperature=config.temperature,
                                         final_logit_softcapping=config.final_logit_softcapping)

    case = make_case(logp_of, V, packed=packed, per_token_adv=packed)
    return case, hidden


def _megatron_layout(t, packed: bool, tokens: int = -1):
    """A token tensor of the library's layout (``[B, T]`` / ``[N]``, ``N = tokens``) in megatron's (``[B, T]`` /
    ``[1, N]``); per-response tensors and ``cu_seqlens`` as they are."""
    if t is None or not packed or tuple(t.shape) != (tokens,):
        return t
    return t[None]


def _megatron_logits_loss(head, hidden_sbh, labels, kwargs, config):
    """Megatron's logits path: the layer's logits shard, its cross entropy, the library's sequence stage."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region, vocab_parallel_cross_entropy

    logits = head(hidden_sbh)[0].transpose(0, 1).float()  # [B, S, V / tp]
    if config.final_logit_softcapping is not None:
        c = config.final_logit_softcapping
        logits = c * torch.tanh(logits / c)
    logits = logits / config.temperature
    counted = kwargs["mask"] != 0
    safe = torch.where(counted, labels, torch.zeros_like(labels))
    logp = -vocab_parallel_cross_entropy(logits.contiguous().clone(), safe)
    full = torch.log_softmax(gather_from_tensor_model_parallel_region(logits), dim=-1)
    entropy = -(full.exp() * full).sum(-1)
    return logp, entropy


def _tp_case(index: int, config, packed: bool, head, weight_full) -> dict:
    import gspo_kernels as gk
    from gspo_kernels.integrations import megatron as gm

    case, hidden = _case(config, packed, weight_full, seed=100 + index)
    kw = case.kwargs(config.beta > 0, config)
    rank = dist.get_rank()
    shard = slice(rank * (V // 2), (rank + 1) * (V // 2))

    # one process, the full weight
    h_ref = hidden.clone().requires_grad_(True)
    w_ref = weight_full.clone().requires_grad_(True)
    ref = gk.fused_linear_gspo_loss(h_ref, w_ref, case.labels, case.advantages, case.old_logprobs, config=config, **kw)
    ref.loss.backward()

    # megatron's layout on the tensor-parallel head
    N = case.labels.numel()
    meg = {k: _megatron_layout(v, packed, N) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    labels = _megatron_layout(case.labels, packed, N)
    h_sbh = (hidden[:, None] if packed else hidden.transpose(0, 1)).contiguous().requires_grad_(True)
    logprobs_out = torch.zeros(labels.shape)
    out = gm.fused_linear_gspo_loss(h_sbh, head, labels, _megatron_layout(case.advantages, packed, N),
                                    _megatron_layout(case.old_logprobs, packed, N), config=config,
                                    logprobs_out=logprobs_out, **meg)
    out.loss.backward()
    dh = (h_sbh.grad[:, 0] if packed else h_sbh.grad.transpose(0, 1))
    dw = head.weight.grad.clone()
    errors = {"loss": abs(out.loss.item() - ref.loss.item()) / max(abs(ref.loss.item()), 1.0),
              "dH": rel_err(dh, h_ref.grad), "dW": rel_err(dw, w_ref.grad[shard]),
              "metrics": _metric_errors(out.metrics, ref.metrics)}
    head.weight.grad = None
    # the log-probs it kept: the one-process log-probs at the counted tokens, 0 elsewhere
    want = gk.linear_logprobs(hidden, weight_full, case.labels.clamp(min=0), temperature=config.temperature,
                              final_logit_softcapping=config.final_logit_softcapping)
    want = torch.where(case.mask != 0, want, 0)
    errors["logprobs_out"] = rel_err(logprobs_out.reshape(want.shape), want)

    # megatron's logits path
    h_meg = h_sbh.detach().clone().requires_grad_(True)
    logp, entropy = _megatron_logits_loss(head, h_meg, labels, meg, config)
    meg_out = gk.policy_loss(logp.reshape(case.labels.shape), case.advantages, case.old_logprobs,
                             entropy=entropy.reshape(case.labels.shape), config=config, **kw)
    meg_out.loss.backward()
    errors["megatron_loss"] = abs(out.loss.item() - meg_out.loss.item()) / max(abs(meg_out.loss.item()), 1.0)
    errors["megatron_dH"] = rel_err(h_sbh.grad, h_meg.grad)
    errors["megatron_dW"] = rel_err(dw, head.weight.grad)
    head.weight.grad = None
    return errors


def _metric_errors(got: dict, want: dict) -> float:
    missing = set(want) - set(got)
    if missing:
        return float("inf")
    return max((abs(float(got[k]) - float(v)) / max(1.0, abs(float(v))) for k, v in want.items()), default=0.0)


def _checks(rank: int) -> dict:
    head = column_parallel_head(V, H, seed=21)
    with torch.no_grad():
        head.weight.mul_(0.3)  # logits of a few units
    weight_full = _full_weight(head)
    results = {}
    for i, config in enumerate(CONFIGS):
        for packed in (False, True):
            results[(objective_id(config), packed)] = _tp_case(i, config, packed, head, weight_full)
    return results


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_checks, world=2, tp=2)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "thd"])
def test_tensor_parallel_loss_matches_one_process_on_the_full_weight(ranks, packed):
    for rank, result in enumerate(ranks):
        for (name, is_packed), errors in result.items():
            if is_packed != packed:
                continue
            for key in ("loss", "dH", "dW", "metrics", "logprobs_out"):
                assert errors[key] < RTOL, (rank, name, key, errors[key])


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "thd"])
def test_tensor_parallel_loss_matches_megatron_logits_path(ranks, packed):
    for rank, result in enumerate(ranks):
        for (name, is_packed), errors in result.items():
            if is_packed == packed:
                for key in ("megatron_loss", "megatron_dH", "megatron_dW"):
                    assert errors[key] < RTOL, (rank, name, key, errors[key])
