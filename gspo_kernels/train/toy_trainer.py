"""The toy GSPO / GRPO trainer: a minimal, readable RL loop that runs on the CPU in minutes.

One step (the GSPO paper's setup):

1. rollout: ``prompts_per_step`` prompts of a toy task (:mod:`gspo_kernels.train.tasks`), ``group_size``
   samples each with ``model.generate`` at ``temperature``; rewards; group advantages;
2. the old policy's log-probs (and the reference model's, when ``beta > 0``), once per rollout batch;
3. the rollout batch is split into ``num_minibatches`` mini-batches, one AdamW step each; the loss comes
   from the policy's last hidden states and lm_head weight through
   :func:`gspo_kernels.fused_linear_gspo_loss` (``--loss torch|cpu|triton|auto``) or the float64 oracle
   :func:`gspo_kernels.reference.fused_linear_gspo_loss` (``--loss reference``).

The policy is a tiny causal LM built from a ``transformers`` config with random weights: Qwen3 (dense)
or Qwen3-MoE. Each step logs mean reward, loss, clip ratios, importance-weight stats, entropy, KL,
tokens/s and, for the MoE policy, the share of (token, layer) routings whose top-k experts changed
between the old policy and the policy being updated. Logs go to JSONL; curves to a PNG when
matplotlib is installed. ``gspo-kernels train --compare`` runs GSPO and GRPO on the same seeds.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor

from gspo_kernels import backends
from gspo_kernels.config import GSPOConfig
from gspo_kernels.integrations import adapter
from gspo_kernels.train.rollout import ScoredResponses, completion_mask_of
from gspo_kernels.train.tasks import Task, ToyTokenizer, get_task

LOSSES = ("reference",) + backends.BACKENDS + ("auto",)  # the float64 reference and the registered backends
ALGORITHMS = {
    # name: (importance_sampling_level, epsilon_low, epsilon_high); the papers' clip bands
    "gspo": ("sequence", 3e-4, 4e-4),
    "grpo": ("token", 0.2, 0.28),
}


@dataclass
class TrainConfig:
    """Options of one training run (the CLI flags of ``gspo-kernels train``)."""

    task: str = "reverse"
    policy: str = "dense"  # "dense" (Qwen3) or "moe" (Qwen3-MoE)
    loss: str = "auto"  # one of LOSSES
    algorithm: str = "gspo"  # "gspo" or "grpo"
    steps: int = 200
    prompts_per_step: int = 16
    group_size: int = 8
    num_minibatches: int = 4
    lr: float = 3e-3
    max_grad_norm: Optional[float] = 1.0
    beta: float = 0.0
    temperature: float = 1.0
    epsilon_low: Optional[float] = None  # None: the algorithm's default band
    epsilon_high: Optional[float] = None
    loss_type: str = "grpo"
    hidden_size: int = 64
    num_layers: int = 2
    seed: int = 0
    device: str = "cpu"

    def loss_config(self) -> GSPOConfig:
        """The run's loss options (:data:`TRAIN_OPTIONS`)."""
        return adapter.build_config(TRAIN_OPTIONS, self)


def _band_edge(name: str, index: int) -> Callable[[TrainConfig], float]:
    """``epsilon_low`` / ``epsilon_high`` as given, else the algorithm's band (:data:`ALGORITHMS`)."""
    return lambda run: ALGORITHMS[run.algorithm][index] if getattr(run, name) is None else getattr(run, name)


# A run's options (TrainConfig, the CLI's flags) as the loss's GSPOConfig: the algorithm's importance-sampling level
# and clip band (the band overridden where given), the task's max_new_tokens as the dr_grpo divisor.
TRAIN_OPTIONS = adapter.Declaration("gspo-kernels train", rules=(
    adapter.derived("importance_sampling_level", lambda run: ALGORITHMS[run.algorithm][0]),
    adapter.rename("loss_type"),
    adapter.derived("epsilon_low", _band_edge("epsilon_low", 1)),
    adapter.derived("epsilon_high", _band_edge("epsilon_high", 2)),
    adapter.rename("beta"),
    adapter.rename("temperature"),
    adapter.derived("max_completion_length", lambda run: get_task(run.task).max_new_tokens),
), refusals=(
    adapter.Refusal("algorithm", lambda value: value in ALGORITHMS,
                    "{option} must be one of " + str(tuple(ALGORITHMS)) + ", got {value!r}"),
))


# ----------------------------------------------------------------------------------------------- policy


def build_policy(kind: str, tok: ToyTokenizer, *, hidden_size: int = 64, num_layers: int = 2, seed: int = 0):
    """A tiny causal LM with random weights (``torch.manual_seed(seed)`` first): Qwen3 or Qwen3-MoE.

    The MoE policy has 8 experts, 2 routed per token, in every layer (``decoder_sparse_step=1``).
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    torch.manual_seed(seed)
    if kind == "dense":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif kind == "moe":
        config = Qwen3MoeConfig(
            **common,
            moe_intermediate_size=hidden_size // 2,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            router_aux_loss_coef=0.0,
        )
        model = Qwen3MoeForCausalLM(config)
    else:
        raise ValueError(f"policy must be 'dense' or 'moe', got {kind!r}")
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model


def is_moe(model) -> bool:
    return getattr(model.config, "num_experts", None) is not None


# ---------------------------------------------------------------------------------------------- rollout


@dataclass(kw_only=True)
class ToyRollout(ScoredResponses):
    """One rollout batch of ``S = prompts x group_size`` responses (tensors on the policy's device).

    The responses' tensors (``ScoredResponses``; the end-of-sequence token is ``<eos>``), and
    ``input_ids [S, P + C]`` (prompt then completion), ``attention_mask [S, P + C]``; filled in later:
    ``old_experts`` (MoE) a list per layer of ``[S, P + C, k]``.

    Not ``rollout.Rollout``: the toy tasks' prompts all have ``P`` tokens, so the batch is kept as the
    padded ``[S, P + C]`` model input (and the MoE routing), where ``GSPOTrainer`` keeps texts and per-prompt ids
    for its packed / padded mini-batches.
    """

    prompt_length: int
    input_ids: Tensor
    attention_mask: Tensor
    old_experts: Optional[List[Tensor]] = None


@torch.no_grad()
def rollout(model, task: Task, tok: ToyTokenizer, cfg: TrainConfig, step: int) -> ToyRollout:
    """Sample ``group_size`` completions per prompt; rewards and group advantages.

    Prompts and sampling depend only on ``(cfg.seed, step)`` and the model's weights, so two runs that
    differ only in their loss backend make identical first rollouts.
    """
    from gspo_kernels import group_advantages

    device = torch.device(cfg.device)
    prompt_gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    digits = task.sample(cfg.prompts_per_step, prompt_gen)
    prompts = torch.tensor([tok.encode(task.prompt_text(d)) for d in digits], device=device)
    prompts = prompts.repeat_interleave(cfg.group_size, dim=0)
    C = task.max_new_tokens
    torch.manual_seed(cfg.seed * 1_000_003 + step + 7)  # generate samples from the global RNG
    was_training = model.training
    model.eval()
    out = model.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        do_sample=True,
        temperature=cfg.temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=C,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model.train(was_training)
    completion = out[:, prompts.shape[1] :]
    if completion.shape[1] < C:  # generation stops early once every row has emitted <eos>
        pad = completion.new_full((completion.shape[0], C - completion.shape[1]), tok.pad_token_id)
        completion = torch.cat([completion, pad], dim=1)
    mask = completion_mask_of(completion, tok.eos_token_id)
    completion = torch.where(mask > 0, completion, torch.full_like(completion, tok.pad_token_id))
    rewards = torch.tensor(
        [task.reward(d, c, tok) for d, c in zip(_repeat(digits, cfg.group_size), completion.tolist())],
        dtype=torch.float32,
        device=device,
    )
    advantages = group_advantages(rewards, cfg.group_size)
    input_ids = torch.cat([prompts, completion], dim=1)
    attention_mask = torch.cat([torch.ones_like(prompts, dtype=torch.float32), mask], dim=1)
    return ToyRollout(prompt_length=prompts.shape[1], input_ids=input_ids, attention_mask=attention_mask,
                      completion_ids=completion, completion_mask=mask, rewards=rewards, advantages=advantages)


def _repeat(items: Sequence, times: int) -> List:
    return [item for item in items for _ in range(times)]


# ------------------------------------------------------------------------------------------------- loss


def completion_hidden(model, input_ids: Tensor, attention_mask: Tensor, prompt_length: int, *, router: bool = False):
    """The backbone's last hidden states at the positions that predict the completion tokens.

    Returns ``(hidden [S, C, H], router_logits)``; ``router_logits`` is the MoE backbone's per-layer
    ``[S * (P + C), E]`` tuple when ``router`` is set, else None.
    """
    kwargs = {"output_router_logits": True} if router else {}
    out = model.model(input_ids=input_ids, attention_mask=attention_mask.long(), use_cache=False, **kwargs)
    hidden = out.last_hidden_state[:, prompt_length - 1 : -1]
    return hidden, (out.router_logits if router else None)


def token_logprobs_of(loss: str, hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float) -> Tensor:
    """fp32 log-probs ``[S, C]`` of ``labels`` under ``hidden @ weight.T`` (no logits kept)."""
    if loss == "reference":
        from gspo_kernels import reference

        return reference.linear_logprobs(hidden, weight, labels, temperature=temperature).float()
    from gspo_kernels import linear_logprobs

    return linear_logprobs(hidden, weight, labels, temperature=temperature, backend=loss)


def minibatch_loss(loss: str, hidden: Tensor, weight: Tensor, batch: Dict[str, Tensor], config: GSPOConfig):
    """The GSPO / GRPO :class:`~gspo_kernels.objectives.stage.LossOutput` of one mini-batch."""
    args = (hidden, weight, batch["completion_ids"], batch["advantages"], batch["old_logprobs"])
    kwargs = dict(mask=batch["completion_mask"], ref_logprobs=batch.get("ref_logprobs"), config=config)
    if loss == "reference":
        from gspo_kernels import reference

        return reference.fused_linear_gspo_loss(*args, **kwargs)
    from gspo_kernels import fused_linear_gspo_loss

    return fused_linear_gspo_loss(*args, backend=loss, **kwargs)


def topk_experts(router_logits: Sequence[Tensor], k: int, shape: tuple) -> List[Tensor]:
    """Per layer, the sorted top-``k`` expert ids ``[S, L, k]`` of each token."""
    return [logits.topk(k, dim=-1).indices.sort(dim=-1).values.reshape(*shape, k) for logits in router_logits]


def routing_change(old: List[Tensor], new: List[Tensor], mask: Tensor, prompt_length: int) -> Tensor:
    """Share of (completion token, layer) pairs whose set of routed experts differs (``mask [S, C]``)."""
    changed = torch.zeros((), dtype=torch.float64)
    for o, n in zip(old, new):
        differs = (o != n).any(dim=-1)[:, prompt_length - 1 : -1].to(torch.float64)
        changed = changed + (differs * mask.double()).sum()
    return changed / max(float(mask.sum()) * len(old), 1.0)


# ------------------------------------------------------------------------------------------------- loop


@dataclass
class TrainResult:
    model: object
    history: List[Dict[str, float]] = field(default_factory=list)
    first_rollout: Optional[ToyRollout] = None


def train(
    cfg: TrainConfig,
    *,
    model=None,
    log_path: Optional[Path] = None,
    on_step: Optional[Callable[[Dict[str, float]], None]] = None,
) -> TrainResult:
    """Run ``cfg.steps`` GSPO / GRPO steps; returns the trained model and one metrics dict per step."""
    if cfg.loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {cfg.loss!r}")
    if cfg.num_minibatches < 1 or cfg.prompts_per_step * cfg.group_size < cfg.num_minibatches:
        raise ValueError("need at least one response per mini-batch")
    loss_config = cfg.loss_config()
    task = get_task(cfg.task)
    tok = ToyTokenizer()
    device = torch.device(cfg.device)
    if model is None:
        model = build_policy(cfg.policy, tok, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers, seed=cfg.seed)
    model.to(device).train()
    moe = is_moe(model)
    ref_model = None
    if cfg.beta > 0:
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    weight = model.get_output_embeddings().weight
    result = TrainResult(model)
    log_file = open(log_path, "a") if log_path is not None else None
    try:
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            batch = rollout(model, task, tok, cfg, step)
            if result.first_rollout is None:
                result.first_rollout = batch
            t_rollout = time.perf_counter() - t0
            with torch.no_grad():
                hidden, router = completion_hidden(
                    model, batch.input_ids, batch.attention_mask, batch.prompt_length, router=moe
                )
                batch.old_logprobs = token_logprobs_of(
                    cfg.loss, hidden, weight, batch.completion_ids, cfg.temperature
                )
                if moe:
                    k = model.config.num_experts_per_tok
                    batch.old_experts = topk_experts(router, k, tuple(batch.input_ids.shape))
                if ref_model is not None:
                    ref_hidden, _ = completion_hidden(
                        ref_model, batch.input_ids, batch.attention_mask, batch.prompt_length
                    )
                    batch.ref_logprobs = token_logprobs_of(
                        cfg.loss, ref_hidden, ref_model.get_output_embeddings().weight,
                        batch.completion_ids, cfg.temperature,
                    )
            metrics = _update(model=model, optimizer=optimizer, weight=weight, batch=batch, cfg=cfg,
                              loss_config=loss_config, moe=moe, step=step)
            elapsed = time.perf_counter() - t0
            tokens = float(batch.completion_mask.sum())
            row = {
                "step": step,
                "algorithm": cfg.algorithm,
                "loss_backend": cfg.loss,
                "seed": cfg.seed,
                "reward_mean": float(batch.rewards.mean()),
                "reward_std": float(batch.rewards.std()),
                "completion_length": tokens / batch.completion_ids.shape[0],
                **metrics,
                "tokens_per_s": tokens / elapsed,
                "rollout_s": t_rollout,
                "step_s": elapsed,
            }
            result.history.append(row)
            if log_file is not None:
                log_file.write(json.dumps(row) + "\n")
                log_file.flush()
            if on_step is not None:
                on_step(row)
    finally:
        if log_file is not None:
            log_file.close()
    return result


def _update(model, optimizer, weight, batch: ToyRollout, cfg: TrainConfig, loss_config: GSPOConfig, moe: bool,
            step: int) -> Dict[str, float]:
    """One AdamW step per mini-batch of the rollout batch; the mini-batch metrics, averaged."""
    S = batch.input_ids.shape[0]
    order = torch.randperm(S, generator=torch.Generator().manual_seed(cfg.seed * 7919 + step))
    order = order.to(batch.input_ids.device)
    sums: Dict[str, float] = {}
    w_min, w_max = math.inf, -math.inf
    routing: List[float] = []
    chunks = torch.tensor_split(order, cfg.num_minibatches)
    for index, rows in enumerate(chunks):
        mb = {
            "completion_ids": batch.completion_ids[rows],
            "completion_mask": batch.completion_mask[rows],
            "advantages": batch.advantages[rows],
            "old_logprobs": batch.old_logprobs[rows],
        }
        if batch.ref_logprobs is not None:
            mb["ref_logprobs"] = batch.ref_logprobs[rows]
        hidden, router = completion_hidden(
            model, batch.input_ids[rows], batch.attention_mask[rows], batch.prompt_length, router=moe
        )
        out = minibatch_loss(cfg.loss, hidden, weight, mb, loss_config)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        grad_norm = None
        if cfg.max_grad_norm is not None:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
        optimizer.step()
        if moe and index > 0:  # the first mini-batch runs the old policy itself
            new = topk_experts(router, model.config.num_experts_per_tok, tuple(batch.input_ids[rows].shape))
            old = [o[rows] for o in batch.old_experts]
            routing.append(float(routing_change(old, new, mb["completion_mask"], batch.prompt_length)))
        values = {"loss": float(out.loss.detach())}
        if grad_norm is not None:
            values["grad_norm"] = grad_norm
        for name, value in out.metrics.items():
            values[name] = float(value)
        w_min = min(w_min, values.pop("importance_weight/min", w_min))
        w_max = max(w_max, values.pop("importance_weight/max", w_max))
        for name, value in values.items():
            sums[name] = sums.get(name, 0.0) + value
    metrics = {name: total / len(chunks) for name, total in sums.items()}
    metrics["importance_weight/min"] = w_min
    metrics["importance_weight/max"] = w_max
    if moe:
        metrics["routing_change"] = sum(routing) / len(routing) if routing else 0.0
    return metrics


# ----------------------------------------------------------------------------------------------- charts

CURVES = (
    ("reward_mean", "mean reward"),
    ("loss", "loss"),
    ("clip_ratio/region_mean", "clip ratio"),
    ("importance_weight/mean", "importance weight (mean)"),
    ("entropy", "entropy"),
    ("kl", "KL to reference"),
    ("routing_change", "routed experts changed"),
)


def smooth(values: Sequence[float], window: int) -> List[float]:
    """Trailing moving average over ``window`` points."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_runs(runs: Dict[str, List[List[Dict[str, float]]]], path: Path, *, window: int = 10) -> Optional[Path]:
    """Curves (mean over seeds, smoothed) of each labelled group of runs; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    present = [(key, title) for key, title in CURVES if any(key in h[0] for hs in runs.values() for h in hs if h)]
    cols = min(3, len(present))
    rows = math.ceil(len(present) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False)
    for ax, (key, title) in zip(axes.flat, present):
        for label, histories in runs.items():
            series = [[row.get(key, math.nan) for row in h] for h in histories if h]
            if not series:
                continue
            length = min(len(s) for s in series)
            mean = [sum(s[i] for s in series) / len(series) for i in range(length)]
            ax.plot(range(length), smooth(mean, window), label=f"{label} (n={len(series)})")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(present) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    parser.add_argument("--task", default=d.task, choices=["copy", "reverse", "sort", "sum"],
                        help="toy task: copy, reverse or sort digits, or add two numbers (default: %(default)s)")
    parser.add_argument("--policy", default=d.policy, choices=["dense", "moe"],
                        help="tiny random-weight policy: a dense Qwen3 or a Qwen3-MoE (default: %(default)s)")
    parser.add_argument("--loss", default=d.loss, choices=LOSSES,
                        help="loss implementation: a backend, or 'reference' for the float64 oracle (default: %(default)s)")
    parser.add_argument("--algorithm", default=d.algorithm, choices=tuple(ALGORITHMS),
                        help="gspo: sequence-level importance weights, band 3e-4 / 4e-4; grpo: token level, "
                             "band 0.2 / 0.28 (default: %(default)s)")
    parser.add_argument("--compare", action="store_true", help="run GSPO and GRPO on the same seeds and plot both")
    parser.add_argument("--steps", type=int, default=d.steps,
                        help="training steps, one rollout batch each (default: %(default)s)")
    parser.add_argument("--prompts-per-step", type=int, default=d.prompts_per_step,
                        help="prompts sampled per step (default: %(default)s)")
    parser.add_argument("--group-size", type=int, default=d.group_size,
                        help="completions per prompt, the group of the advantages (default: %(default)s)")
    parser.add_argument("--num-minibatches", type=int, default=d.num_minibatches,
                        help="optimizer steps per rollout batch, each on a shuffled share of it; the ones after "
                             "the first are off-policy and clip (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate (default: %(default)s)")
    parser.add_argument("--beta", type=float, default=d.beta,
                        help="KL weight against a frozen copy of the initial policy (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=d.temperature,
                        help="sampling temperature, also applied to the log-probs (default: %(default)s)")
    parser.add_argument("--epsilon-low", type=float, default=None,
                        help="the clip band's lower side, 1 - epsilon_low (default: 3e-4 for gspo, 0.2 for grpo)")
    parser.add_argument("--epsilon-high", type=float, default=None,
                        help="the clip band's upper side, 1 + epsilon_high (default: 4e-4 for gspo, 0.28 for grpo)")
    parser.add_argument("--loss-type", default=d.loss_type, choices=["grpo", "bnpo", "dr_grpo", "dapo"],
                        help="aggregation of the per-token losses, TRL's loss_type (default: %(default)s)")
    parser.add_argument("--hidden-size", type=int, default=d.hidden_size,
                        help="the policy's hidden size (default: %(default)s)")
    parser.add_argument("--num-layers", type=int, default=d.num_layers,
                        help="the policy's decoder layers (default: %(default)s)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[d.seed],
                        help="one run per seed: the weights, prompts and samples depend only on it (default: %(default)s)")
    parser.add_argument("--device", default=d.device, help="torch device of the policy and the loss (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("results/train"),
                        help="folder for the JSONL logs, summary.json and the PNG (default: %(default)s)")
    parser.add_argument("--log-every", type=int, default=10,
                        help="print every N-th step's metrics, and the last step's (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    algorithms = tuple(ALGORITHMS) if args.compare else (args.algorithm,)
    runs: Dict[str, List[List[Dict[str, float]]]] = {}
    summary = {}
    for algorithm in algorithms:
        for seed in args.seeds:
            cfg = TrainConfig(
                task=args.task, policy=args.policy, loss=args.loss, algorithm=algorithm, steps=args.steps,
                prompts_per_step=args.prompts_per_step, group_size=args.group_size,
                num_minibatches=args.num_minibatches, lr=args.lr, beta=args.beta, temperature=args.temperature,
                epsilon_low=args.epsilon_low, epsilon_high=args.epsilon_high, loss_type=args.loss_type,
                hidden_size=args.hidden_size, num_layers=args.num_layers, seed=seed, device=args.device,
            )
            log_path = args.out / f"{algorithm}_{args.task}_{args.policy}_seed{seed}.jsonl"
            log_path.write_text("")
            (args.out / f"{log_path.stem}.config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
            print(f"== {algorithm} seed {seed}: {args.task}, {args.policy} policy, loss {args.loss} -> {log_path}")

            history = train(cfg, log_path=log_path, on_step=_progress(args.log_every, cfg.steps)).history
            runs.setdefault(algorithm.upper(), []).append(history)
            summary[f"{algorithm}/seed{seed}"] = _reward_summary(history)
    for name, s in summary.items():
        print(f"{name}: {describe_reward_change(s)}")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    chart = plot_runs(runs, args.out / ("compare.png" if args.compare else "curves.png"))
    print(f"chart: {chart}" if chart else "chart skipped: matplotlib is not installed (pip install matplotlib)")
    return 0


def _progress(every: int, steps: int) -> Callable[[Dict[str, float]], None]:
    """Prints every ``every``-th step's main metrics (and the last one)."""
    every = max(every, 1)

    def show(row: Dict[str, float]) -> None:
        if row["step"] % every == 0 or row["step"] == steps - 1:
            extra = f" routing_change {row['routing_change']:.3f}" if "routing_change" in row else ""
            print(
                f"step {row['step']:4d} reward {row['reward_mean']:.3f} loss {row['loss']:+.4f} "
                f"clip {row.get('clip_ratio/region_mean', 0):.3f} "
                f"w [{row['importance_weight/min']:.4f}, {row['importance_weight/max']:.4f}] "
                f"entropy {row.get('entropy', math.nan):.3f}{extra} {row['tokens_per_s']:.0f} tok/s",
                flush=True,
            )

    return show


def _reward_summary(history: List[Dict[str, float]], window: int = 10) -> Dict[str, Optional[float]]:
    """Mean reward over the first and the last ``k`` steps, ``k = min(window, steps // 2)``: two windows that never
    share a step. Fewer than 2 steps: nothing to compare (``first`` and ``last`` None, ``window`` 0)."""
    rewards = [row["reward_mean"] for row in history]
    k = min(window, len(rewards) // 2)
    if k == 0:
        return {"first": None, "last": None, "window": 0, "steps": len(rewards)}
    return {"first": sum(rewards[:k]) / k, "last": sum(rewards[-k:]) / k, "window": k, "steps": len(rewards)}


def describe_reward_change(summary: Dict[str, Optional[float]]) -> str:
    """One line for a :func:`_reward_summary`: the two windows' mean rewards, or why there is no comparison."""
    steps, k = summary["steps"], summary["window"]
    if not k:
        return f"{steps} step(s): too short to compare the first and the last steps' rewards (run 2 steps or more)"
    return (f"mean reward first {k} steps {summary['first']:.3f} -> last {k} steps {summary['last']:.3f} "
            f"({summary['last'] - summary['first']:+.3f}, {steps} steps)")
