"""The multi-process OpenRLHF cases of ``test_openrlhf_distributed.py``, run as a script under ``torchrun
--nproc_per_node 2`` (gloo; DeepSpeed's CPU accelerator): ``python tests/integrations/openrlhf_workers.py MODE OUT_DIR``.

Each rank runs OpenRLHF's ``Actor`` and the library's side by side and writes, to ``OUT_DIR/MODE{rank}.json``, the
largest differences between them (relative to the largest entry of OpenRLHF's): action log-probs, entropies and the
parameters after the trainer's steps or their gradients.

- ``ring``: packed samples under a ring-attention group of both ranks (OpenRLHF's ``unpad_and_slice_tensor`` gives
  each rank a slice of the packed tokens, its ``gather_and_pad_tensor`` all-gathers the per-token results; attention
  stays local to a rank's slice here, see tests/integrations/stubs), the same batch on both ranks, parameters' gradients;
- ``zero2`` / ``zero3`` (``-tied``: the lm_head tied to the embeddings, as Qwen2.5-0.5B's): each actor's model in
  a DeepSpeed engine of that ZeRO stage (OpenRLHF's ``Actor.model`` is the engine), each rank its own batch, two SGD steps of the
  trainer's use (log-probs and entropy in the loss, the old log-probs under ``no_grad`` first), then the parameters
  (gathered) compared; ``partitioned``: the lm_head's weight was partitioned between its uses.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
STEPS, LR = 2, 0.05


def _step_loss(actor, sequences, attention_mask, action_mask, ring_group=None):
    """The trainer's use of the actor: the action log-probs and the entropy, each weighted (fixed weights)."""
    logp, output = actor(sequences, action_mask, attention_mask=attention_mask, return_output=True,
                         ring_attn_group=ring_group, return_entropy=True)
    g = torch.Generator().manual_seed(7)
    loss = (logp * torch.randn(logp.shape, generator=g)).sum()
    loss = loss + (output.entropy[:, -action_mask.shape[1]:] * action_mask * torch.randn(action_mask.shape,
                                                                                         generator=g)).sum()
    return loss, logp.detach(), output.entropy.detach()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp(min=1e-30))


def ring(gko, models, rank: int) -> dict:
    import torch.distributed as dist
    from openrlhf.models.ring_attn_utils import set_ring_attn_group

    from tests.integrations.openrlhf_env import tiny_causal_lm
    from tests.integrations.test_openrlhf import _rollout_batch

    group = dist.new_group([0, 1])
    set_ring_attn_group(group)
    torch.manual_seed(0)  # the same model and batch on both ranks
    model = tiny_causal_lm()
    sequences, attention_mask, action_mask = _rollout_batch(model.config.vocab_size)
    results = {}
    for name, actor in (("theirs", models.Actor(model, temperature=0.7)),
                        ("ours", gko.Actor(model, temperature=0.7, gspo_backend="cpu"))):
        actor.packing_samples = True
        model.zero_grad(set_to_none=True)
        loss, logp, entropy = _step_loss(actor, sequences, attention_mask, action_mask, ring_group=group)
        loss.backward()
        results[name] = (logp, entropy, {n: p.grad.clone() for n, p in model.named_parameters()})
    (logp, entropy, grads), (want_logp, want_entropy, want_grads) = results["ours"], results["theirs"]
    return {"logp": _rel(logp, want_logp), "entropy": _rel(entropy, want_entropy),
            "grads": max(_rel(grads[n], want_grads[n]) for n in want_grads)}


def zero(gko, models, rank: int, stage: int, tied: bool) -> dict:
    import deepspeed

    from tests.integrations.openrlhf_env import tiny_causal_lm
    from tests.integrations.test_openrlhf import _rollout_batch

    torch.manual_seed(0)
    base = tiny_causal_lm(tie_word_embeddings=tied)
    config = {"train_micro_batch_size_per_gpu": 3, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_allow_untested_optimizer": True}
    out = {}
    for name, make in (("theirs", lambda m: models.Actor(m, temperature=0.7)),
                       ("ours", lambda m: gko.Actor(m, temperature=0.7, gspo_backend="cpu"))):
        model = copy.deepcopy(base)
        actor = make(model)
        actor.packing_samples = False
        actor.model, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        # under ZeRO-3 the head is partitioned between its uses (where the library reads it)
        partitioned = tuple(actor.model.module.lm_head.weight.shape) == (0,)
        torch.manual_seed(100 + rank)  # each rank its own batches
        first = None
        for _ in range(STEPS):
            sequences, attention_mask, action_mask = _rollout_batch(base.config.vocab_size)
            with torch.no_grad():  # the old log-probs, as the experience maker takes them
                old = actor(sequences, action_mask, attention_mask=attention_mask)
            loss, logp, entropy = _step_loss(actor, sequences, attention_mask, action_mask)
            first = first or (old, logp, entropy)
            actor.model.backward(loss)
            actor.model.step()
        with deepspeed.zero.GatheredParameters(list(actor.model.module.parameters()), enabled=stage == 3):
            params = {n: p.detach().clone() for n, p in actor.model.module.named_parameters()}
        out[name] = (first, params)
    (first, params), (want_first, want_params) = out["ours"], out["theirs"]
    initial = {n: p.detach() for n, p in base.named_parameters()}
    moved = max(float((want_params[n] - initial[n]).abs().max()) for n in want_params)
    return {"partitioned": partitioned, "old": _rel(first[0], want_first[0]), "logp": _rel(first[1], want_first[1]),
            "entropy": _rel(first[2], want_first[2]), "moved": moved,
            "params": max(float((params[n] - want_params[n]).abs().max()) for n in want_params)}


def main(modes: str, out_dir: str) -> None:
    """Each of the comma-separated ``modes`` in turn, in the same two processes (one launch)."""
    sys.path.insert(0, str(ROOT))
    from gspo_kernels.testing import setup_triton_interpreter

    setup_triton_interpreter()
    import deepspeed
    import torch._dynamo

    from tests.integrations.openrlhf_env import openrlhf_importable

    torch._dynamo.config.disable = True  # OpenRLHF's compute_entropy eagerly (as in test_openrlhf.py)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    with openrlhf_importable():
        import openrlhf.models as models

        from gspo_kernels.integrations import openrlhf as gko

        for mode in modes.split(","):
            if mode == "ring":
                result = ring(gko, models, rank)
            else:  # zero2, zero3: the lm_head its own parameter; zero2-tied, zero3-tied: the embeddings'
                result = zero(gko, models, rank, int(mode[4]), tied=mode.endswith("-tied"))
            with open(os.path.join(out_dir, f"{mode}{rank}.json"), "w") as f:
                json.dump(result, f)
            torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
