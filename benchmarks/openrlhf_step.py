"""OpenRLHF's actor step against the library's (``gspo_kernels.integrations.openrlhf``): the storages alive at the
peak of the old-log-prob pass and of the training step, counted on CPU tensors (``benchmarks/memory_trace.py``).

    python benchmarks/openrlhf_step.py            # both, the realistic shape; a table
    python benchmarks/openrlhf_step.py --json     # one JSON line per case

The shape (``SHAPE``): Qwen2.5-0.5B's head and layer widths (hidden 896, vocabulary 151936, the lm_head tied to
the embeddings), one decoder layer (the head dominates the step, as in the 0.5B model), bf16 parameters
(OpenRLHF's default ``param_dtype``), a micro-batch of 2 sequences of 256 prompt + 1024 response tokens (prompts
left-padded, responses right-padded), temperature 1, ``policy_loss_type=gspo``, no entropy (OpenRLHF's default
``entropy_coef=None``). The old log-probs are the current ones minus noise (some responses clip).

- ``old``: ``actor(sequences, action_mask, attention_mask=...)`` under ``torch.no_grad`` (the experience maker's);
- ``step``: ``actor(..., return_output=True)``, ``PolicyLoss`` and ``backward`` (``ActorPPOTrainer.training_step``
  without the optimizer), the gradients None before it.

The counts are storages allocated after each phase's start (the model and the batch excluded), what a GPU's
allocator would report for the same tensors (``torch.cuda.memory_allocated``, up to its rounding). The library
runs its ``cpu`` backend here (C++ kernels; ``backend="auto"`` on CPU tensors); on a GPU it runs its Triton
kernels, whose buffers differ: see :func:`predicted_gpu` (a prediction, not a measurement).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Dict, List

import torch

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(H=896, V=151936, layers=1, inter=4864, heads=14, kv=2, B=2, P=256, A=1024)


def build(shape: Dict[str, int]):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=shape["V"], hidden_size=shape["H"], intermediate_size=shape["inter"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"], num_key_value_heads=shape["kv"],
        max_position_embeddings=shape["P"] + shape["A"], tie_word_embeddings=True, attn_implementation="sdpa"))
    with torch.no_grad():  # logits spread like a trained model's
        model.lm_head.weight.normal_(0.0, 4.0 / shape["H"] ** 0.5)
    model = model.to(torch.bfloat16)
    B, P, A = shape["B"], shape["P"], shape["A"]
    g = torch.Generator().manual_seed(1)
    sequences = torch.randint(1, shape["V"], (B, P + A), generator=g)
    positions = torch.arange(P + A)[None, :]
    prompt_start = torch.tensor([0, P // 4])[:B, None]
    response_end = torch.tensor([P + A, P + 3 * A // 4])[:B, None]
    attention_mask = ((positions >= prompt_start) & (positions < response_end)).long()
    sequences = torch.where(attention_mask > 0, sequences, 0)
    action_mask = attention_mask[:, P:].bool()
    advantages = torch.randn(B, 1, generator=g).expand(B, A).contiguous()
    return model, sequences, attention_mask, action_mask, advantages


def trace_case(case: str, shape: Dict[str, int] = SHAPE) -> dict:
    """``case``: ``"openrlhf"`` (its Actor and PolicyLoss) or ``"gspo"`` (the library's). Returns the peaks of the
    old pass and the step (bytes above each start) and the largest storages alive at each."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.memory_trace import MemoryTrace
    from tests.integrations.openrlhf_env import openrlhf_importable

    torch._dynamo.config.disable = True  # OpenRLHF's compute_entropy eagerly (not called here: no entropy)
    with openrlhf_importable():
        import openrlhf.models as models

        from gspo_kernels.integrations import openrlhf as gko

        lib = gko if case == "gspo" else models
        model, sequences, attention_mask, action_mask, advantages = build(shape)
        actor = lib.Actor(model, temperature=1.0)
        actor.packing_samples = False
        loss_fn = lib.PolicyLoss(clip_eps_low=3e-4, clip_eps_high=4e-4, policy_loss_type="gspo")
        out = {"case": case, "shape": shape}
        gc.collect()
        with MemoryTrace(stack_depth=3) as old_trace, torch.no_grad():
            old = actor(sequences, action_mask, attention_mask=attention_mask)
        old = (old - 2e-4 * torch.randn(old.shape)) * action_mask
        model.zero_grad(set_to_none=True)
        gc.collect()
        with MemoryTrace(stack_depth=3) as step_trace:
            logp, output = actor(sequences, action_mask, attention_mask=attention_mask, return_output=True)
            loss, *_ = loss_fn(logp, old, advantages, action_mask=action_mask)
            loss.backward()
        for name, trace in (("old", old_trace), ("step", step_trace)):
            out[name] = trace.peak_bytes
            out[f"{name}_largest"] = [dict(bytes=r.bytes, shape=list(r.shape), dtype=str(r.dtype), op=r.op,
                                           where=list(r.where)) for r in trace.at_peak(min_bytes=1 << 24)[:6]]
        out["loss"] = float(loss.detach())
    return out


def predicted_gpu(shape: Dict[str, int] = SHAPE) -> Dict[str, Dict[str, int]]:
    """PREDICTED, not measured: the head's tensors alive at the step's peak on a GPU (besides what both keep: the
    backbone's activations, the parameters' gradients), with ``N = B (P + A)`` positions and ``n = B A`` action
    positions, bf16 parameters; the old-log-prob pass (no gradient) and the step.

    OpenRLHF with flash-attn installed (as on its GPUs; its ``log_probs_from_logits`` then runs flash-attn's Triton
    cross-entropy): the forward casts the bf16 logits ``[N, V]`` to fp32 (``2 N V + 4 N V`` bytes for a moment), the
    cross-entropy saves the fp32 logits; its backward writes an fp32 gradient beside them (``8 N V``: the peak),
    which the backward of ``.to(float32)`` then casts to bf16 (``6 N V``, the saved logits freed).

    The library (its Triton ``linear_logprobs`` over the ``n`` action rows; ``V >= 4 n`` here, so its backward runs
    over vocabulary slices): the forward's fp32 logits chunk (``configs.gemm_chunk_rows`` within
    ``VOCAB_SLICE_BUDGET``); the backward's slice buffers (``configs.vocab_slice_sizes``), the fp32 ``dW`` of the
    head and ``dH`` of the action rows, the buffers freed before ``dW`` is cast to the bf16 parameter's dtype
    (``4 V H + 2 V H`` then). Without a gradient (the old pass) its chunk holds ``DEFAULT_MEMORY_BUDGET``."""
    from gspo_kernels.backends.triton import configs

    B, S, A, V, H = shape["B"], shape["P"] + shape["A"], shape["A"], shape["V"], shape["H"]
    N, n = B * S, B * A
    theirs = {"old pass: bf16 logits and their fp32 copy": 6 * N * V,
              "step forward: bf16 logits and their fp32 copy": 6 * N * V,
              "step backward: saved fp32 logits and their fp32 gradient": 8 * N * V}
    if configs.vocab_sliced(n, V):
        rows = configs.gemm_chunk_rows(n, V, torch.bfloat16, configs.VOCAB_SLICE_BUDGET, need_dz=False)
        r, s = configs.vocab_slice_sizes(n, V, torch.bfloat16, None)
        backward = 6 * r * s + 4 * V * H + 4 * n * H
    else:
        rows = configs.gemm_chunk_rows(n, V, torch.bfloat16, None, need_dz=False)
        c, k = configs.one_pass_chunk_rows(n, V, torch.bfloat16, None, two_pass=True)
        backward = 4 * c * V + 2 * max(c, k) * V + 4 * V * H + 2 * n * H
    old_rows = configs.gemm_chunk_rows(n, V, torch.bfloat16, None, need_dz=False)
    ours = {"old pass: fp32 logits chunk": 4 * min(old_rows, n) * V,
            "step forward: fp32 logits chunk": 4 * min(rows, n) * V,
            "step backward: buffers, fp32 dW and dH (then dW cast to bf16)": max(backward, 6 * V * H)}
    return {"openrlhf": theirs, "gspo_kernels": ours}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=("openrlhf", "gspo"), help="one case (default: both, each in this process)")
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args()
    results = [trace_case(case) for case in ((opts.case,) if opts.case else ("openrlhf", "gspo"))]
    if opts.json:
        for r in results:
            print(json.dumps(r))
        return
    gib = 2.0 ** 30
    print(f"shape {SHAPE}; storages alive at the peak, counted on CPU tensors (torch {torch.__version__})")
    for r in results:
        print(f"{r['case']:>9}: old pass {r['old'] / gib:6.2f} GiB, step {r['step'] / gib:6.2f} GiB")
        for rec in r["step_largest"]:
            print(f"           {rec['bytes'] / gib:6.2f} GiB {rec['dtype']:<15} {str(rec['shape']):<22} {rec['op']}")
    print("\n".join(prediction_lines()))


def prediction_lines(shape: Dict[str, int] = SHAPE) -> List[str]:
    """:func:`predicted_gpu` as the table's lines; where triton is not installed (the prediction reads the Triton
    backend's chunk and slice sizes, whose module needs triton), one line saying the prediction is not made here."""
    try:
        predicted = predicted_gpu(shape)
    except ImportError as exc:
        return [f"PREDICTED on a GPU: not made here: it reads the Triton backend's chunk sizes, which need triton "
                f"({type(exc).__name__}: {exc})"]
    gib, lines = 2.0 ** 30, []
    for name, parts in predicted.items():
        step = max(v for k, v in parts.items() if k.startswith("step"))
        lines.append(f"PREDICTED on a GPU, {name}: the head's tensors at the step's peak {step / gib:.2f} GiB")
        lines += [f"           {nbytes / gib:6.2f} GiB {part}" for part, nbytes in parts.items()]
    return lines


if __name__ == "__main__":
    main()
