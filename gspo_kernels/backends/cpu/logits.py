"""``backend="cpu"``, logits path: ``logits [N, V]`` / ``[B, T, V]`` -> ``(logp, entropy)`` through the C++
operators ``logits_fwd`` / ``logits_bwd(_)``, and :func:`release_buffers`."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from gspo_kernels.backends.cpu.ops import _cap_arg, _flags, _fp64_fallback, _load_extension
from gspo_kernels.backends.tiling import next_token_base
from gspo_kernels.options import DEFAULT_OPTIONS, CallOptions


def logits_logprobs(logits: Tensor, labels: Tensor, active: Optional[Tensor] = None,
                    options: CallOptions = DEFAULT_OPTIONS) -> Tuple[Tensor, Optional[Tensor]]:
    """Per-token ``(logp [N], entropy [N] | None)`` from ``logits [N, V]`` / ``[B, T, V]``.

    fp16/bf16/fp32 logits give fp32 outputs (fp32 math); fp64 logits give fp64 outputs (the
    ``torch`` backend's fp64 math). Any strides with a unit last stride are read in place (e.g.
    ``logits[:, :-1]``); other layouts are copied once. With ``options.inplace_backward`` the gradient is
    written into the logits' storage. ``options.softcap``: see the backend contract (the cap is computed in fp32).

    A model's ``[B, T + 1, V]`` output read as ``logits[:, :-1]`` is recognised
    (:func:`gspo_kernels.backends.tiling.next_token_base`, as the Triton backend does): the operators take the
    base, read its first ``T`` positions, and the backward writes the base's gradient itself (zeros at the last
    position), so autograd's ``slice_backward`` never allocates and zero-fills a second ``[B, T + 1, V]``
    buffer: one logits-sized allocation out of place, none with ``inplace_backward``. Same bits either way.
    """
    if logits.dtype == torch.float64:
        return _fp64_fallback("logits").logits_logprobs(logits, labels, active, options)
    temperature, return_entropy, softcap = options.temperature, options.return_entropy, options.softcap
    if logits.dim() not in (2, 3):
        logits = logits.reshape(-1, logits.shape[-1])
    if logits.shape[-1] > 1 and logits.stride(-1) != 1:
        logits = logits.contiguous()
    labels, active = _flags(labels, active)
    base = next_token_base(logits) if torch.is_grad_enabled() and not torch.compiler.is_compiling() else None
    extra = dict(extra_position=True) if base is not None else {}
    logp, entropy, _lse = torch.ops.gspo_kernels.logits_fwd(
        logits if base is None else base, labels, active, float(temperature), bool(return_entropy),
        bool(options.inplace_backward), *_cap_arg(softcap), **extra,
    )
    return logp, (entropy if return_entropy else None)


def release_buffers() -> None:
    """Free the buffers the backend keeps between calls: the logits path's out-of-place gradient and the
    hidden-state path's saved logits (each reused by the next call once nothing holds it, like the gradient below).

    The backward of :func:`logits_logprobs` (``inplace_backward=False``) writes each gradient into the storage of
    the previous one once nothing else holds it (fresh memory on every step cost page faults, zero-filling and,
    in a VM that reports free pages to its host, host faults: steps of the same inputs varied up to 4x; see
    ``docs/cpu_backends.md``). That keeps one gradient-sized buffer (``[B, T, V]`` or ``[B, T + 1, V]`` in the
    logits' dtype) allocated between steps, and one saved-logits buffer (up to ``memory_budget`` bytes); this frees
    them. ``GSPO_KERNELS_CPU_KEEP_GRADIENT=0`` in the environment (read once per process) never keeps either.
    """
    _load_extension()
    torch.ops.gspo_kernels.release_buffers()
