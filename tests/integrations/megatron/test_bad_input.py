"""Bad input to ``integrations.megatron`` raises the same ``ValueError`` on every tensor-parallel rank, naming the
argument, even when only one rank's input is bad (2 gloo processes, TP=2, one launch under a deadline: a rank left
waiting in a collective fails the launch instead of blocking the suite).

Each case runs on both ranks; each rank returns its message (or "no error"). After every bad case both ranks run a
good call together, which would hang or fail if a bad case had left a rank behind in a collective.
"""

from __future__ import annotations

import pytest
import torch

from tests.integrations.megatron.harness import column_parallel_head, run_ranks

V, H, B, S = 64, 16, 2, 6
# Alone on the development machine the launch takes ~10 s; a hang fails it after this.
DEADLINE_S = 180


def _message(fn) -> str:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return "no error"


def _inputs(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(S, B, H, generator=gen), torch.randint(0, V, (B, S), generator=gen)


def _good_call(head) -> float:
    from gspo_kernels.integrations import megatron as gm

    hidden, labels = _inputs(9)
    return float(gm.linear_logprobs(hidden, head, labels).sum())


def _checks(rank: int) -> dict:
    from gspo_kernels.integrations import megatron as gm

    head = column_parallel_head(V, H, seed=3)
    sp_head = column_parallel_head(V, H, sequence_parallel=True, seed=3)
    hidden, labels = _inputs()
    results = {}

    def case(name, fn):
        results[name] = _message(fn)
        results[name + "/then_good"] = _good_call(head)

    bad_labels = labels.clone()
    if rank == 0:
        bad_labels[1, 2] = V  # one rank, one position, just past the vocabulary
    case("labels_one_rank", lambda: gm.linear_logprobs(hidden, head, bad_labels))
    case("labels_negative", lambda: gm.linear_logprobs(hidden, head, labels - 1 - labels.max()))
    adv, old = torch.ones(B), torch.zeros(B, S)
    case("loss_labels", lambda: gm.fused_linear_gspo_loss(hidden, head, bad_labels, adv, old))
    masked = bad_labels.clone()
    masked[1, 2] = -100
    mask = torch.ones(B, S)
    mask[1, 2] = 0
    case("loss_masked_garbage_is_fine", lambda: gm.fused_linear_gspo_loss(hidden, head, masked, adv, old, mask=mask))

    short = hidden[:-1] if rank == 1 else hidden
    case("hidden_length_one_rank", lambda: gm.linear_logprobs(short, head, labels))
    case("hidden_width", lambda: gm.linear_logprobs(hidden[..., :-1], head, labels))
    # a sequence-parallel head: each rank passes S / 2 positions; passing all S is the mistake
    case("hidden_sequence_parallel", lambda: gm.linear_logprobs(hidden, sp_head, labels))
    half = hidden.chunk(2, dim=0)[rank]
    case("sequence_parallel_good", lambda: gm.linear_logprobs(half, sp_head, labels))

    misfit = column_parallel_head(V, H, seed=3)
    if rank == 1:
        misfit.weight = torch.nn.Parameter(misfit.weight.detach()[:-2].clone())
    case("head_one_rank", lambda: gm.linear_logprobs(hidden, misfit, labels))
    return results


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_checks, world=2, tp=2, timeout=DEADLINE_S)


@pytest.mark.parametrize("name, argument, words", [
    ("labels_one_rank", "labels", ("rank 0", "[0, 64)")),
    ("labels_negative", "labels", ("[0, 64)",)),
    ("loss_labels", "labels", ("rank 0", "counted positions")),
    ("hidden_length_one_rank", "hidden", ("rank 1", "5 positions", "[2, 6]")),
    ("hidden_width", "hidden", ("hidden size is 15", "[32, 16]")),
    ("hidden_sequence_parallel", "hidden", ("12 positions", "[S / tp, B, H]")),
    ("head_one_rank", "head", ("rank 1", "30 vocabulary rows", "does not fit the parallel state")),
])
def test_bad_input_raises_the_same_error_naming_the_argument_on_every_rank(ranks, name, argument, words):
    messages = [result[name] for result in ranks]
    assert messages[0] == messages[1], messages
    assert messages[0].startswith(f"{argument}: "), messages[0]
    for word in words:
        assert word in messages[0], (word, messages[0])


def test_ranks_stay_in_step_after_each_bad_input(ranks):
    good = [v for k, v in ranks[0].items() if k.endswith("/then_good")]
    assert len(good) == 9 and len(set(good)) == 1
    assert all(ranks[1][k] == v for k, v in ranks[0].items() if k.endswith("/then_good"))


def test_garbage_labels_at_masked_positions_and_a_sequence_parallel_slice_are_accepted(ranks):
    for result in ranks:
        assert result["loss_masked_garbage_is_fine"] == "no error"
        assert result["sequence_parallel_good"] == "no error"
