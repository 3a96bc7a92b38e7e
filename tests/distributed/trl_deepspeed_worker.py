"""Stock ``trl.GRPOTrainer`` and the drop-in under DeepSpeed ZeRO-3 and ZeRO-2, trained with ``train()``.

Launched by ``test_trl_deepspeed.py`` with ``accelerate launch`` (two processes, DeepSpeed's CPU accelerator, gloo),
as a TRL user launches it. For each run of :data:`RUNS` both trainers train the same tiny Qwen3 from the same seed for
:data:`STEPS` optimizer steps (two generations: ``steps_per_generation=2``, so the second step of each is
off-policy); rank 0 writes every trainer's logged rows. The DeepSpeed stage of a run is chosen by pointing accelerate
at its config file before its ``GRPOConfig`` is built (accelerate then builds a new DeepSpeed plugin from it).
"""

from __future__ import annotations

import json
import os
import sys

STEPS = 4
# name -> (ZeRO stage, GRPOConfig options of stock TRL, of the drop-in)
GSPO = dict(importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4)
DAPO = dict(importance_sampling_level="token", loss_type="dapo")
BNPO_KL = dict(importance_sampling_level="token", loss_type="bnpo", beta=0.04)  # a reference model under DeepSpeed too
RUNS = {
    "zero3/gspo": (3, GSPO, GSPO),
    # GSPO-token (the drop-in's "sequence_token", which stock TRL does not have): with one advantage per response and
    # loss_type="grpo" its value and gradient are GSPO's, so stock TRL's GSPO is the comparison
    "zero3/gspo_token": (3, GSPO, dict(GSPO, importance_sampling_level="sequence_token")),
    "zero3/gspo_one_pass": (3, GSPO, GSPO),  # the drop-in's loss inside the model's forward (gspo_one_pass=True)
    "zero3/grpo_dapo": (3, DAPO, DAPO),
    "zero3/grpo_bnpo_kl": (3, BNPO_KL, BNPO_KL),
    "zero2/gspo": (2, GSPO, GSPO),
    "zero2/grpo_dapo": (2, DAPO, DAPO),
}

SAME_STOCK_RUN = {"zero3/gspo_token": "zero3/gspo", "zero3/gspo_one_pass": "zero3/gspo"}


def ds_config(stage: int) -> dict:
    """The DeepSpeed config a TRL user passes (``"auto"`` filled from the ``GRPOConfig``)."""
    zero = {"stage": stage, "overlap_comm": False, "contiguous_gradients": True}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # partition even this tiny model's lm_head
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": zero}


def main(out_dir: str, policy_dir: str) -> None:
    from gspo_kernels.testing import setup_triton_interpreter

    setup_triton_interpreter()
    import torch.distributed as dist
    import trl

    from gspo_kernels.integrations.trl import GRPOTrainer
    from gspo_kernels.train.tasks import hf_tokenizer, trl_reward_function
    from tests.integrations.test_trl_integration import TASK, _dataset

    rows, shapes = {}, {}
    for name, (stage, stock_options, our_options) in RUNS.items():
        os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = os.path.join(out_dir, f"zero{stage}.json")
        for cls, options in ((trl.GRPOTrainer, stock_options), (GRPOTrainer, our_options)):
            who = "trl" if cls is trl.GRPOTrainer else "gspo_kernels"
            if name in SAME_STOCK_RUN and who == "trl":
                continue  # stock TRL's rows are those of another run
            args = trl.GRPOConfig(
                output_dir=os.path.join(out_dir, "out"), per_device_train_batch_size=4, num_generations=4,
                max_completion_length=TASK.max_new_tokens, max_steps=STEPS, steps_per_generation=2,
                learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[], bf16=False,
                disable_dropout=True, seed=0, ddp_backend="gloo", **options)
            extra = {"gspo_backend": "cpu", "gspo_one_pass": name.endswith("one_pass")} if who == "gspo_kernels" else {}
            trainer = cls(model=policy_dir, reward_funcs=trl_reward_function(TASK), train_dataset=_dataset(8),
                          args=args, processing_class=hf_tokenizer(), **extra)
            weight = trainer.model.lm_head.weight
            shapes[f"{name}/{who}"] = [tuple(weight.shape), tuple(getattr(weight, "ds_shape", weight.shape))]
            trainer.train()
            rows[f"{name}/{who}"] = [row for row in trainer.state.log_history if "loss" in row]
            del trainer
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "rows.json"), "w") as f:
            json.dump({"rows": rows, "lm_head_shapes": shapes}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
