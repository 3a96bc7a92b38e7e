"""Train a tiny ``transformers`` model with GSPO on a verifiable arithmetic reward, on the CPU in minutes.

    python examples/train_arithmetic.py --steps 150     # the plot goes to results/arithmetic_reward.png

Everything is built in code (nothing is downloaded): a word-level tokenizer from the ``tokenizers``
library, a 2-layer Qwen3 with random weights, and the reward below, which is the part you write for
your own task. The prompts are ``"a + b ="`` with single digits whose sum is a single digit; the
reward checks the completion. Prints a progress bar (tqdm) and saves a plot of the mean reward
(matplotlib) when those are installed.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from typing import Dict, List, Optional

import torch

from gspo_kernels.train import GSPOTrainer
from gspo_kernels.train import GSPOTrainerConfig as GSPOConfig

WORDS = ["<pad>", "<bos>", "<eos>", "+", "="] + [str(d) for d in range(10)]


def build_tokenizer():
    """A ``PreTrainedTokenizerFast`` over :data:`WORDS` (WordLevel model, whitespace split)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    core.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")


def build_model(tokenizer, seed: int = 0, hidden_size: int = 64):
    """A 2-layer Qwen3 causal LM with random weights (any ``AutoModelForCausalLM`` works the same way)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4,
        max_position_embeddings=32, tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )
    return Qwen3ForCausalLM(config)


def reward_function(prompts: List[str], completions: List[str]) -> List[float]:
    """1.0 for exactly the right answer; for a completion that starts with a digit ``d``,
    ``0.5 * (1 - |d - answer| / 9)`` (partial credit for being close); 0 otherwise."""
    rewards = []
    for prompt, completion in zip(prompts, completions):
        a, _, b, _ = prompt.split()
        answer = int(a) + int(b)
        words = completion.split()
        if words == [str(answer)]:
            rewards.append(1.0)
        elif words and words[0].isdigit():
            rewards.append(0.5 * (1 - abs(int(words[0]) - answer) / 9))
        else:
            rewards.append(0.0)
    return rewards


def sample_queries(rng: random.Random, n: int) -> List[str]:
    queries = []
    for _ in range(n):
        a = rng.randrange(10)
        b = rng.randrange(10 - a)
        queries.append(f"{a} + {b} =")
    return queries


def train(steps: int = 150, seed: int = 0, *, queries_per_step: int = 16, progress: bool = True,
          plot: Optional[str] = None, layout: str = "packed") -> List[Dict[str, float]]:
    """Run ``steps`` GSPO steps; returns each step's metrics."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed)
    config = GSPOConfig(
        learning_rate=3e-3, group_size=8, max_new_tokens=3, num_minibatches=2, seed=seed,
        left_clip_range=3e-4, right_clip_range=4e-4,  # the GSPO paper's band
        layout=layout,
    )
    trainer = GSPOTrainer(model, tokenizer, config)
    rng = random.Random(seed)
    history = []
    bar = _bar(steps, progress)
    for _ in range(steps):
        metrics = trainer.train_step(sample_queries(rng, queries_per_step), reward_function)
        history.append(metrics)
        if bar is not None:
            bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", clip=f"{metrics.get('clip_ratio/region_mean', 0):.2f}")
            bar.update(1)
    if bar is not None:
        bar.close()
    if plot:
        _plot(history, plot)
    return history


def _bar(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="GSPO steps")


def _plot(history: List[Dict[str, float]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed")
        return
    rewards = [row["reward_mean"] for row in history]
    window = 10
    smooth = [sum(rewards[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(rewards))]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(rewards, alpha=0.35, label="mean reward")
    ax.plot(smooth, label=f"moving average ({window} steps)")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title("GSPO on a + b = (tiny random Qwen3, CPU)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--queries-per-step", type=int, default=16)
    parser.add_argument("--plot", default="results/arithmetic_reward.png",
                        help="PNG path, its folder created if needed ('' for none; default: %(default)s)")
    parser.add_argument("--layout", default="packed", choices=["packed", "padded"])
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1 is fastest for this tiny model on a busy machine)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    history = train(args.steps, args.seed, queries_per_step=args.queries_per_step, plot=args.plot or None,
                    layout=args.layout)
    rewards = [row["reward_mean"] for row in history]
    k = min(10, len(rewards) // 2)  # two windows that share no step
    if k:
        print(f"mean reward: first {k} steps {sum(rewards[:k]) / k:.3f} -> last {k} steps {sum(rewards[-k:]) / k:.3f} "
              f"({time.perf_counter() - start:.0f} s)")
    else:
        print(f"mean reward {rewards[0]:.3f} after 1 step: too short to compare ({time.perf_counter() - start:.0f} s)")
    speed = [row[f"tokens_per_s/{args.layout}"] for row in history]
    print(f"{args.layout}: median {sorted(speed)[len(speed) // 2]:.0f} completion tokens/s in the loss steps, "
          f"{sum(r['model_tokens'] for r in history) / len(history):.0f} backbone positions per step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
