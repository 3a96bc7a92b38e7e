"""OpenRLHF integration: its ``PolicyLoss`` on the library's sequence stage, its ``Actor`` with log-probs and entropy
from the last hidden states and the lm_head weight (no ``[B, S, V]`` logits), switched on in every Ray worker.

One call in every process that builds OpenRLHF's trainer (the driver and each Ray worker)::

    from gspo_kernels.integrations import openrlhf as gk_openrlhf
    gk_openrlhf.enable()

or, for the whole job, the launcher in place of ``python -m openrlhf.cli.train_ppo_ray``::

    python -m gspo_kernels.integrations.openrlhf --actor.policy_loss_type gspo ...   # train_ppo_ray's arguments

:func:`enable` makes ``openrlhf.models.Actor`` / ``PolicyLoss`` and the names OpenRLHF's trainer modules bound
at import (``openrlhf.trainer.ray.ppo_actor``: the policy and its loss; ``openrlhf.trainer.ray.launcher``: the
reference model) the classes below, and adds :func:`setup_worker` to the ``runtime_env`` of the ``ray.init`` the
driver calls next (Ray's ``worker_process_setup_hook``), so that each Ray worker makes the same replacement
before it builds its actor: OpenRLHF builds its models inside Ray workers, where a patch made only in the driver
changes nothing. On a Ray cluster started apart (``ray job submit``), put the hook in the job's runtime env:
``--runtime-env-json '{"worker_process_setup_hook": "gspo_kernels.integrations.openrlhf.setup_worker"}'``.

:class:`PolicyLoss` takes OpenRLHF 0.11.2's constructor and ``forward`` and returns its five values
``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)``; the loss comes from :func:`gspo_kernels.policy_loss`
(the fused Triton sequence stage on CUDA): ``ppo`` is the token level with the log-ratio clamped at 20 (OpenRLHF
also clamps it at -20 below, which changes a weight by at most ``e^-20``; the library does not), ``gspo`` the
sequence level (against the rollout's log-probs when a mismatch correction is on, as OpenRLHF), dual clip, the
token-mean or per-sample aggregation with OpenRLHF's global counts and ``dp_size``, and the mismatch correction
as the library's ``rollout_correction`` modes: ``token_mask`` / ``token_truncate`` (ratio gate, token level, mask
/ clip), ``sequence_geometric_mask`` (ratio, sequence level), ``token|sequence_binary_kl_mask`` and
``token|sequence_tv_mask`` (the divergence gates). Combinations OpenRLHF refuses are refused (its own checks
run), and so are thresholds the library cannot express (a band with ``low > high``, a non-positive ``high``).

:class:`Actor` is OpenRLHF's ``Actor`` (same constructor; an instance of it) whose ``forward`` runs the model with
its lm_head replaced for the call by a step that keeps the hidden states it is given and computes nothing, then
the log-probs (and the entropy) with :func:`gspo_kernels.linear_logprobs`. What it returns is what OpenRLHF's
returns, but ``output["logits"]`` is None (never formed); ``output`` keeps everything else the model returned
(the MoE router's ``aux_loss``, ...) and ``output.entropy`` when ``return_entropy``.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import warnings
from importlib import metadata
from typing import Any, Optional, Sequence, Tuple

import openrlhf.models as openrlhf_models
import torch
from openrlhf.models.ring_attn_utils import gather_and_pad_tensor, unpad_and_slice_tensor
from torch import Tensor

from gspo_kernels import backends
from gspo_kernels.checks import check_memory_budget, check_softcap
from gspo_kernels.integrations import adapter
from gspo_kernels.loss import linear_logprobs, policy_loss

TESTED_OPENRLHF = "0.11.2"
PPO_LOG_RATIO_CLAMP = 20.0  # OpenRLHF's ppo: clamp(-20, 20) before exp
# OpenRLHF's is_correction_* (level, gating, mode) as the library's rollout_correction modes
CORRECTION_MODES = {
    ("token", "ratio", "mask"): "token_mask",
    ("token", "ratio", "clip"): "token_truncate",
    ("seq", "ratio", "mask"): "sequence_geometric_mask",
    ("token", "binary_kl", "mask"): "token_binary_kl_mask",
    ("seq", "binary_kl", "mask"): "sequence_binary_kl_mask",
    ("token", "tv", "mask"): "token_tv_mask",
    ("seq", "tv", "mask"): "sequence_tv_mask",
}
# What enable() replaces: (module, attribute) -> the library's class
_TARGETS = (
    ("openrlhf.models", "Actor"),
    ("openrlhf.models", "PolicyLoss"),
    ("openrlhf.trainer.ray.ppo_actor", "Actor"),
    ("openrlhf.trainer.ray.ppo_actor", "PolicyLoss"),
    ("openrlhf.trainer.ray.launcher", "Actor"),
)
HOOK = "gspo_kernels.integrations.openrlhf.setup_worker"
BACKEND_ENV = "GSPO_KERNELS_OPENRLHF_BACKEND"  # the library backend the Ray workers use (enable(backend=...))


def untested_version_warning(installed: Optional[str]) -> Optional[str]:
    """The warning an OpenRLHF version other than the tested one gets (None for the tested one)."""
    if installed == TESTED_OPENRLHF:
        return None
    return (f"gspo_kernels' OpenRLHF integration was tested with openrlhf=={TESTED_OPENRLHF}; openrlhf {installed} is "
            f"installed: the parity with OpenRLHF's PolicyLoss and Actor is unchecked there")


def _check_version() -> None:
    """One warning per process (at :func:`enable`, :func:`setup_worker` or the first class built) when the
    installed OpenRLHF is not the tested version."""
    try:
        installed = metadata.version("openrlhf")
    except metadata.PackageNotFoundError:  # pragma: no cover - OpenRLHF imported from a source tree
        installed = None
    message = untested_version_warning(installed)
    if message is not None:
        _warn_once("version", message)


_WARNED = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)


def _check_backend(backend: str) -> str:
    if backend != "auto" and backend not in backends.BACKENDS:
        raise ValueError(f"backend must be one of {('auto',) + backends.BACKENDS}, got {backend!r}")
    return backend


# ----------------------------------------------------------------------------------------------- PolicyLoss


def _threshold(loss: Any) -> Tuple[float, float]:
    """OpenRLHF's ``is_correction_threshold`` as ``(low, high)``, checked."""
    low, high = (float(x) for x in loss.is_correction_threshold)
    if not high > 0 or not math.isfinite(high):
        raise ValueError(f"is_correction_threshold's high must be a finite number > 0, got {high}")
    if low > high:
        raise ValueError(f"is_correction_threshold ({low}, {high}): low > high keeps no token")
    return low, high


def _corrected(loss: Any) -> bool:
    return loss.correction is not None


def _ppo(loss: Any) -> bool:
    return loss.policy_loss_type == "ppo"


# OpenRLHF's PolicyLoss options as the library's (read from the PolicyLoss, after OpenRLHF's constructor).
OPENRLHF = adapter.Declaration("OpenRLHF", rules=(
    adapter.rename("epsilon_low", "clip_eps_low", convert=float),
    adapter.rename("epsilon_high", "clip_eps_high", convert=float),
    adapter.rename("clip_ratio_c", "dual_clip", convert=lambda c: None if c is None else float(c)),
    adapter.constant("rollout_correction_max", None),
    # ppo: token ratios, clamped as OpenRLHF clamps them; gspo: the sequence ratio
    adapter.derived("importance_sampling_level", lambda loss: "token" if _ppo(loss) else "sequence"),
    adapter.constant("log_ratio_clamp", PPO_LOG_RATIO_CLAMP, when=_ppo),
    # the aggregation: token mean (a global token count: dapo) or the mean of per-sequence token means
    adapter.derived("loss_type", lambda loss: "dapo" if loss.token_level_loss else "grpo"),
    # the mismatch correction: its mode (PolicyLoss.correction), the threshold's high as C_max; the ratio and the
    # divergences are never negative: a negative low bounds nothing
    adapter.rename("rollout_correction", "correction", when=_corrected),
    adapter.derived("rollout_correction_max", lambda loss: _threshold(loss)[1], when=_corrected),
    adapter.derived("rollout_correction_min", lambda loss: _threshold(loss)[0] if _threshold(loss)[0] >= 0 else None,
                    when=_corrected),
), refusals=(
    # OpenRLHF refuses it only in forward; the library at once
    adapter.Refusal("policy_loss_type", lambda value: value in ("ppo", "gspo"),
                    "{option} must be 'ppo' or 'gspo', got {value!r}"),
    adapter.Refusal("dual_clip", lambda value: value is None or value > 1.0,  # OpenRLHF asserts the same
                    "{option} must be > 1.0 (or None), got {value}"),
))


class PolicyLoss(openrlhf_models.PolicyLoss):
    """OpenRLHF's ``PolicyLoss`` (same constructor, ``forward`` and returns) computed by the library's sequence stage.

    Args:
        clip_eps_low, clip_eps_high, dual_clip, token_level_loss, policy_loss_type, is_correction_level,
            is_correction_mode, is_correction_gating, is_correction_threshold: OpenRLHF's (see the module docstring
            for how each maps onto :class:`gspo_kernels.GSPOConfig`).
        backend: the library backend (``"auto"``: the Triton kernels on CUDA); default: the one :func:`enable` set.
    """

    backend = "auto"

    def __init__(self, clip_eps_low: float = 0.2, clip_eps_high: float = 0.2, dual_clip: Optional[float] = None,
                 token_level_loss: bool = True, policy_loss_type: str = "ppo", is_correction_level: str = "off",
                 is_correction_mode: str = "mask", is_correction_gating: str = "ratio",
                 is_correction_threshold: Sequence[float] = (0.5, 5.0), *, backend: Optional[str] = None) -> None:
        _check_version()
        # the declaration's refusals before OpenRLHF's own constructor (which asserts on dual_clip)
        adapter.check(OPENRLHF, dict(policy_loss_type=policy_loss_type, dual_clip=dual_clip))
        super().__init__(clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high, dual_clip=dual_clip,
                         token_level_loss=token_level_loss, policy_loss_type=policy_loss_type,
                         is_correction_level=is_correction_level, is_correction_mode=is_correction_mode,
                         is_correction_gating=is_correction_gating, is_correction_threshold=is_correction_threshold)
        if backend is not None:
            self.backend = _check_backend(backend)
        self.correction = self._correction()
        try:
            self.config = adapter.build_config(OPENRLHF, self)
        except ValueError as exc:
            raise ValueError(f"gspo_kernels' OpenRLHF PolicyLoss cannot compute these options: {exc}") from None

    def _correction(self) -> Optional[str]:
        """The library's rollout_correction mode of OpenRLHF's mismatch correction (None: none, or ``gspo``,
        whose correction is to take the ratio against the rollout's log-probs)."""
        if self.is_correction_level == "off" or self.policy_loss_type != "ppo":
            return None
        return CORRECTION_MODES[(self.is_correction_level, self.is_correction_gating, self.is_correction_mode)]

    def forward(self, log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor,
                action_mask: Optional[Tensor] = None, rollout_log_probs: Optional[Tensor] = None, dp_size: int = 1,
                batch_num_tokens: Optional[Any] = None, global_batch_size: Optional[Any] = None):
        """OpenRLHF's ``forward``: ``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)``, the last two None
        unless a ``ppo`` mismatch correction is on. Per-token ``[B, T]`` tensors (``advantages`` too)."""
        mask = torch.ones_like(log_probs, dtype=torch.bool) if action_mask is None else action_mask.to(torch.bool)
        corrected = self.is_correction_level != "off"
        if corrected and rollout_log_probs is None:
            raise ValueError(f"rollout_log_probs is required when is_correction_level={self.is_correction_level!r}")
        # gspo with a correction: the sequence ratio against the rollout's log-probs (OpenRLHF's), no gate
        old = rollout_log_probs if corrected and self.policy_loss_type == "gspo" else old_log_probs
        rollout = rollout_log_probs if self.correction is not None else None
        num_items, scale = None, None
        if self.token_level_loss:
            num_items = batch_num_tokens  # None: this batch's unmasked tokens
            if batch_num_tokens is not None:
                scale = dp_size
        else:  # the library's grpo divides by every row; OpenRLHF by the non-empty ones, or the global count
            rows = mask.shape[0]
            if global_batch_size is None:
                scale = rows / mask.any(dim=-1).sum().clamp(min=1)
            else:
                scale = rows * dp_size / torch.as_tensor(global_batch_size, device=log_probs.device)
        out = policy_loss(log_probs, advantages, old, mask=mask, rollout_logprobs=rollout, num_items_in_batch=num_items,
                          config=self.config, backend=self.backend)
        # (OpenRLHF's factor after the library's loss: a second rounding of it in the loss's dtype)
        loss = out.loss if scale is None else (out.loss * scale).to(out.loss.dtype)
        metrics = out.metrics
        with torch.no_grad():
            fmask = mask.to(torch.float32)
            count = fmask.sum().clamp(min=1)
            ppo_kl = ((old_log_probs.detach() - log_probs.detach()).float() * fmask).sum() / count
        vllm_kl = is_filter_ratio = None
        if self.correction is not None:
            vllm_kl = metrics["rollout/kl"]
            is_filter_ratio = metrics["rollout/is_filter_ratio"]
            if self.is_correction_level == "seq":  # OpenRLHF: over every row, an empty row counted as filtered
                rows = mask.shape[0]
                nonempty = mask.any(dim=-1).sum().to(torch.float32)
                is_filter_ratio = (is_filter_ratio * nonempty + (rows - nonempty)) / max(rows, 1)
        return (loss, metrics["clip_ratio/region_mean"], ppo_kl.to(log_probs.dtype),
                None if vllm_kl is None else vllm_kl.to(log_probs.dtype), is_filter_ratio)


# ---------------------------------------------------------------------------------------------------- Actor


class _HeadInput:
    """For one call of the model: the lm_head keeps the hidden states it is given and returns an empty
    ``[..., 0]`` tensor instead of the logits (the module's hooks, e.g. DeepSpeed ZeRO-3's, still run).

    The hidden states are taken by a forward pre-hook that runs before the module's other hooks: DeepSpeed ZeRO-3's
    own pre-hook wraps a module's inputs in a function whose backward releases the module's parameters, a backward
    that must not run for an lm_head whose forward was skipped (DeepSpeed asserts that its pre-backward ran first)."""

    def __init__(self, head: torch.nn.Module) -> None:
        self.head = head
        self.calls = []

    def __enter__(self) -> "_HeadInput":
        def keep(module, args):
            self.calls.append(args[0])

        def skip(hidden, *args, **kwargs):
            return hidden.new_empty((*hidden.shape[:-1], 0))

        self.saved = self.head.__dict__.get("forward")
        self.handle = self.head.register_forward_pre_hook(keep, prepend=True)
        self.head.forward = skip
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()
        if self.saved is None:
            del self.head.forward
        else:
            self.head.forward = self.saved

    def hidden(self, model: torch.nn.Module) -> Tensor:
        if len(self.calls) != 1:
            raise RuntimeError(f"{type(model).__name__}'s forward called its output embeddings (lm_head) "
                               f"{len(self.calls)} times, not once: gspo_kernels' OpenRLHF Actor cannot take the "
                               f"hidden states of this model")
        return self.calls[0]


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside OpenRLHF's ``Actor.model``: the DeepSpeed engine's ``module``, a PEFT
    model's base model, or the model itself."""
    inner = getattr(model, "module", None)
    if isinstance(inner, torch.nn.Module):
        model = inner
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


_LOGIT_SCALES = ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")


def lm_head(model: torch.nn.Module) -> Tuple[torch.nn.Linear, Optional[float]]:
    """The lm_head (a plain ``nn.Linear``) of the Hugging Face model and its ``final_logit_softcapping``; a model
    that scales its logits after the lm_head is refused, naming the option."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or hasattr(head, "lora_A"):
        raise ValueError("gspo_kernels' OpenRLHF Actor needs a plain linear lm_head (its weight is the projection), "
                         f"got {type(head).__name__}; keep lm_head out of the adapter's target modules")
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name in _LOGIT_SCALES:
        value = getattr(config, name, None)
        if value is not None and float(value) != 1.0:
            raise ValueError(f"gspo_kernels' OpenRLHF Actor does not support models that scale their logits after "
                             f"the lm_head ({type(config).__name__}.{name} = {value})")
    return head, check_softcap(getattr(config, "final_logit_softcapping", None))


class Actor(openrlhf_models.Actor):
    """OpenRLHF's ``Actor`` whose log-probs and entropy come from the last hidden states and the lm_head weight
    through :func:`gspo_kernels.linear_logprobs` (the module docstring says what ``output`` holds).

    Args:
        *args, **kwargs: OpenRLHF's ``Actor`` constructor.
        gspo_backend: the library backend (default: the one :func:`enable` set, ``"auto"``).
        gspo_memory_budget: the head's ``memory_budget`` in bytes (:func:`gspo_kernels.linear_logprobs`);
            None: the library's default.
    """

    gspo_backend = "auto"

    def __init__(self, *args: Any, gspo_backend: Optional[str] = None, gspo_memory_budget: Optional[int] = None,
                 **kwargs: Any) -> None:
        _check_version()
        super().__init__(*args, **kwargs)
        if gspo_backend is not None:
            self.gspo_backend = _check_backend(gspo_backend)
        try:
            self.gspo_memory_budget = check_memory_budget(gspo_memory_budget)
        except ValueError as exc:
            raise ValueError(f"gspo_memory_budget: {exc}") from None
        if not hasattr(self, "packing_samples"):  # OpenRLHF sets it only when it loads the model itself
            self.packing_samples = False

    def forward(self, sequences: torch.LongTensor, action_mask: Optional[Tensor] = None,
                attention_mask: Optional[Tensor] = None, return_output: bool = False, allgather_logits: bool = False,
                return_logprobs: bool = False, ring_attn_group: Optional[Any] = None,
                packed_seq_lens: Optional[list] = None, return_entropy: bool = False, **mm_inputs: Any):
        """OpenRLHF's ``Actor.forward``: the action log-probs ``[B, A]`` (times ``action_mask``), or with
        ``return_logprobs`` and no ``action_mask`` the log-probs of every position ``[B, S - 1]``; with
        ``return_output`` also ``output`` (``logits`` None; ``entropy [B, S - 1]`` when ``return_entropy``).

        Without ``action_mask`` and ``return_logprobs`` the caller asks for the logits themselves: OpenRLHF's
        forward runs (so does it for a vision-language model, with one warning)."""
        if action_mask is None and not return_logprobs or getattr(self, "is_vlm", False):
            if getattr(self, "is_vlm", False):
                _warn_once("vlm", "gspo_kernels' OpenRLHF Actor: a vision-language model runs OpenRLHF's own forward "
                                  "(full logits); the library's head is used for text models only")
            return super().forward(sequences, action_mask, attention_mask, return_output, allgather_logits,
                                   return_logprobs, ring_attn_group, packed_seq_lens, return_entropy, **mm_inputs)
        if return_entropy and not return_output:
            raise ValueError("return_entropy=True needs return_output=True (the entropy is output.entropy)")
        batch, seqlen = sequences.shape
        if self.packing_samples:
            tokens, position_ids, labels, ring_pad, indices = unpad_and_slice_tensor(sequences, attention_mask,
                                                                                     ring_attn_group)
            forward_mask = None
        else:
            tokens, labels, forward_mask = sequences, torch.roll(sequences, shifts=-1, dims=1), attention_mask
            position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill_(attention_mask == 0, 1)
        model = causal_lm(self.model)
        head, softcap = lm_head(model)
        with _HeadInput(head) as head_input:
            output = self.model(tokens, attention_mask=forward_mask, position_ids=position_ids, **mm_inputs)
        hidden = head_input.hidden(model)
        output["logits"] = None

        window = None  # the positions whose log-probs are needed: all of them, or the action window
        if not self.packing_samples and action_mask is not None and not return_entropy and not return_logprobs:
            window = action_mask.shape[1]
            hidden, labels = hidden[:, -window - 1:-1], labels[:, -window - 1:-1]
        result = linear_logprobs(hidden, head.weight, labels.to(torch.int64), bias=head.bias,
                                 temperature=float(self.temperature), return_entropy=return_entropy,
                                 final_logit_softcapping=softcap, backend=self.gspo_backend,
                                 memory_budget=self.gspo_memory_budget)
        log_probs, entropy = result if return_entropy else (result, None)
        if self.packing_samples:
            log_probs = gather_and_pad_tensor(log_probs, ring_attn_group, ring_pad, indices, batch, seqlen)
            if entropy is not None:
                entropy = gather_and_pad_tensor(entropy, ring_attn_group, ring_pad, indices, batch, seqlen)
        if window is None:
            log_probs = log_probs[:, :-1]
            if entropy is not None:
                output.entropy = entropy[:, :-1]  # an attribute, as OpenRLHF sets it
        if action_mask is None:
            return (log_probs, output) if return_output else log_probs
        action_log_probs = log_probs[:, -action_mask.shape[1]:] * action_mask.float()
        return (action_log_probs, output) if return_output else action_log_probs


# ----------------------------------------------------------------------------------------------- switching on


def enable(*, backend: str = "auto") -> None:
    """Make OpenRLHF's trainer build :class:`Actor` and :class:`PolicyLoss` in this process, and every Ray worker
    that a ``ray.init`` called after this starts (the hook :func:`setup_worker` in its ``runtime_env``).

    ``backend``: the library backend of both (``"auto"``: Triton on CUDA); the workers read it from
    ``GSPO_KERNELS_OPENRLHF_BACKEND``, which this sets."""
    backend = _check_backend(backend)
    _check_version()
    os.environ[BACKEND_ENV] = backend
    _patch(backend)
    _hook_ray_init()


def setup_worker() -> None:
    """Ray's ``worker_process_setup_hook``: :func:`enable`'s replacement in a Ray worker process (the backend from
    ``GSPO_KERNELS_OPENRLHF_BACKEND``, default ``"auto"``)."""
    _check_version()
    _patch(_check_backend(os.environ.get(BACKEND_ENV, "auto")))


def runtime_env(env: Optional[dict] = None) -> dict:
    """``env`` (a Ray ``runtime_env``) with :func:`setup_worker` as its ``worker_process_setup_hook`` and the
    backend in its ``env_vars``; refused when ``env`` already has another hook."""
    env = dict(env or {})
    hook = env.get("worker_process_setup_hook")
    if hook not in (None, HOOK, setup_worker):
        raise ValueError(f"the runtime_env already has a worker_process_setup_hook ({hook!r}); call "
                         f"gspo_kernels.integrations.openrlhf.setup_worker() from it")
    env["worker_process_setup_hook"] = HOOK
    env_vars = dict(env.get("env_vars") or {})
    env_vars.setdefault(BACKEND_ENV, os.environ.get(BACKEND_ENV, "auto"))
    env["env_vars"] = env_vars
    return env


def _patch(backend: str) -> None:
    PolicyLoss.backend = backend
    Actor.gspo_backend = backend
    classes = {"Actor": Actor, "PolicyLoss": PolicyLoss}
    for module_name, name in _TARGETS:
        module = importlib.import_module(module_name)
        setattr(module, name, classes[name])


def _hook_ray_init() -> None:
    """Wrap ``ray.init`` (once) so that the job's workers run :func:`setup_worker` (OpenRLHF's driver calls
    ``ray.init(runtime_env=...)`` itself)."""
    import ray

    if getattr(ray.init, "_gspo_kernels", False):
        return
    original = ray.init

    def init(*args, **kwargs):
        kwargs["runtime_env"] = runtime_env(kwargs.get("runtime_env"))
        return original(*args, **kwargs)

    init._gspo_kernels = True
    init.__wrapped__ = original
    ray.init = init


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m gspo_kernels.integrations.openrlhf ARGS``: ``python -m openrlhf.cli.train_ppo_ray ARGS`` with
    :func:`enable` on (the library backend from ``GSPO_KERNELS_OPENRLHF_BACKEND``, default ``"auto"``)."""
    import runpy

    # the module itself, not this file run as __main__ (whose classes would be a second copy)
    launcher = importlib.import_module("gspo_kernels.integrations.openrlhf")
    launcher.enable(backend=os.environ.get(BACKEND_ENV, "auto"))
    sys.argv = ["openrlhf.cli.train_ppo_ray", *(sys.argv[1:] if argv is None else argv)]
    runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
