"""The TRL drop-in against stock TRL 1.16: one old-log-prob pass and one loss step, time and peak memory.

    python benchmarks/trl_step.py                     # every case, each in a fresh process; prints a table
    python benchmarks/trl_step.py --case gspo --precision bf16   # one case (what the driver runs)

Shape: hidden 896, vocabulary 151936 (Qwen2.5-0.5B's head), 8 completions x 256 tokens after 16-token
prompts. The policy is a 1-layer Qwen3 with a narrow MLP so that the head dominates, as it does for a
0.5B model's loss step. lm_head logits spread like a trained model's (std ~4).

Measured per case, in a fresh process, after the model and inputs exist:
- ``old``: ``_get_per_token_logps_and_entropies`` under ``torch.no_grad`` (TRL's old-log-prob pass);
- ``step``: ``_compute_loss`` + ``backward`` on the same batch (the old log-probs as inputs, so the
  first mini-batch of a generation: every weight 1, nothing clipped, no row skipped).
- ``peak``: the process's peak RSS during old + step minus its RSS before them (Linux ``VmHWM``, reset
  through ``/proc/self/clear_refs``): it includes the lm_head's weight gradient (V*H*4 = 0.54 GB), which
  both implementations must produce.

``fp32``: GRPOConfig(bf16=False). ``bf16``: GRPOConfig's default bf16=True (autocast bf16 on an fp32
policy). Timings on a shared machine are noisy: compare ratios from one run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

H, V, B, P, C = 896, 151936, 8, 16, 256


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def run_case(case: str, precision: str, backend: str, memory_budget: str = "drop-in") -> dict:
    import torch
    import trl
    from datasets import Dataset
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from gspo_kernels.integrations.trl import GRPOTrainer
    from gspo_kernels.train.tasks import hf_tokenizer

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=V, hidden_size=H, intermediate_size=H, num_hidden_layers=1, num_attention_heads=14,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=512, tie_word_embeddings=False,
    ))
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 4.0 / math.sqrt(H))
    args = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=B, num_generations=B, max_completion_length=C,
        report_to=[], use_cpu=True, bf16=(precision == "bf16"), importance_sampling_level="sequence",
        epsilon=3e-4, epsilon_high=4e-4, loss_type="grpo",
    )
    cls = trl.GRPOTrainer if case == "trl" else GRPOTrainer
    extra = {} if case == "trl" else {"gspo_backend": backend}
    if case != "trl" and memory_budget != "drop-in":
        extra["gspo_memory_budget"] = None if memory_budget == "none" else int(memory_budget)
    trainer = cls(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                  train_dataset=Dataset.from_dict({"prompt": ["1 2 3"] * B}), processing_class=hf_tokenizer(), **extra)
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(0, V, (B, P), generator=g)
    completion_ids = torch.randint(0, V, (B, C), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    completion_mask = torch.ones(B, C, dtype=torch.long)
    ids = torch.cat([prompt_ids, completion_ids], 1)
    attn = torch.cat([prompt_mask, completion_mask], 1)
    advantages = torch.randn(B, generator=g)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1

    before = _rss_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    t0 = time.perf_counter()
    with torch.no_grad():
        old, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attn, C, batch_size=B)
    t1 = time.perf_counter()
    inputs = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                  completion_mask=completion_mask, advantages=advantages, old_per_token_logps=old,
                  num_items_in_batch=completion_mask.sum().float())
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    t2 = time.perf_counter()
    peak = _rss_kb("VmHWM")
    weights = trainer._metrics["train"]
    return dict(case=case, precision=precision, old_s=t1 - t0, step_s=t2 - t1, total_s=t2 - t0,
                peak_mb=(peak - before) / 1024, loss=loss.item(), threads=torch.get_num_threads(),
                weight_min=weights["importance_weight/min"][-1] if "importance_weight/min" in weights else None,
                weight_max=weights["importance_weight/max"][-1] if "importance_weight/max" in weights else None,
                clip=weights["clip_ratio/region_mean"][-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=("trl", "gspo"))
    parser.add_argument("--precision", choices=("fp32", "bf16"))
    parser.add_argument("--backend", default="auto", help="gspo_kernels backend for the drop-in (default auto)")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--memory-budget", default="drop-in",
                        help="the drop-in's gspo_memory_budget in bytes, 'none' for the library default, or 'drop-in' "
                        "(the drop-in's own default)")
    opts = parser.parse_args()
    if opts.case:
        print(json.dumps(run_case(opts.case, opts.precision, opts.backend, opts.memory_budget)))
        return
    rows = []
    for precision in opts.precisions.split(","):
        for case in ("trl", "gspo"):  # a fresh process per case
            cmd = [sys.executable, __file__, "--case", case, "--precision", precision, "--backend", opts.backend,
                   "--memory-budget", opts.memory_budget]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ.copy())
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{'precision':9} {'case':5} {'old s':>7} {'step s':>7} {'total s':>8} {'peak MB':>8} {'loss':>10} "
          f"{'w min':>9} {'w max':>9} {'clip':>5}")
    for r in rows:
        wmin = "-" if r["weight_min"] is None else f"{r['weight_min']:.6f}"
        wmax = "-" if r["weight_max"] is None else f"{r['weight_max']:.6f}"
        print(f"{r['precision']:9} {r['case']:5} {r['old_s']:7.2f} {r['step_s']:7.2f} {r['total_s']:8.2f} "
              f"{r['peak_mb']:8.0f} {r['loss']:10.6f} {wmin:>9} {wmax:>9} {r['clip']:5.2f}")
    for precision in opts.precisions.split(","):
        trl_row, ours = (next(r for r in rows if r["precision"] == precision and r["case"] == c) for c in ("trl", "gspo"))
        print(f"{precision}: drop-in / TRL: time {ours['total_s'] / trl_row['total_s']:.2f}x "
              f"(old {ours['old_s'] / trl_row['old_s']:.2f}x, step {ours['step_s'] / trl_row['step_s']:.2f}x), "
              f"peak memory {ours['peak_mb'] / trl_row['peak_mb']:.2f}x")


if __name__ == "__main__":
    main()
