"""The options of one public call, in one frozen object: :class:`CallOptions`, built and checked once by the
public function and passed down as it is to the pipeline, the heads, the backends' stage functions and their
autograd Functions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from gspo_kernels.checks import check_bool, check_memory_budget, check_softcap, check_temperature

if TYPE_CHECKING:
    from gspo_kernels.config import GSPOConfig
    from gspo_kernels.parallel import VocabParallel


@dataclass(frozen=True)
class CallOptions:
    """The options of one public call, each checked once as the public function builds this object, then
    passed down as one to the pipeline (``loss._run``, ``loss._run_logprobs``), the heads and the backends' stage
    functions (:mod:`gspo_kernels.backends.contract` says which fields a stage reads).

    ``temperature`` and ``softcap`` are the one source of the logits' temperature and soft cap for every stage
    (the per-token functions' arguments; for a loss, a copy of its config's ``temperature`` and
    ``final_logit_softcapping``, which must agree: see :meth:`__post_init__`); a stage never reads the config's.
    ``return_entropy`` is always True for a loss (the objective may use it). ``config`` is None for the
    per-token functions. Options only: the call's tensors, inputs and outputs (``logprobs_out``), travel in
    :class:`~gspo_kernels.layout.LossTensors` / ``LossInputs``.
    """

    config: Optional[GSPOConfig] = None
    backend: str = "auto"
    check_finite: bool = False
    temperature: float = 1.0
    softcap: Optional[float] = None
    return_entropy: bool = False
    inplace_backward: bool = False
    vocab_parallel: Optional[VocabParallel] = None
    fp32_head: bool = False
    memory_budget: Optional[int] = None
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        """Each option checked once, here, as the object is built by the public function (which checks nothing of
        its own): the errors name the public arguments (``softcap`` is the functions' ``final_logit_softcapping``),
        and a backend receives checked options and never checks them again.

        With a ``config`` (a loss), ``temperature`` and ``softcap`` must be the config's ``temperature`` and
        ``final_logit_softcapping`` (checked when the config was built; here only compared, and made floats):
        options that disagree with their config are refused, so the two can never give the stages two answers."""
        config = self.config
        if config is None:
            object.__setattr__(self, "temperature", check_temperature(self.temperature))
            object.__setattr__(self, "softcap", check_softcap(self.softcap))
        else:
            if self.temperature != config.temperature or self.softcap != config.final_logit_softcapping:
                raise ValueError(f"CallOptions: temperature {self.temperature!r} and softcap {self.softcap!r} must be "
                                 f"the config's temperature {config.temperature!r} and final_logit_softcapping "
                                 f"{config.final_logit_softcapping!r} (the stages read the options' only)")
            object.__setattr__(self, "temperature", float(self.temperature))
            object.__setattr__(self, "softcap", None if self.softcap is None else float(self.softcap))
        check_memory_budget(self.memory_budget)
        for name in ("check_finite", "return_entropy", "inplace_backward", "fp32_head", "batch_invariant"):
            check_bool(name, getattr(self, name))


DEFAULT_OPTIONS = CallOptions()
"""The options of a stage function called without any: temperature 1, no entropy, no cap, the default budget."""
