"""GSPO from the hidden states under DeepSpeed ZeRO-3, in a training loop of your own.

The lm_head stays partitioned across the ranks between steps; ``fused_linear_gspo_loss`` takes
``model.lm_head.weight`` as it comes and gathers it for exactly as long as its kernels need it (in the forward, and
again in the backward until its gradient has reached DeepSpeed's reduce-scatter); the ``[B, T, V]`` logits never
exist. The model's forward is asked for its hidden states and the logits of one position only
(``logits_to_keep=1``).

Run it on two processes (on a machine without GPUs, DeepSpeed's CPU accelerator with gloo)::

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/deepspeed_zero3.py

A tiny random Qwen3 and random "rollouts" (prompts, completions of different lengths and rewards, a different batch
on each rank) stand in for your policy and your sampler; each rollout is used for ``--updates`` optimizer steps,
so the old log-probs matter from the second one on. ``--save PATH`` writes the trained parameters (gathered, on
rank 0), which the library's tests compare with the same steps taken in one process without DeepSpeed.
"""

from __future__ import annotations

import argparse
import os
from typing import Dict

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM  # before deepspeed.zero.Init, which patches tensor creation

import gspo_kernels as gk

VOCAB, HIDDEN, PROMPT, COMPLETION, GROUP, PROMPTS_PER_RANK = 384, 32, 6, 10, 4, 2
CONFIG = gk.GSPOConfig(importance_sampling_level="sequence", loss_type="grpo", epsilon_low=3e-4, epsilon_high=4e-4)


def build_policy(seed: int = 0):
    """A tiny random Qwen3 (the same weights for the same seed)."""
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=HIDDEN // 4,
                         max_position_embeddings=64, tie_word_embeddings=False)
    return Qwen3ForCausalLM(config)


def rollout(rank: int, index: int) -> Dict[str, torch.Tensor]:
    """Rank ``rank``'s ``index``-th batch: prompts, completions (right-padded), their mask and group advantages."""
    g = torch.Generator().manual_seed(1000 * index + rank)
    n = PROMPTS_PER_RANK * GROUP
    prompts = torch.randint(1, VOCAB, (PROMPTS_PER_RANK, PROMPT), generator=g).repeat_interleave(GROUP, 0)
    completions = torch.randint(1, VOCAB, (n, COMPLETION), generator=g)
    lengths = torch.randint(1, COMPLETION + 1, (n,), generator=g)
    mask = (torch.arange(COMPLETION) < lengths[:, None]).float()
    rewards = torch.rand(n, generator=g).round()
    return dict(input_ids=torch.cat([prompts, completions * mask.long()], 1), completion_ids=completions,
                completion_mask=mask, advantages=gk.group_advantages(rewards, GROUP))


def completion_hidden(model, batch) -> torch.Tensor:
    """The last hidden states at the positions that predict the completion tokens ``[B, C, H]``."""
    attention = torch.cat([torch.ones(batch["input_ids"].shape[0], PROMPT), batch["completion_mask"]], 1)
    out = model(input_ids=batch["input_ids"], attention_mask=attention, logits_to_keep=1, output_hidden_states=True)
    return out.hidden_states[-1][:, PROMPT - 1:-1]


def old_logprobs(model, lm_head, batch, backend: str = "auto") -> torch.Tensor:
    """The sampling policy's log-probs (before this rollout's updates), through the same function as the loss."""
    with torch.no_grad():
        return gk.linear_logprobs(completion_hidden(model, batch), lm_head.weight, batch["completion_ids"],
                                  bias=lm_head.bias, backend=backend)


def gspo_loss(model, lm_head, batch, old: torch.Tensor, backend: str = "auto") -> gk.LossOutput:
    """GSPO from the hidden states and the lm_head weight as it is: partitioned under ZeRO-3."""
    return gk.fused_linear_gspo_loss(completion_hidden(model, batch), lm_head.weight, batch["completion_ids"],
                                     batch["advantages"], old, bias=lm_head.bias, mask=batch["completion_mask"],
                                     config=CONFIG, backend=backend)


def train(rollouts: int = 2, updates: int = 2, lr: float = 3e-4, backend: str = "auto") -> Dict[str, torch.Tensor]:
    """The training loop under ZeRO-3 (the process group up); returns the trained parameters, gathered."""
    import deepspeed

    rank = torch.distributed.get_rank()
    ds_config = {
        "train_micro_batch_size_per_gpu": PROMPTS_PER_RANK * GROUP,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},  # partition even this tiny head
        "optimizer": {"type": "SGD", "params": {"lr": lr}},  # plain SGD: steps comparable in one process
        "gradient_clipping": 1.0,  # (DeepSpeed's default) of the global norm, over the ranks' averaged gradients
        "zero_allow_untested_optimizer": True,
    }
    # every rank builds the same weights; deepspeed.initialize partitions them. (A large model: keep a
    # transformers.integrations.HfDeepSpeedConfig(ds_config) alive, then from_pretrained loads it partitioned.)
    model = build_policy()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    lm_head = engine.module.lm_head
    for index in range(rollouts):
        batch = rollout(rank, index)
        old = old_logprobs(engine, lm_head, batch, backend)
        for _ in range(updates):
            out = gspo_loss(engine, lm_head, batch, old, backend)
            engine.backward(out.loss)
            engine.step()
            clipped = out.metrics["clip_ratio/region_mean"].item()
            print(f"rank {rank} rollout {index} loss {out.loss.item():+.6f} clipped {clipped:.3f} "
                  f"lm_head {tuple(lm_head.weight.shape)} of {tuple(lm_head.weight.ds_shape)}", flush=True)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {name: p.detach().clone() for name, p in engine.module.named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=2, help="rollouts (batches) per rank (default 2)")
    parser.add_argument("--updates", type=int, default=2, help="optimizer steps per rollout (default 2)")
    parser.add_argument("--lr", type=float, default=3e-4, help="SGD learning rate (default 3e-4)")
    parser.add_argument("--backend", default="auto", help="gspo_kernels backend (default auto)")
    parser.add_argument("--save", default=None, help="write the trained parameters here (rank 0)")
    args = parser.parse_args()

    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    state = train(args.rollouts, args.updates, args.lr, args.backend)
    if args.save and torch.distributed.get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.save)), exist_ok=True)
        torch.save(state, args.save)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
