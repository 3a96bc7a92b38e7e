"""A GSPO / GRPO trainer for any Hugging Face causal LM: ``GSPOTrainer(model, tokenizer, config)``.

``trainer.train_step(queries, reward_fn)`` runs one step of the GSPO paper's loop:

1. **rollout**: ``group_size`` completions per query with ``model.generate`` (the tokenizer's chat
   template when it has one), ``reward_fn(prompts, completions) -> floats``, group advantages;
2. the **old policy's log-probs** (and the reference model's when ``beta > 0``), once per rollout;
3. ``num_minibatches`` **optimizer steps** on a shuffled split of the rollout, each through
   :func:`gspo_kernels.fused_linear_gspo_loss` on the backbone's last hidden states and the lm_head
   (the ``[tokens, vocab]`` logits are never formed), in the **packed** layout (one row, ``position_ids``
   restarting per sequence, the loss with ``cu_seqlens``) or the **padded** one; gradient clipping;
   a non-finite loss, gradient or weight is handled by ``nan_policy``.

The model is reached only through ``transformers``' public API: ``model.get_decoder()`` for the last
(post-final-norm) hidden states and ``model.get_output_embeddings()`` for the lm_head (weight, bias, tied or
not). A model whose config has ``final_logit_softcapping`` (Gemma 2/3) trains with that soft cap applied in
the fused head (``GSPOConfig.final_logit_softcapping``, taken from the model). Models whose logits are otherwise
not ``lm_head(last hidden state)`` (Cohere's ``logit_scale``, Granite's ``logits_scaling``, anything else caught
by a probe forward at construction) are refused with an error naming the reason.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from gspo_kernels import backends
from gspo_kernels.advantages import group_advantages
from gspo_kernels.checks import is_finite_number
from gspo_kernels.config import GSPOConfig
from gspo_kernels.integrations import adapter
from gspo_kernels.loss import fused_linear_gspo_loss, linear_logprobs
from gspo_kernels.train.model_parts import (
    _last_hidden,
    _refuse_deepspeed,
    _with_model_softcap,
    causal_lm_parts,
    check_logits_path,
)
from gspo_kernels.train.rollout import MiniBatch, Rollout, build_minibatch, completion_mask_of

RewardFn = Callable[[List[str], List[str]], Sequence[float]]
NAN_POLICIES = ("skip", "raise")
BACKENDS = ("auto",) + backends.BACKENDS + ("reference",)  # the registered backends, and the float64 reference
LAYOUTS = ("packed", "padded")
CHECKPOINT_FILE = "gspo_trainer.pt"

# Loss options the trainer sets itself (from its own keywords or from generation settings).
_CLIP_ALIASES = {"left_clip_range": "epsilon_low", "right_clip_range": "epsilon_high"}


def _loss_field_names() -> Tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(GSPOConfig))


def _given(name: str) -> Callable[[Any], bool]:
    return lambda trainer_config: name in trainer_config.loss_options


# GSPOTrainerConfig's options as the loss's GSPOConfig: the loss options given by name under their own names, the
# clip band from left_clip_range / right_clip_range (refused beside epsilon_low / epsilon_high), and
# max_completion_length = max_new_tokens unless given (the dr_grpo divisor).
TRAINER_OPTIONS = adapter.Declaration("GSPOTrainerConfig", rules=(
    *(adapter.rename(name, f"loss_options.{name}", when=_given(name)) for name in _loss_field_names()),
    *(adapter.rename(name, alias, when=lambda c, alias=alias: getattr(c, alias) is not None)
      for alias, name in _CLIP_ALIASES.items()),
    adapter.rename("max_completion_length", "max_new_tokens", when=lambda c: not _given("max_completion_length")(c)),
), refusals=tuple(adapter.Refusal(alias, lambda value: value is None, "give the clip band as {option} or as " + name
                                  + ", not both", when=_given(name)) for alias, name in _CLIP_ALIASES.items()))


@dataclass(init=False)
class GSPOTrainerConfig:
    """Options of :class:`GSPOTrainer`; every :class:`gspo_kernels.GSPOConfig` field is accepted too.

    ``GSPOTrainerConfig(learning_rate=1e-7, left_clip_range=0.002, right_clip_range=0.002, group_size=4)``
    is the usual snippet's ``GSPOConfig(...)`` (import it as ``GSPOTrainerConfig as GSPOConfig``).

    Trainer attributes:
        learning_rate, weight_decay: AdamW's (``betas`` and ``eps`` are PyTorch's defaults).
        left_clip_range, right_clip_range: the clip band ``[1 - left, 1 + right]`` of the importance weight;
            the same as the loss options ``epsilon_low`` / ``epsilon_high`` (give one spelling, not both).
            Default: ``GSPOConfig``'s (3e-4 / 4e-4, the GSPO paper's band).
        group_size: completions sampled per query (the advantage's group).
        max_new_tokens, top_k, top_p: sampling (``temperature`` is the loss option of the same name, used for
            both sampling and the log-probs so that the old log-probs are those of the sampling policy).
            ``top_k=0`` and ``top_p=1.0`` sample from the full softmax.
        num_minibatches: optimizer steps per rollout (the rollout's responses split into this many parts).
        max_grad_norm: gradient-norm clip; None does not clip.
        old_model_update_interval: the old (sampling) policy is refreshed every this many ``train_step``
            calls. 1 (the default, the GSPO paper's setup): the current policy samples each rollout and
            scores the old log-probs, no copy is kept. ``k > 1``: a frozen copy samples and scores, and is
            refreshed from the policy at steps ``0, k, 2k, ...``.
        backend: the loss backend (``"auto"``, ``"torch"``, ``"cpu"``, ``"triton"``), or ``"reference"``
            for the float64 oracle :mod:`gspo_kernels.reference` (slow; for checks).
        layout: ``"packed"`` (padding-free, the default) or ``"padded"``.
        nan_policy: ``"skip"`` (a mini-batch with a non-finite loss or gradient makes no update; it is
            counted in the ``nonfinite_skipped`` metric) or ``"raise"`` (``FloatingPointError``). Non-finite
            weights after an update always raise (there is nothing safe to skip to).
        bf16: run the forward passes (generation, log-probs, loss) under ``torch.autocast(bfloat16)``.
        use_chat_template: None (default) applies the tokenizer's chat template when it has one; True
            requires one; False never applies it.
        seed: sampling and mini-batch shuffles depend only on ``(seed, step)`` and the weights.
        memory_budget: passed to the loss (bytes for saved logits / chunk buffers; None: the backend's).
        compile: ``torch.compile`` the training forward, the model's backbone and the loss together (the
            mini-batch's hidden states through ``fused_linear_gspo_loss``): False (default), True
            (``torch.compile``'s defaults: inductor; a new mini-batch shape compiles again once, then shapes are
            dynamic), or a dict of ``torch.compile`` keyword arguments (``{"backend": "aot_eager"}``,
            ``{"mode": "reduce-overhead"}`` ...). The sampling and the old / reference log-probs stay eager.
        loss_options: the :class:`GSPOConfig` options given by name (``importance_sampling_level``,
            ``loss_type``, ``beta``, ``temperature``, ``log_ratio_clamp``, ...); see :meth:`loss_config`.
    """

    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    left_clip_range: Optional[float] = None
    right_clip_range: Optional[float] = None
    group_size: int = 4
    max_new_tokens: int = 64
    top_k: int = 0
    top_p: float = 1.0
    num_minibatches: int = 1
    max_grad_norm: Optional[float] = 1.0
    old_model_update_interval: int = 1
    backend: str = "auto"
    layout: str = "packed"
    nan_policy: str = "skip"
    bf16: bool = False
    use_chat_template: Optional[bool] = None
    seed: int = 0
    memory_budget: Optional[int] = None
    compile: Any = False
    loss_options: Dict[str, Any] = field(default_factory=dict)

    def __init__(self, **options: Any) -> None:
        own = {f.name: f for f in dataclasses.fields(self) if f.name != "loss_options"}
        loss_names = _loss_field_names()
        loss_options = dict(options.pop("loss_options", None) or {})
        for name, value in options.items():
            if name in own:
                setattr(self, name, value)
            elif name in loss_names:
                loss_options[name] = value
            else:
                raise TypeError(
                    f"GSPOTrainerConfig got an unknown option {name!r}; trainer options are {sorted(own)}, "
                    f"loss options (GSPOConfig) are {sorted(loss_names)}"
                )
        for name, f in own.items():
            if name not in options:
                setattr(self, name, f.default_factory() if f.default is dataclasses.MISSING else f.default)
        self.loss_options = loss_options
        self._validate()

    @property
    def beta(self) -> float:
        """The KL weight of the loss (a loss option; a reference model is kept when it is > 0)."""
        return self.loss_config().beta

    @property
    def temperature(self) -> float:
        """Sampling and log-prob temperature (a loss option)."""
        return self.loss_config().temperature

    def loss_config(self) -> GSPOConfig:
        """The loss's :class:`GSPOConfig`: the loss options given by name, the clip band from
        ``left_clip_range`` / ``right_clip_range``, and ``max_completion_length = max_new_tokens`` unless
        given (the ``dr_grpo`` divisor): :data:`TRAINER_OPTIONS`."""
        return adapter.build_config(TRAINER_OPTIONS, self)

    def _validate(self) -> None:
        adapter.check(TRAINER_OPTIONS, self)  # the clip band given once
        for name in ("group_size", "max_new_tokens", "num_minibatches", "old_model_update_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
        if not is_finite_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not is_finite_number(self.learning_rate) or self.learning_rate < 0:
            raise ValueError(f"learning_rate must be a finite number >= 0, got {self.learning_rate!r}")
        if not is_finite_number(self.weight_decay) or self.weight_decay < 0:
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay!r}")
        if self.max_grad_norm is not None and (not is_finite_number(self.max_grad_norm) or self.max_grad_norm <= 0):
            raise ValueError(f"max_grad_norm must be None or a finite number > 0, got {self.max_grad_norm!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.nan_policy not in NAN_POLICIES:
            raise ValueError(f"nan_policy must be one of {NAN_POLICIES}, got {self.nan_policy!r}")
        for name in ("bf16",):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.use_chat_template not in (None, True, False):
            raise ValueError(f"use_chat_template must be None, True or False, got {self.use_chat_template!r}")
        if not isinstance(self.compile, (bool, dict)) or isinstance(self.compile, dict) and not all(
                isinstance(k, str) for k in self.compile):
            raise ValueError(f"compile must be a bool or a dict of torch.compile keyword arguments, got "
                             f"{self.compile!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        self.loss_config()  # the loss options' own checks, now rather than at the first step

    def to_dict(self) -> Dict[str, Any]:
        """Every option by name (trainer options and loss options), e.g. for a log or a checkpoint."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "loss_options"}
        out.update(self.loss_options)
        return out


# ------------------------------------------------------------------------------------------------ trainer


class GSPOTrainer:
    """GSPO / GRPO training of a ``transformers`` causal LM with the library's fused hidden-state loss.

    Args:
        model: an ``AutoModelForCausalLM``-style model (``get_decoder``, ``get_output_embeddings``,
            ``generate``); trained in place, kept in eval mode (no dropout: the old and current log-probs
            of an unchanged policy must agree).
        tokenizer: its tokenizer (a ``PreTrainedTokenizerBase``); a missing pad token becomes the eos token.
        config: :class:`GSPOTrainerConfig` (default options when None).
        ref_model: the KL reference when ``beta > 0`` (default: a frozen copy of ``model`` as given).
        optimizer: default AdamW over the trainable parameters with the config's learning rate.
    """

    def __init__(self, model: nn.Module, tokenizer: Any, config: Optional[GSPOTrainerConfig] = None, *,
                 ref_model: Optional[nn.Module] = None, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        if config is None:
            config = GSPOTrainerConfig()
        if not isinstance(config, GSPOTrainerConfig):
            raise TypeError(f"config must be a GSPOTrainerConfig, got {type(config).__name__} (the loss's "
                            "GSPOConfig options are accepted by GSPOTrainerConfig by name)")
        _refuse_deepspeed(model)
        self.config = config
        self.loss_config = config.loss_config()
        self.model = model
        self.tokenizer = tokenizer
        self.parts = causal_lm_parts(model)
        self.loss_config = _with_model_softcap(self.loss_config, self.parts.softcap, type(model).__name__)
        self.device = self.parts.weight.device
        self.eos_token_ids = self._eos_ids()
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.pad_token_id = int(tokenizer.pad_token_id)
        self.use_chat_template = self._chat_template_choice()
        model.eval()
        probe = list(range(min(8, self.parts.weight.shape[0])))
        check_logits_path(model, self.parts, probe)
        self.ref_model = None
        if self.loss_config.beta > 0:
            self.ref_model = (ref_model if ref_model is not None else copy.deepcopy(model)).eval().requires_grad_(False)
        self.old_model = None
        if config.old_model_update_interval > 1:
            self.old_model = copy.deepcopy(model).eval().requires_grad_(False)
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = optimizer if optimizer is not None else torch.optim.AdamW(
            params, lr=config.learning_rate, weight_decay=config.weight_decay)
        self.step = 0
        self.last_rollout: Optional[Rollout] = None
        self._minibatch_loss = self._policy_loss
        if config.compile is not False:  # the backbone and the loss: one compiled function
            self._minibatch_loss = torch.compile(self._policy_loss,
                                                 **({} if config.compile is True else config.compile))

    # -- setup helpers

    def _eos_ids(self) -> List[int]:
        ids = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if ids is None:
            ids = self.tokenizer.eos_token_id
        if ids is None:
            raise ValueError("the model's generation_config and the tokenizer define no eos_token_id; "
                             "GSPOTrainer needs one to end completions")
        return [int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])]

    def _chat_template_choice(self) -> bool:
        has = bool(getattr(self.tokenizer, "chat_template", None))
        if self.config.use_chat_template is True and not has:
            raise ValueError("use_chat_template=True but the tokenizer has no chat_template")
        return has if self.config.use_chat_template is None else self.config.use_chat_template

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.config.bf16)

    # -- rollout

    def encode_prompts(self, queries: Sequence[str]) -> List[List[int]]:
        """Token ids of each query (through the chat template when it is used)."""
        if self.use_chat_template:
            texts = [self.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                        add_generation_prompt=True) for q in queries]
            encoded = self.tokenizer(texts, add_special_tokens=False)
        else:
            encoded = self.tokenizer(list(queries))
        ids = [list(map(int, row)) for row in encoded["input_ids"]]
        for q, row in zip(queries, ids):
            if not row:
                raise ValueError(f"query {q!r} encodes to no tokens")
        return ids

    @torch.no_grad()
    def rollout(self, queries: Sequence[str], reward_fn: RewardFn) -> Rollout:
        """Sample ``group_size`` completions per query from the old policy; rewards and advantages."""
        if isinstance(queries, str) or not isinstance(queries, Sequence) or not queries:
            raise ValueError("queries must be a non-empty list of prompt strings")
        if not all(isinstance(q, str) for q in queries):
            raise ValueError("queries must be a list of str")
        g = self.config.group_size
        if len(queries) * g < self.config.num_minibatches:
            raise ValueError(f"{len(queries)} queries x group_size {g} give fewer responses than num_minibatches "
                             f"= {self.config.num_minibatches}")
        prompt_ids = [ids for ids in self.encode_prompts(queries) for _ in range(g)]
        width = max(len(p) for p in prompt_ids)
        input_ids = torch.full((len(prompt_ids), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for r, ids in enumerate(prompt_ids):
            input_ids[r, width - len(ids):] = torch.tensor(ids)
            attention[r, width - len(ids):] = 1
        sampler = self.old_model if self.old_model is not None else self.model
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), self._autocast():
            torch.manual_seed(self.config.seed * 1_000_003 + self.step)
            out = sampler.generate(
                input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device), do_sample=True,
                temperature=self.loss_config.temperature, top_k=self.config.top_k, top_p=self.config.top_p,
                max_new_tokens=self.config.max_new_tokens, pad_token_id=self.pad_token_id,
                eos_token_id=self.eos_token_ids,
            )
        completion = out[:, width:]
        if completion.shape[1] == 0:
            raise RuntimeError("model.generate returned no new tokens")
        mask = completion_mask_of(completion, self.eos_token_ids)
        completion = torch.where(mask > 0, completion, torch.full_like(completion, self.pad_token_id))
        lengths = mask.sum(dim=1).long().tolist()
        texts = self.tokenizer.batch_decode([row[:n] for row, n in zip(completion.tolist(), lengths)],
                                            skip_special_tokens=True)
        prompts = [q for q in queries for _ in range(g)]
        rewards = self._rewards(reward_fn, prompts, texts)
        advantages = group_advantages(rewards, g).to(torch.float32)
        return Rollout(prompts=prompts, completions=texts, prompt_ids=prompt_ids, completion_ids=completion,
                       completion_mask=mask, rewards=rewards.to(self.device), advantages=advantages.to(self.device))

    @staticmethod
    def _rewards(reward_fn: RewardFn, prompts: List[str], completions: List[str]) -> Tensor:
        values = reward_fn(prompts, completions)
        try:
            rewards = torch.as_tensor(values if isinstance(values, Tensor) else list(values),
                                      dtype=torch.float32).detach().cpu().reshape(-1)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"reward_fn must return one number per completion, got {values!r:.200}") from exc
        if rewards.numel() != len(completions):
            raise ValueError(f"reward_fn returned {rewards.numel()} rewards for {len(completions)} completions")
        if not torch.isfinite(rewards).all():
            raise ValueError(f"reward_fn returned non-finite rewards: {rewards.tolist()}")
        return rewards

    @torch.no_grad()
    def score(self, model: nn.Module, rollout: Rollout) -> Tensor:
        """``[S, C]`` fp32 log-probs of the rollout's completions under ``model`` (0 where masked)."""
        weight, bias = self._head_of(model)
        decoder = self.parts.decoder if model is self.model else model.get_decoder()
        out = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32, device=self.device)
        order = torch.arange(rollout.completion_ids.shape[0], device=self.device)
        for rows in torch.tensor_split(order, self.config.num_minibatches):
            mb = build_minibatch(rollout, rows, self.config.layout, self.pad_token_id)
            with self._autocast():
                hidden = self._hidden(decoder, mb)
                logp = self._logprobs(hidden, weight, bias, mb.labels)
            out[rows] = mb.scatter(logp.float(), rollout.completion_mask)
        return out

    def _head_of(self, model: nn.Module) -> Tuple[Tensor, Optional[Tensor]]:
        if model is self.model:
            return self.parts.weight, self.parts.bias
        head = model.get_output_embeddings()
        return head.weight, head.bias

    def _hidden(self, decoder: nn.Module, mb: MiniBatch) -> Tensor:
        hidden = _last_hidden(decoder, mb.input_ids, mb.attention_mask, mb.position_ids)
        if mb.layout == "packed":
            return hidden[0, mb.gather]
        return hidden[:, mb.prompt_width - 1 :]

    def _logprobs(self, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor) -> Tensor:
        cfg = self.loss_config
        if self.config.backend == "reference":
            from gspo_kernels import reference

            return reference.linear_logprobs(hidden, weight, labels, bias=bias, temperature=cfg.temperature,
                                             final_logit_softcapping=cfg.final_logit_softcapping)
        return linear_logprobs(hidden, weight, labels, bias=bias, temperature=cfg.temperature,
                               final_logit_softcapping=cfg.final_logit_softcapping,
                               backend=self.config.backend, memory_budget=self.config.memory_budget)

    # -- loss

    def compute_loss(self, rollout: Rollout, rows: Tensor, *, layout: Optional[str] = None):
        """The :class:`~gspo_kernels.LossOutput` of ``rollout``'s responses ``rows`` under the current policy.

        ``layout`` defaults to the config's. Differentiable for the policy's parameters.
        """
        mb = build_minibatch(rollout, rows, layout or self.config.layout, self.pad_token_id)
        return self._loss(rollout, mb)

    def _loss(self, rollout: Rollout, mb: MiniBatch):
        cm = rollout.completion_mask
        # the rollout's per-token tensors in the mini-batch's layout (a data-dependent selection: outside the
        # compiled function when the config compiles)
        ref = None if rollout.ref_logprobs is None else mb.per_token(rollout.ref_logprobs, cm)
        return self._minibatch_loss(mb, rollout.advantages[mb.rows], mb.per_token(rollout.old_logprobs, cm), ref)

    def _policy_loss(self, mb: MiniBatch, adv: Tensor, old: Tensor, ref: Optional[Tensor]):
        """The backbone's hidden states of ``mb`` and the loss: what ``compile`` compiles."""
        kwargs: Dict[str, Any] = dict(bias=self.parts.bias, mask=mb.mask, cu_seqlens=mb.cu_seqlens,
                                      ref_logprobs=ref, config=self.loss_config)
        with self._autocast():
            hidden = self._hidden(self.parts.decoder, mb)
            if self.config.backend == "reference":
                from gspo_kernels import reference

                return reference.fused_linear_gspo_loss(hidden, self.parts.weight, mb.labels, adv, old, **kwargs)
            return fused_linear_gspo_loss(hidden, self.parts.weight, mb.labels, adv, old,
                                          backend=self.config.backend, memory_budget=self.config.memory_budget,
                                          **kwargs)

    # -- the step

    def train_step(self, queries: Sequence[str], reward_fn: RewardFn) -> Dict[str, float]:
        """One rollout and ``num_minibatches`` optimizer steps; returns the step's metrics.

        Metrics: ``step``, ``reward_mean``/``reward_std``, ``completion_length``, ``loss`` and the loss's
        metrics (clip ratios, importance-weight stats, entropy, KL), averaged over the mini-batches that
        updated; ``grad_norm`` (before clipping); ``nonfinite_skipped`` (mini-batches skipped by
        ``nan_policy="skip"``); ``tokens_per_s/packed`` or ``tokens_per_s/padded`` (completion tokens per
        second of the loss forward + backward + optimizer step), ``model_tokens`` (positions the backbone
        ran on in those passes, padding included), ``completion_tokens``; ``old_model_refreshed``;
        ``rollout_s``, ``step_s``.
        """
        cfg = self.config
        t0 = time.perf_counter()
        refreshed = 0.0
        if self.old_model is not None and self.step % cfg.old_model_update_interval == 0:
            self.old_model.load_state_dict(self.model.state_dict())
            refreshed = 1.0
        rollout = self.rollout(queries, reward_fn)
        rollout.old_logprobs = self.score(self.old_model if self.old_model is not None else self.model, rollout)
        if self.ref_model is not None:
            rollout.ref_logprobs = self.score(self.ref_model, rollout)
        self.last_rollout = rollout
        t_rollout = time.perf_counter() - t0

        S = rollout.completion_ids.shape[0]
        shuffle = torch.Generator().manual_seed(cfg.seed * 7_919 + self.step)
        order = torch.randperm(S, generator=shuffle).to(self.device)
        sums: Dict[str, float] = {}
        updated = skipped = 0
        w_min, w_max = math.inf, -math.inf
        t_train = 0.0
        model_tokens = 0
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for rows in torch.tensor_split(order, cfg.num_minibatches):
            t1 = time.perf_counter()
            mb = build_minibatch(rollout, rows, cfg.layout, self.pad_token_id)
            model_tokens += mb.model_tokens
            self.optimizer.zero_grad(set_to_none=True)
            out = self._loss(rollout, mb)
            problem = None if torch.isfinite(out.loss.detach()).all() else "loss"
            grad_norm = math.nan
            if problem is None:
                out.loss.backward()
                grad_norm = float(_grad_norm(params))
                if not math.isfinite(grad_norm):
                    problem = "gradient of " + self._first_nonfinite_grad()
            if problem is not None:
                self.optimizer.zero_grad(set_to_none=True)
                if cfg.nan_policy == "raise":
                    raise FloatingPointError(f"non-finite {problem} at step {self.step}; no update was made")
                skipped += 1
                t_train += time.perf_counter() - t1
                continue
            if cfg.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            self.optimizer.step()
            bad = self._first_nonfinite_weight()
            if bad is not None:
                raise FloatingPointError(f"parameter {bad} became non-finite after the update at step {self.step}")
            t_train += time.perf_counter() - t1
            updated += 1
            values = {"loss": float(out.loss.detach()), "grad_norm": grad_norm}
            values.update({name: float(v) for name, v in out.metrics.items()})
            w_min = min(w_min, values.pop("importance_weight/min", w_min))
            w_max = max(w_max, values.pop("importance_weight/max", w_max))
            for name, value in values.items():
                sums[name] = sums.get(name, 0.0) + value
        tokens = float(rollout.completion_mask.sum())
        metrics: Dict[str, float] = {
            "step": float(self.step),
            "reward_mean": float(rollout.rewards.mean()),
            "reward_std": float(rollout.rewards.std()) if S > 1 else 0.0,
            "completion_length": tokens / S,
        }
        metrics.update({name: total / updated for name, total in sums.items()} if updated else {"loss": math.nan})
        if updated:
            metrics["importance_weight/min"] = w_min
            metrics["importance_weight/max"] = w_max
        metrics.update({
            "nonfinite_skipped": float(skipped),
            f"tokens_per_s/{cfg.layout}": tokens / max(t_train, 1e-12),
            "model_tokens": float(model_tokens),
            "completion_tokens": tokens,
            "old_model_refreshed": refreshed,
            "rollout_s": t_rollout,
            "step_s": time.perf_counter() - t0,
        })
        self.step += 1
        return metrics

    def _named(self) -> List[Tuple[str, Tensor]]:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def _first_nonfinite_grad(self) -> str:
        for name, p in self._named():
            if p.grad is not None and not torch.isfinite(p.grad).all():
                return name
        return "?"

    def _first_nonfinite_weight(self) -> Optional[str]:
        for name, p in self._named():
            if not torch.isfinite(p.detach()).all():
                return name
        return None

    # -- checkpoints

    def save(self, path: Union[str, Path]) -> Path:
        """Write the policy, optimizer, old policy, reference model, step and config to ``path/``.

        Returns the checkpoint file. The sampling RNG is derived from ``(seed, step)``, so a loaded
        trainer's next step is the same as an uninterrupted run's.
        """
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        state = {
            "format": 1,
            "step": self.step,
            "config": self.config.to_dict(),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "old_model": None if self.old_model is None else self.old_model.state_dict(),
            "ref_model": None if self.ref_model is None else self.ref_model.state_dict(),
        }
        file = folder / CHECKPOINT_FILE
        torch.save(state, file)
        return file

    def load(self, path: Union[str, Path]) -> None:
        """Restore a :meth:`save` checkpoint (``path`` is its folder or file) into this trainer.

        The trainer must have been built with the same model architecture and the same config; a config
        that differs raises ``ValueError`` naming the options.
        """
        file = Path(path)
        if file.is_dir():
            file = file / CHECKPOINT_FILE
        if not file.is_file():
            raise FileNotFoundError(f"no GSPOTrainer checkpoint at {file}")
        state = torch.load(file, map_location=self.device, weights_only=False)
        if state.get("format") != 1:
            raise ValueError(f"{file} is not a GSPOTrainer checkpoint (format {state.get('format')!r})")
        mine = self.config.to_dict()
        differ = sorted(k for k in set(mine) | set(state["config"]) if mine.get(k) != state["config"].get(k))
        if differ:
            raise ValueError(f"the checkpoint's config differs from this trainer's in {differ}")
        for name, module in (("old_model", self.old_model), ("ref_model", self.ref_model)):
            if (state[name] is None) != (module is None):
                raise ValueError(f"the checkpoint's {name} does not match this trainer's")
            if module is not None:
                module.load_state_dict(state[name])
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])


def _grad_norm(params: Sequence[Tensor]) -> Tensor:
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads]))
