"""Toy tasks made in code, with programmatic rewards, and the tiny word-level tokenizer they use.

Every prompt is a task word followed by digits and ``=`` (``"rev 3 1 4 ="``); the policy answers with
digits and ends with ``<eos>``. The rewards give partial credit (a share of correct positions), so that
a tiny randomly initialized model sees reward differences within a group from the very first rollout
and can measurably improve within a few hundred RL steps on the CPU.

Tasks:

* ``copy``: repeat the digits; ``reverse``: reverse them; ``sort``: sort them ascending.
  Target ``t = answer digits + <eos>``; reward = share of positions ``i < len(t)`` where the
  completion holds ``t[i]`` (a missing token counts as wrong).
* ``sum``: the digits of ``a + b`` for two single digits, then ``<eos>``, same partial credit.

The vocabulary is fixed: :data:`VOCAB`. :class:`ToyTokenizer` encodes and decodes in plain Python;
:func:`hf_tokenizer` builds the same vocabulary as a ``transformers.PreTrainedTokenizerFast``
(a ``tokenizers`` WordLevel model), for trainers that want a Hugging Face tokenizer (TRL).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence

import torch

PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"
DIGITS = tuple(str(d) for d in range(10))
TASK_WORDS = ("copy", "rev", "sort", "sum")
VOCAB: tuple = (PAD, EOS, BOS) + DIGITS + TASK_WORDS + ("=",)


class ToyTokenizer:
    """Word-level tokenizer over :data:`VOCAB` (whitespace-separated words)."""

    def __init__(self) -> None:
        self.vocab = {word: i for i, word in enumerate(VOCAB)}
        self.words = list(VOCAB)
        self.pad_token_id = self.vocab[PAD]
        self.eos_token_id = self.vocab[EOS]
        self.bos_token_id = self.vocab[BOS]

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, text: str) -> List[int]:
        try:
            return [self.vocab[word] for word in text.split()]
        except KeyError as exc:
            raise ValueError(f"word {exc.args[0]!r} is not in the toy vocabulary {VOCAB}") from None

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        special = {self.pad_token_id, self.eos_token_id, self.bos_token_id}
        return " ".join(self.words[i] for i in ids if not (skip_special and i in special))


def hf_tokenizer():
    """The toy vocabulary as a ``PreTrainedTokenizerFast`` (WordLevel model, whitespace pre-tokenizer).

    ``pad``/``eos``/``bos`` are set; no tokens are added around the text, so ``tok("rev 3 1 =")``
    gives exactly the word ids. Left padding, as TRL expects for prompts.
    """
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(WordLevel({word: i for i, word in enumerate(VOCAB)}, unk_token=PAD))
    core.pre_tokenizer = WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS, bos_token=BOS)
    tok.padding_side = "left"
    return tok


def _answer(task: str, digits: Sequence[int]) -> List[int]:
    if task == "copy":
        return list(digits)
    if task == "rev":
        return list(reversed(digits))
    if task == "sort":
        return sorted(digits)
    if task == "sum":
        return [int(c) for c in str(sum(digits))]
    raise ValueError(f"unknown task word {task!r}")


def partial_credit(completion: Sequence[int], target: Sequence[int]) -> float:
    """Share of target positions the completion matches (positions past its end count as wrong)."""
    hits = sum(1 for i, want in enumerate(target) if i < len(completion) and completion[i] == want)
    return hits / len(target)


@dataclass(frozen=True)
class Task:
    """A toy task: ``word`` starts the prompt, ``num_digits`` operands follow.

    ``max_new_tokens`` is the longest useful completion (the answer plus ``<eos>``).
    """

    name: str
    word: str
    num_digits: int

    @property
    def prompt_length(self) -> int:
        return self.num_digits + 2  # word, digits, "="

    @property
    def max_new_tokens(self) -> int:
        longest = 2 if self.word == "sum" else self.num_digits
        return longest + 1

    def sample(self, num_prompts: int, generator: torch.Generator) -> List[List[int]]:
        """``num_prompts`` operand lists of ``num_digits`` random digits each."""
        draws = torch.randint(0, 10, (num_prompts, self.num_digits), generator=generator)
        return draws.tolist()

    def prompt_text(self, digits: Sequence[int]) -> str:
        return " ".join([self.word, *map(str, digits), "="])

    def target_ids(self, digits: Sequence[int], tok: ToyTokenizer) -> List[int]:
        return [tok.vocab[str(d)] for d in _answer(self.word, digits)] + [tok.eos_token_id]

    def reward(self, digits: Sequence[int], completion_ids: Sequence[int], tok: ToyTokenizer) -> float:
        """Partial credit of ``completion_ids`` (token ids, padding allowed after ``<eos>``)."""
        return partial_credit(list(completion_ids), self.target_ids(digits, tok))

    def reward_text(self, prompt: str, completion: str) -> float:
        """The reward from text, for text-based trainers (TRL decodes with ``skip_special_tokens``).

        ``completion`` holds the answer words without ``<eos>``; the ``<eos>`` position of the target
        is credited when the completion has exactly the answer's length.
        """
        words = prompt.split()
        if not words or words[0] != self.word:
            raise ValueError(f"prompt {prompt!r} is not a {self.name!r} prompt")
        answer = [str(d) for d in _answer(self.word, [int(w) for w in words[1:-1]])]
        got = [w for w in completion.split() if w not in (PAD, EOS, BOS)]
        hits = sum(1 for i, want in enumerate(answer) if i < len(got) and got[i] == want)
        return (hits + (len(got) == len(answer))) / (len(answer) + 1)


TASKS: Dict[str, Task] = {
    "copy": Task("copy", "copy", 3),
    "reverse": Task("reverse", "rev", 3),
    "sort": Task("sort", "sort", 4),
    "sum": Task("sum", "sum", 2),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"task must be one of {tuple(TASKS)}, got {name!r}")
    return TASKS[name]


def trl_reward_function(task: Task) -> Callable[..., List[float]]:
    """A TRL reward function (``prompts, completions, **kwargs -> list of floats``) for ``task``."""

    def reward(prompts: List[str], completions: List[str], **kwargs) -> List[float]:
        return [task.reward_text(p, c) for p, c in zip(prompts, completions)]

    reward.__name__ = f"{task.name}_reward"
    return reward
