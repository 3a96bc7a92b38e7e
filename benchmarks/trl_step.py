"""The TRL drop-in against stock TRL 1.16: one old-log-prob pass and one loss step, time and peak memory.

    python benchmarks/trl_step.py                     # every case, each in a fresh process; prints a table
    python benchmarks/trl_step.py --case gspo --precision bf16   # one case (what the driver runs)
    python benchmarks/trl_step.py --device cuda --precisions bf16  # on the GPU, at the client shape

Shapes (``--shape``; the default follows ``--device``):
- ``cpu`` (the CPU default): hidden 896, vocabulary 151936 (Qwen2.5-0.5B's head), 8 completions x 256 tokens
  after 16-token prompts. The policy is a 1-layer Qwen3 with a narrow MLP so that the head dominates, as it
  does for a 0.5B model's loss step.
- ``client`` (the CUDA default): the client shape: Qwen3 architecture (Qwen3-1.7B's layer
  widths), 2 layers, hidden 2048, vocabulary 151936 with an untied head, 8 completions x 1024 tokens after
  64-token prompts.
- ``tiny``: a smoke test of the code path (hidden 64, vocabulary 512, 2 x 16 tokens); not a measurement.
- ``client-small``: the client shape with the hidden size, the vocabulary and the tokens divided by 8 (hidden
  256, vocabulary 18992, 8 x 128 completions after 8-token prompts): ``benchmarks/memory_trace.py``'s shape.
lm_head logits spread like a trained model's (std ~4). GSPO sequence level, eps 3e-4 / 4e-4, loss_type grpo.

Measured per case, in a fresh process, after the model and inputs exist:
- ``old``: ``_get_per_token_logps_and_entropies`` under ``torch.no_grad`` (TRL's old-log-prob pass);
- ``step``: ``_compute_loss`` + ``backward`` on the same batch (the old log-probs as inputs, so the
  first mini-batch of a generation: every weight 1, nothing clipped, no row skipped).
- ``peak``: on CPU, the process's peak RSS during old + step minus its RSS before them (Linux ``VmHWM``,
  reset through ``/proc/self/clear_refs``): it includes the lm_head's weight gradient (V*H*4 = 0.54 GB),
  which both implementations must produce. On CUDA, ``torch.cuda.max_memory_allocated`` above the
  allocation at the step's start (the step alone; the gradients the backward creates count).

On CPU each is measured once (no warm-up: the historical protocol of this script). On CUDA, after one
warm-up (old pass + step: Triton compilation), ``old`` and ``step`` are the medians of ``--repeats`` (3)
timed with CUDA events, the gradients set to None before each step.

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

SHAPES = {
    # H, V, B (completions), P (prompt tokens), C (completion tokens), layers, intermediate, heads, kv heads, head_dim
    "cpu": dict(H=896, V=151936, B=8, P=16, C=256, layers=1, inter=896, heads=14, kv=2, head_dim=64),
    "client": dict(H=2048, V=151936, B=8, P=64, C=1024, layers=2, inter=6144, heads=16, kv=8, head_dim=128),
    "tiny": dict(H=64, V=512, B=2, P=4, C=16, layers=1, inter=64, heads=2, kv=1, head_dim=32),
    # the client shape with H, V and the tokens each divided by 8 (the head's V x H, the hidden states' N x H and
    # the chunk buffers' rows x V all 1/64 of the client's; the layers' H x H weights 1/64 too, their H x inter
    # ones as well): benchmarks/memory_trace.py's reduced shape
    "client-small": dict(H=256, V=18992, B=8, P=8, C=128, layers=2, inter=768, heads=2, kv=1, head_dim=128),
}
H, V, B, P, C = (SHAPES["cpu"][k] for k in ("H", "V", "B", "P", "C"))  # the CPU shape (kept for importers)


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def build_case(case: str, precision: str, backend: str, memory_budget: str = "drop-in", device: str = "cpu",
               shape: str = "", one_pass: bool = False):
    """One trainer (``case``: ``"trl"`` stock, ``"gspo"`` the drop-in) on ``device`` and its batch:
    ``(trainer, old_pass, step, shape)``; ``old_pass()`` returns the old log-probs, ``step(old)`` runs
    ``_compute_loss`` and ``backward`` and returns the loss."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from gspo_kernels.integrations.trl import GRPOTrainer
    from gspo_kernels.train.tasks import hf_tokenizer

    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    shape = shape or ("client" if cuda else "cpu")
    sh = SHAPES[shape]
    h, v, b, p, c = sh["H"], sh["V"], sh["B"], sh["P"], sh["C"]
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=v, hidden_size=h, intermediate_size=sh["inter"], num_hidden_layers=sh["layers"],
        num_attention_heads=sh["heads"], num_key_value_heads=sh["kv"], head_dim=sh["head_dim"],
        max_position_embeddings=max(512, p + c), tie_word_embeddings=False,
    ))
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 4.0 / math.sqrt(h))
    model.to(device)
    args = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=b, num_generations=b, max_completion_length=c,
        report_to=[], use_cpu=not cuda, bf16=(precision == "bf16"), importance_sampling_level="sequence",
        epsilon=3e-4, epsilon_high=4e-4, loss_type="grpo",
    )
    cls = trl.GRPOTrainer if case == "trl" else GRPOTrainer
    extra = {} if case == "trl" else {"gspo_backend": backend}
    if case != "trl" and one_pass:
        extra["gspo_one_pass"] = True
    if case != "trl" and memory_budget != "drop-in":
        extra["gspo_memory_budget"] = None if memory_budget == "none" else int(memory_budget)
    trainer = cls(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                  train_dataset=Dataset.from_dict({"prompt": ["1 2 3"] * b}), processing_class=hf_tokenizer(), **extra)
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(0, v, (b, p), generator=g).to(device)
    completion_ids = torch.randint(0, v, (b, c), generator=g).to(device)
    prompt_mask = torch.ones(b, p, dtype=torch.long, device=device)
    completion_mask = torch.ones(b, c, dtype=torch.long, device=device)
    ids = torch.cat([prompt_ids, completion_ids], 1)
    attn = torch.cat([prompt_mask, completion_mask], 1)
    advantages = torch.randn(b, generator=g).to(device)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1

    def old_pass():
        with torch.no_grad():
            return trainer._get_per_token_logps_and_entropies(trainer.model, ids, attn, c, batch_size=b)[0]

    def step(old):
        inputs = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                      completion_mask=completion_mask, advantages=advantages, old_per_token_logps=old,
                      num_items_in_batch=completion_mask.sum().float())
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        return loss

    return trainer, old_pass, step, shape


def run_case(case: str, precision: str, backend: str, memory_budget: str = "drop-in", device: str = "cpu",
             shape: str = "", repeats: int = 3, one_pass: bool = False) -> dict:
    """One trainer (``case``: ``"trl"`` stock, ``"gspo"`` the drop-in) on ``device``: the figures as a dict."""
    import torch

    trainer, old_pass, step, shape = build_case(case, precision, backend, memory_budget, device, shape, one_pass)
    cuda = device.startswith("cuda")
    if cuda:
        figures = _measure_cuda(trainer, old_pass, step, repeats)
        loss = figures.pop("loss")
    else:
        before = _rss_kb("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak (VmHWM) to the current RSS
        t0 = time.perf_counter()
        old = old_pass()
        t1 = time.perf_counter()
        loss = step(old)
        t2 = time.perf_counter()
        peak = _rss_kb("VmHWM")
        figures = dict(old_s=t1 - t0, step_s=t2 - t1, total_s=t2 - t0, peak_mb=(peak - before) / 1024,
                       peak_method="peak RSS (VmHWM after clear_refs) above the RSS before old + step")
    weights = trainer._metrics["train"]
    head = trainer.model.lm_head.weight.grad
    return dict(case=case, precision=precision, device=device, shape=shape,
                device_name=torch.cuda.get_device_name() if cuda else "cpu", **figures, loss=loss.item(),
                lm_head_grad_norm=None if head is None else float(head.float().norm()),
                threads=torch.get_num_threads(),
                weight_min=weights["importance_weight/min"][-1] if "importance_weight/min" in weights else None,
                weight_max=weights["importance_weight/max"][-1] if "importance_weight/max" in weights else None,
                clip=weights["clip_ratio/region_mean"][-1])


def _measure_cuda(trainer, old_pass, step, repeats: int) -> dict:
    """One warm-up, then the medians of ``repeats`` old passes and loss steps (CUDA events) and the step's peak."""
    import statistics

    import torch

    def events_ms(fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end), out

    trainer.model.zero_grad(set_to_none=True)
    step(old_pass())  # warm-up: compilation, the allocator's pools, cuBLAS handles
    old_ms, step_ms, peaks = [], [], []
    old = None
    for _ in range(repeats):
        ms, old = events_ms(old_pass)
        old_ms.append(ms)
    loss = None
    for _ in range(repeats):
        trainer.model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms, loss = events_ms(lambda: step(old))
        peaks.append(torch.cuda.max_memory_allocated() - base)
        step_ms.append(ms)
    old_s, step_s = statistics.median(old_ms) / 1e3, statistics.median(step_ms) / 1e3
    return dict(old_s=old_s, step_s=step_s, total_s=old_s + step_s, old_ms_all=old_ms, step_ms_all=step_ms,
                peak_mb=max(peaks) / 2**20, peak_method="torch.cuda.max_memory_allocated above the allocation at "
                "the step's start (max over the timed steps)", repeats=repeats, loss=loss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=("trl", "gspo"))
    parser.add_argument("--precision", choices=("fp32", "bf16"))
    parser.add_argument("--backend", default="auto", help="gspo_kernels backend for the drop-in (default auto)")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--memory-budget", default="drop-in",
                        help="the drop-in's gspo_memory_budget in bytes, or 'drop-in' / 'none' (not given: the drop-in's "
                        "own default, 256 MiB on the CPU; on CUDA the library's, 1 GiB with --one-pass)")
    parser.add_argument("--one-pass", action="store_true", help="the drop-in with gspo_one_pass=True")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="",
                        help="cpu, client, tiny or client-small (default: cpu on the CPU, client on CUDA)")
    parser.add_argument("--repeats", type=int, default=3, help="timed old passes and steps on CUDA (median)")
    opts = parser.parse_args()
    if opts.case:
        print(json.dumps(run_case(opts.case, opts.precision, opts.backend, opts.memory_budget, opts.device,
                                  opts.shape, opts.repeats, one_pass=opts.one_pass)))
        return
    rows = []
    for precision in opts.precisions.split(","):
        for case in ("trl", "gspo"):  # a fresh process per case
            cmd = [sys.executable, __file__, "--case", case, "--precision", precision, "--backend", opts.backend,
                   "--memory-budget", opts.memory_budget, "--device", opts.device, "--repeats", str(opts.repeats)]
            cmd += ["--one-pass"] if opts.one_pass else []
            cmd += ["--shape", opts.shape] if opts.shape else []
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ.copy())
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    from gspo_kernels.tools.table import Column, text_header, text_row

    columns = (Column("precision", 9, "<"), Column("case", 5, "<"), Column("old s", 7, spec=".2f"),
               Column("step s", 7, spec=".2f"), Column("total s", 8, spec=".2f"), Column("peak MB", 8, spec=".0f"),
               Column("loss", 10, spec=".6f"), Column("w min", 9, spec=".6f"), Column("w max", 9, spec=".6f"),
               Column("clip", 5, spec=".2f"))
    print(text_header(columns))
    for r in rows:
        wmin, wmax = ("-" if r[key] is None else r[key] for key in ("weight_min", "weight_max"))
        print(text_row(columns, [r["precision"], r["case"], r["old_s"], r["step_s"], r["total_s"], r["peak_mb"],
                                 r["loss"], wmin, wmax, r["clip"]]))
    for precision in opts.precisions.split(","):
        trl_row, ours = (next(r for r in rows if r["precision"] == precision and r["case"] == c) for c in ("trl", "gspo"))
        print(f"{precision}: drop-in / TRL: time {ours['total_s'] / trl_row['total_s']:.2f}x "
              f"(old {ours['old_s'] / trl_row['old_s']:.2f}x, step {ours['step_s'] / trl_row['step_s']:.2f}x), "
              f"peak memory {ours['peak_mb'] / trl_row['peak_mb']:.2f}x")


if __name__ == "__main__":
    main()
