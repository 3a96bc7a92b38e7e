"""The fused sequence stage: ``(logp [N], entropy [N]) -> loss`` with importance weights, clipping, IS
correction, KL, aggregation, metrics and gradients; and the backend's objective, :func:`fused_objective`.

Two launches (:func:`sequence_stage`), both deterministic (fixed reduction order, no floating-point atomics):

1. :func:`gspo_sequence_kernel`, one program per response ``i`` (a 1-D grid over ``cu_seqlens``; the padded
   layout arrives as regular ``cu_seqlens``). Pass 1 sums ``mask`` and ``mask * (logp - old)`` over the
   response; pass 2 computes, per token, the weight ``w``, the clipped surrogate ``l_t`` (times
   ``is_ratio``, plus ``beta * kl_t``), the response's partial sums (loss, tokens, entropy, KL, clip
   counts, weight stats; the columns ``P_*``) and the gradient coefficient ``c_t = dL/dlogp_t`` up to the
   global divisor; pass 3 (``"sequence"`` level only) adds the term that flows through the response's mean
   log-ratio, ``w_i / |y_i| * sum_t' mask_t' dl_t'/dw``.
2. :func:`gspo_reduce_kernel`, a single program: sums the ``[S, PARTIALS_STRIDE]`` partials in a fixed
   order and writes the loss, the metrics and the two global gradient scales (the slots ``O_*``).

:class:`TritonSequenceObjective` turns the coefficients into gradients with
``dL/dlogp = c * (grad_out * out[O_SCALE_LOGP])`` and ``dL/dH = mask * (grad_out * out[O_SCALE_ENTROPY])``:
it saves the per-token coefficients ``[N]``, so its backward is two ``[N]`` multiplications.

Per token (docs/math.md): ``c1 = min(w, delta)``, ``c2 = clamp(w, 1 - eps_low, 1 + eps_high)``,
``l = -min(c1 A, c2 A)``. ``dl/dw`` follows PyTorch's subgradients of the reference: the clamps pass the
gradient on their closed intervals, and a tie ``c1 A == c2 A`` splits it in halves (``torch.minimum``).

Overflow: a weight ``w = e^(logp - old)`` may be ``inf`` in fp32 (``old = logp - 100``) where the float64
reference still has a finite ``e^100``. Every product with a weight is taken as ``_times(a, w)``: a factor
``a == 0`` (a clipped token's ``dl/dw``, a zero advantage, a zero KL term) gives exactly 0, never
``0 * inf = NaN``; a clipped or ``delta``-capped response therefore has finite loss and gradients.

The level and loss-type codes are the positions of the names in ``config.IMPORTANCE_SAMPLING_LEVELS`` and
``config.LOSS_TYPES``; the kernels compare them with the named constants below. The per-token steps of the
sequence kernel are ``@triton.jit`` helpers (inlined by the compiler: the same code as one function).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from gspo_kernels.backends.triton.configs import SEQUENCE_BLOCK_S, SEQUENCE_BLOCK_T, SEQUENCE_NUM_WARPS
from gspo_kernels.backends.triton.launch import device_guard
from gspo_kernels.config import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, GSPOConfig
from gspo_kernels.layout import LossInputs
from gspo_kernels.objective import LossOutput

# Columns of the per-response partial sums (row i of a [S, PARTIALS_STRIDE] fp32 buffer), written by the
# sequence kernel and summed by the reduction kernel. Kernel constants: the host reads their ``.value``.
PARTIALS_STRIDE = tl.constexpr(16)
P_LOSS = tl.constexpr(0)  # the aggregated loss sum
P_TOKENS = tl.constexpr(1)  # |y_i|
P_ENTROPY = tl.constexpr(2)  # sum of masked entropy
P_KL = tl.constexpr(3)  # sum of masked KL
P_LOW = tl.constexpr(4)  # low / high / region clip counts
P_HIGH = tl.constexpr(5)
P_REGION = tl.constexpr(6)
P_W_SUM = tl.constexpr(7)  # weight sum, min, max
P_W_MIN = tl.constexpr(8)
P_W_MAX = tl.constexpr(9)
P_UNITS = tl.constexpr(10)  # the number of counted items (tokens, or responses for sequence-level metrics)

# Slots of the reduction kernel's output ``out [NUM_OUTPUTS]`` (on the host: ``out[O_LOSS.value]``).
O_LOSS = tl.constexpr(0)
O_SCALE_LOGP = tl.constexpr(1)  # dL/dlogp = coef * O_SCALE_LOGP
O_SCALE_ENTROPY = tl.constexpr(2)  # dL/dentropy = mask * O_SCALE_ENTROPY
O_LOW = tl.constexpr(3)
O_HIGH = tl.constexpr(4)
O_REGION = tl.constexpr(5)
O_W_MEAN = tl.constexpr(6)
O_W_MIN = tl.constexpr(7)
O_W_MAX = tl.constexpr(8)
O_ENTROPY = tl.constexpr(9)
O_KL = tl.constexpr(10)
NUM_OUTPUTS = 11

LEVEL_CODES = {name: code for code, name in enumerate(IMPORTANCE_SAMPLING_LEVELS)}
LOSS_TYPE_CODES = {name: code for code, name in enumerate(LOSS_TYPES)}
# The codes as kernel constants (the kernels branch on these names, never on literal numbers).
LEVEL_SEQUENCE = tl.constexpr(LEVEL_CODES["sequence"])
LEVEL_SEQUENCE_TOKEN = tl.constexpr(LEVEL_CODES["sequence_token"])
LEVEL_TOKEN = tl.constexpr(LEVEL_CODES["token"])
LOSS_GRPO = tl.constexpr(LOSS_TYPE_CODES["grpo"])
LOSS_BNPO = tl.constexpr(LOSS_TYPE_CODES["bnpo"])
LOSS_DR_GRPO = tl.constexpr(LOSS_TYPE_CODES["dr_grpo"])
LOSS_DAPO = tl.constexpr(LOSS_TYPE_CODES["dapo"])

METRIC_NAMES = (
    ("clip_ratio/low_mean", O_LOW.value),
    ("clip_ratio/high_mean", O_HIGH.value),
    ("clip_ratio/region_mean", O_REGION.value),
    ("importance_weight/mean", O_W_MEAN.value),
    ("importance_weight/min", O_W_MIN.value),
    ("importance_weight/max", O_W_MAX.value),
)


@triton.jit
def _times(a, w):
    """``a * w`` where a zero ``a`` gives exactly 0 even when ``w`` overflowed to ``inf``."""
    return tl.where(a == 0, 0.0, a * w)


@triton.jit
def _response_tokens_and_log_ratio(logp_ptr, old_ptr, mask_ptr, start, end,
                                   LEVEL: tl.constexpr, HAS_OLD: tl.constexpr, BLOCK_T: tl.constexpr):
    """Pass 1: ``(|y_i|, sum_t mask_t * (logp_t - old_t))`` of the response ``[start, end)``."""
    offs = tl.arange(0, BLOCK_T)
    tok_acc = tl.zeros([BLOCK_T], tl.float32)
    r_acc = tl.zeros([BLOCK_T], tl.float32)
    for t0 in range(start, end, BLOCK_T):
        idx = t0 + offs
        inside = idx < end
        token_mask = tl.load(mask_ptr + idx, mask=inside, other=0.0)
        tok_acc += token_mask
        if LEVEL != LEVEL_TOKEN:
            if HAS_OLD:
                lp = tl.load(logp_ptr + idx, mask=inside, other=0.0)
                old = tl.load(old_ptr + idx, mask=inside, other=0.0)
                r_acc += tl.where(token_mask > 0, lp - old, 0.0)
    return tl.sum(tok_acc, axis=0), tl.sum(r_acc, axis=0)


@triton.jit
def _token_weight(lp, old_ptr, idx, inside, on, w_seq, seq_pass, log_ratio_clamp, LEVEL: tl.constexpr,
                  HAS_OLD: tl.constexpr, HAS_CLAMP: tl.constexpr, BLOCK_T: tl.constexpr):
    """``(w, dw)``: the tile's importance weights and ``d w_t / d logp_t`` (0 at the ``"sequence"`` level,
    whose gradient flows through the mean log-ratio in pass 3)."""
    if LEVEL == LEVEL_TOKEN:
        if HAS_OLD:
            old = tl.where(on, tl.load(old_ptr + idx, mask=inside, other=0.0), 0.0)
            lr = lp - old
            if HAS_CLAMP:
                w = tl.exp(tl.minimum(lr, log_ratio_clamp))
                dw = tl.where(lr <= log_ratio_clamp, w, 0.0)
            else:
                w = tl.exp(lr)
                dw = w
        else:
            w = tl.full([BLOCK_T], 1.0, tl.float32)
            dw = w
    else:
        w = tl.full([BLOCK_T], 1.0, tl.float32) * w_seq
        if LEVEL == LEVEL_SEQUENCE_TOKEN:
            dw = w * seq_pass  # GSPO-token: the sequence value, the token's own gradient
        else:
            dw = tl.zeros([BLOCK_T], tl.float32)  # GSPO: flows through the mean (pass 3)
    return w, dw


@triton.jit
def _clipped_surrogate(w, adv, low_edge, high_edge, delta, HAS_DELTA: tl.constexpr, BLOCK_T: tl.constexpr):
    """``(l, dl/dw)`` of ``l = -min(min(w, delta) A, clamp(w, low_edge, high_edge) A)`` (PyTorch's subgradients)."""
    c2 = tl.minimum(tl.maximum(w, low_edge), high_edge)
    dc2 = ((w >= low_edge) & (w <= high_edge)).to(tl.float32)
    if HAS_DELTA:
        c1 = tl.minimum(w, delta)
        dc1 = (w <= delta).to(tl.float32)
    else:
        c1 = w
        dc1 = tl.full([BLOCK_T], 1.0, tl.float32)
    u1 = _times(adv, c1)  # c1 = w may be inf; a zero advantage contributes 0
    u2 = c2 * adv
    loss = -tl.minimum(u1, u2)
    dmin = tl.where(u1 < u2, dc1, tl.where(u1 > u2, dc2, 0.5 * (dc1 + dc2)))
    return loss, -adv * dmin


@triton.jit
def _kl_penalty(ref_ptr, idx, inside, on, lp, w, beta, BIAS_CORRECTION_KL: tl.constexpr):
    """``(kl, kl as added to the loss, d(beta kl)/dlogp not through w)`` of ``kl = e^d - d - 1``,
    ``d = ref - logp``; with the bias correction (``use_bias_correction_kl``) the added term is ``w kl``."""
    d = tl.where(on, tl.load(ref_ptr + idx, mask=inside, other=0.0), 0.0) - lp
    ed = tl.exp(d)
    kl = ed - d - 1.0
    if BIAS_CORRECTION_KL:
        return kl, _times(kl, w), _times(beta * (1.0 - ed), w)
    else:
        return kl, kl, beta * (1.0 - ed)


@triton.jit
def _accumulate_weight_metrics(low_acc, high_acc, region_acc, w_acc, w_min, w_max, on, w, adv, low_edge, high_edge):
    """The per-lane clip counts and weight statistics of the unmasked tokens ``on``, updated by one tile."""
    low = on & (w < low_edge) & (adv < 0)
    high = on & (w > high_edge) & (adv > 0)
    low_acc += low.to(tl.float32)
    high_acc += high.to(tl.float32)
    region_acc += (low | high).to(tl.float32)
    w_acc += tl.where(on, w, 0.0)
    w_min = tl.minimum(w_min, tl.where(on, w, float("inf")))
    w_max = tl.maximum(w_max, tl.where(on, w, float("-inf")))
    return low_acc, high_acc, region_acc, w_acc, w_min, w_max


@triton.jit
def _add_sequence_cross_term(coef_ptr, mask_ptr, start, end, cross, BLOCK_T: tl.constexpr):
    """Pass 3 (``"sequence"`` level): ``coef_t += cross`` on every unmasked token of the response, the
    gradient through the mean log-ratio."""
    offs = tl.arange(0, BLOCK_T)
    for t0 in range(start, end, BLOCK_T):
        idx = t0 + offs
        inside = idx < end
        token_mask = tl.load(mask_ptr + idx, mask=inside, other=0.0)
        coef = tl.load(coef_ptr + idx, mask=inside, other=0.0)
        tl.store(coef_ptr + idx, coef + tl.where(token_mask > 0, cross, 0.0), mask=inside)


@triton.jit
def _store_weight_metrics(out, low, high, region, w_sum, w_min, w_max, units):
    """The clip counts and weight statistics of one response into its partials row ``out``."""
    tl.store(out + P_LOW, low)
    tl.store(out + P_HIGH, high)
    tl.store(out + P_REGION, region)
    tl.store(out + P_W_SUM, w_sum)
    tl.store(out + P_W_MIN, w_min)
    tl.store(out + P_W_MAX, w_max)
    tl.store(out + P_UNITS, units)


# The kernel is longer than a screen (about 90 lines of body) because pass 2's loop carries ten accumulators:
# moving the loop into a helper would mean returning all ten; its per-token steps are the helpers above.
@triton.jit
def gspo_sequence_kernel(
    logp_ptr, entropy_ptr, old_ptr, ref_ptr, adv_ptr, is_ratio_ptr, mask_ptr, cu_seqlens_ptr,
    coef_ptr, partials_ptr,
    eps_low, eps_high, delta, beta, log_ratio_clamp,
    LEVEL: tl.constexpr, HAS_OLD: tl.constexpr, HAS_ENTROPY: tl.constexpr, HAS_KL: tl.constexpr,
    BIAS_CORRECTION_KL: tl.constexpr, HAS_IS_RATIO: tl.constexpr, HAS_DELTA: tl.constexpr,
    ADV_PER_TOKEN: tl.constexpr, SEQ_MEAN: tl.constexpr, BLOCK_T: tl.constexpr,
    HAS_CLAMP: tl.constexpr = False,
):
    seq = tl.program_id(0)
    start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    end = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64)
    offs = tl.arange(0, BLOCK_T)
    low_edge = 1.0 - eps_low
    high_edge = 1.0 + eps_high

    n_tok, sum_r = _response_tokens_and_log_ratio(logp_ptr, old_ptr, mask_ptr, start, end, LEVEL, HAS_OLD, BLOCK_T)
    denom = tl.maximum(n_tok, 1.0)
    mean_r = sum_r / denom
    if HAS_CLAMP:  # w = exp(min(log w, c)) (verl's guard); no gradient through a clamped weight
        seq_pass = (mean_r <= log_ratio_clamp).to(tl.float32)
        mean_r = tl.minimum(mean_r, log_ratio_clamp)
    else:
        seq_pass = 1.0
    w_seq = tl.exp(mean_r)
    if SEQ_MEAN:
        lam = 1.0 / denom
    else:
        lam = 1.0

    # Pass 2: per-token surrogate, partial sums and (local) gradient coefficients.
    loss_acc = tl.zeros([BLOCK_T], tl.float32)
    ent_acc = tl.zeros([BLOCK_T], tl.float32)
    kl_acc = tl.zeros([BLOCK_T], tl.float32)
    q_acc = tl.zeros([BLOCK_T], tl.float32)
    low_acc = tl.zeros([BLOCK_T], tl.float32)
    high_acc = tl.zeros([BLOCK_T], tl.float32)
    region_acc = tl.zeros([BLOCK_T], tl.float32)
    w_acc = tl.zeros([BLOCK_T], tl.float32)
    w_min = tl.full([BLOCK_T], float("inf"), tl.float32)
    w_max = tl.full([BLOCK_T], float("-inf"), tl.float32)
    if not ADV_PER_TOKEN:
        adv_seq = tl.load(adv_ptr + seq)
    for t0 in range(start, end, BLOCK_T):
        idx = t0 + offs
        inside = idx < end
        on = tl.load(mask_ptr + idx, mask=inside, other=0.0) > 0
        lp = tl.where(on, tl.load(logp_ptr + idx, mask=inside, other=0.0), 0.0)
        w, dw = _token_weight(lp, old_ptr, idx, inside, on, w_seq, seq_pass, log_ratio_clamp, LEVEL, HAS_OLD,
                              HAS_CLAMP, BLOCK_T)
        if ADV_PER_TOKEN:
            adv = tl.load(adv_ptr + idx, mask=inside, other=0.0)
        else:
            adv = tl.full([BLOCK_T], 1.0, tl.float32) * adv_seq
        loss, dl_dw = _clipped_surrogate(w, adv, low_edge, high_edge, delta, HAS_DELTA, BLOCK_T)
        if HAS_IS_RATIO:
            isr = tl.load(is_ratio_ptr + idx, mask=inside, other=0.0)
            loss = _times(isr, loss)  # a token dropped by is_ratio = 0 adds 0 even when its weight overflowed
            dl_dw = _times(isr, dl_dw)
        direct = tl.zeros([BLOCK_T], tl.float32)  # d l_t / d logp_t not through w
        if HAS_KL:
            kl, kl_weighted, direct = _kl_penalty(ref_ptr, idx, inside, on, lp, w, beta, BIAS_CORRECTION_KL)
            if BIAS_CORRECTION_KL:
                dl_dw += beta * kl
            kl = kl_weighted
            loss += beta * kl
            kl_acc += tl.where(on, kl, 0.0)
        loss_acc += tl.where(on, loss, 0.0)
        if HAS_ENTROPY:
            ent_acc += tl.where(on, tl.load(entropy_ptr + idx, mask=inside, other=0.0), 0.0)
        if LEVEL == LEVEL_SEQUENCE:
            q_acc += tl.where(on, dl_dw, 0.0)
            coef = tl.where(on, lam * direct, 0.0)
        else:
            coef = tl.where(on, lam * (_times(dl_dw, dw) + direct), 0.0)
        tl.store(coef_ptr + idx, coef, mask=inside)
        if (LEVEL != LEVEL_SEQUENCE) | ADV_PER_TOKEN:  # metrics over unmasked tokens
            low_acc, high_acc, region_acc, w_acc, w_min, w_max = _accumulate_weight_metrics(
                low_acc, high_acc, region_acc, w_acc, w_min, w_max, on, w, adv, low_edge, high_edge)

    if LEVEL == LEVEL_SEQUENCE:
        cross = _times(lam * tl.sum(q_acc, axis=0) * seq_pass / denom, w_seq)
        _add_sequence_cross_term(coef_ptr, mask_ptr, start, end, cross, BLOCK_T)

    out = partials_ptr + seq.to(tl.int64) * PARTIALS_STRIDE
    tl.store(out + P_LOSS, lam * tl.sum(loss_acc, axis=0))
    tl.store(out + P_TOKENS, n_tok)
    tl.store(out + P_ENTROPY, tl.sum(ent_acc, axis=0))
    tl.store(out + P_KL, tl.sum(kl_acc, axis=0))
    if (LEVEL != LEVEL_SEQUENCE) | ADV_PER_TOKEN:
        _store_weight_metrics(out, tl.sum(low_acc, axis=0), tl.sum(high_acc, axis=0), tl.sum(region_acc, axis=0),
                              tl.sum(w_acc, axis=0), tl.min(w_min, axis=0), tl.max(w_max, axis=0), n_tok)
    else:  # GSPO with one advantage per response: metrics over responses with at least one token
        counted = n_tok > 0
        low = counted & (w_seq < low_edge) & (adv_seq < 0)
        high = counted & (w_seq > high_edge) & (adv_seq > 0)
        _store_weight_metrics(out, low.to(tl.float32), high.to(tl.float32), (low | high).to(tl.float32),
                              tl.where(counted, w_seq, 0.0), tl.where(counted, w_seq, float("inf")),
                              tl.where(counted, w_seq, float("-inf")), counted.to(tl.float32))


@triton.jit
def gspo_reduce_kernel(
    partials_ptr, num_items_ptr, out_ptr, num_seqs, grpo_denominator, dr_grpo_denominator, entropy_coef,
    LOSS_TYPE: tl.constexpr, HAS_NUM_ITEMS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    offs = tl.arange(0, BLOCK_S)
    loss = tl.zeros([BLOCK_S], tl.float32)
    tokens = tl.zeros([BLOCK_S], tl.float32)
    ent = tl.zeros([BLOCK_S], tl.float32)
    kl = tl.zeros([BLOCK_S], tl.float32)
    low = tl.zeros([BLOCK_S], tl.float32)
    high = tl.zeros([BLOCK_S], tl.float32)
    region = tl.zeros([BLOCK_S], tl.float32)
    w_sum = tl.zeros([BLOCK_S], tl.float32)
    w_min = tl.full([BLOCK_S], float("inf"), tl.float32)
    w_max = tl.full([BLOCK_S], float("-inf"), tl.float32)
    units = tl.zeros([BLOCK_S], tl.float32)
    for s0 in range(0, num_seqs, BLOCK_S):
        rows = s0 + offs
        inside = rows < num_seqs
        p = partials_ptr + rows.to(tl.int64) * PARTIALS_STRIDE
        loss += tl.load(p + P_LOSS, mask=inside, other=0.0)
        tokens += tl.load(p + P_TOKENS, mask=inside, other=0.0)
        ent += tl.load(p + P_ENTROPY, mask=inside, other=0.0)
        kl += tl.load(p + P_KL, mask=inside, other=0.0)
        low += tl.load(p + P_LOW, mask=inside, other=0.0)
        high += tl.load(p + P_HIGH, mask=inside, other=0.0)
        region += tl.load(p + P_REGION, mask=inside, other=0.0)
        w_sum += tl.load(p + P_W_SUM, mask=inside, other=0.0)
        w_min = tl.minimum(w_min, tl.load(p + P_W_MIN, mask=inside, other=float("inf")))
        w_max = tl.maximum(w_max, tl.load(p + P_W_MAX, mask=inside, other=float("-inf")))
        units += tl.load(p + P_UNITS, mask=inside, other=0.0)
    token_mean = tl.maximum(tl.sum(tokens, axis=0), 1.0)
    n_units = tl.sum(units, axis=0)
    unit_mean = tl.maximum(n_units, 1.0)
    if LOSS_TYPE == LOSS_GRPO:  # grpo: mean over responses of the per-response token means
        denominator = grpo_denominator
    elif LOSS_TYPE == LOSS_BNPO:  # bnpo: token mean
        denominator = token_mean
    elif LOSS_TYPE == LOSS_DR_GRPO:  # dr_grpo: S * max_completion_length
        denominator = dr_grpo_denominator
    else:  # dapo: the caller's global token count, else this batch's
        if HAS_NUM_ITEMS:  # validated finite and > 0, used as given (docs/policies.md)
            denominator = tl.load(num_items_ptr).to(tl.float32)
        else:
            denominator = token_mean
    entropy_mean = tl.sum(ent, axis=0) / token_mean
    tl.store(out_ptr + O_LOSS, tl.sum(loss, axis=0) / denominator - entropy_coef * entropy_mean)
    tl.store(out_ptr + O_SCALE_LOGP, 1.0 / denominator)
    tl.store(out_ptr + O_SCALE_ENTROPY, -entropy_coef / token_mean)
    tl.store(out_ptr + O_LOW, tl.sum(low, axis=0) / unit_mean)
    tl.store(out_ptr + O_HIGH, tl.sum(high, axis=0) / unit_mean)
    tl.store(out_ptr + O_REGION, tl.sum(region, axis=0) / unit_mean)
    tl.store(out_ptr + O_W_MEAN, tl.sum(w_sum, axis=0) / unit_mean)
    some = n_units > 0
    tl.store(out_ptr + O_W_MIN, tl.where(some, tl.min(w_min, axis=0), 0.0))
    tl.store(out_ptr + O_W_MAX, tl.where(some, tl.max(w_max, axis=0), 0.0))
    tl.store(out_ptr + O_ENTROPY, entropy_mean)
    tl.store(out_ptr + O_KL, tl.sum(kl, axis=0) / token_mean)


def _f32(x: Optional[Tensor]) -> Optional[Tensor]:
    if x is None:
        return None
    return x.detach().reshape(-1).to(torch.float32).contiguous()


def sequence_stage(
    logp: Tensor, entropy: Optional[Tensor], inputs: LossInputs, config: GSPOConfig
) -> Tuple[Tensor, Tensor]:
    """Launch both kernels.

    Args:
        logp, entropy: ``[N]`` (converted to contiguous fp32); ``entropy`` None when it is not needed.
        inputs: the validated per-token inputs (mask, ``cu_seqlens``, advantages ``[S]`` or ``[N]``, optional
            old / reference log-probs, ``is_ratio``, ``num_items_in_batch``).
        config: the loss options (``beta > 0`` needs ``inputs.ref_logprobs``).

    Returns:
        ``coef [N]`` fp32, ``dL/dlogp_t = coef_t * out[O_SCALE_LOGP]``, and ``out [NUM_OUTPUTS]`` fp32
        (loss, gradient scales and metrics at the ``O_*`` slots).
    """
    batch = inputs.batch
    device = logp.device
    n_tokens = logp.numel()
    num_seqs = batch.cu_seqlens.numel() - 1
    has_kl = config.beta > 0
    if has_kl and inputs.ref_logprobs is None:
        raise ValueError("ref_logprobs is required when beta > 0")
    coef = torch.empty(n_tokens, device=device, dtype=torch.float32)
    partials = torch.empty((max(num_seqs, 1), PARTIALS_STRIDE.value), device=device, dtype=torch.float32)
    out = torch.empty(NUM_OUTPUTS, device=device, dtype=torch.float32)
    logp32 = _f32(logp)
    entropy32 = _f32(entropy)
    old32, ref32, ratio32 = _f32(inputs.old_logprobs), _f32(inputs.ref_logprobs), _f32(inputs.is_ratio)
    adv32 = _f32(inputs.advantages)
    mask32 = _f32(batch.mask)
    cu = batch.cu_seqlens.contiguous()
    with device_guard(logp):
        if num_seqs > 0:
            gspo_sequence_kernel[(num_seqs,)](
                logp32,
                entropy32 if entropy32 is not None else logp32,
                old32 if old32 is not None else logp32,
                ref32 if ref32 is not None else logp32,
                adv32,
                ratio32 if ratio32 is not None else logp32,
                mask32,
                cu,
                coef,
                partials,
                float(config.epsilon_low),
                float(config.epsilon_high),
                float(config.delta) if config.delta is not None else 0.0,
                float(config.beta),
                float(config.log_ratio_clamp) if config.log_ratio_clamp is not None else 0.0,
                LEVEL=LEVEL_CODES[config.importance_sampling_level],
                HAS_OLD=old32 is not None,
                HAS_ENTROPY=entropy32 is not None,
                HAS_KL=has_kl,
                BIAS_CORRECTION_KL=bool(config.use_bias_correction_kl),
                HAS_IS_RATIO=ratio32 is not None,
                HAS_DELTA=config.delta is not None,
                ADV_PER_TOKEN=bool(inputs.advantages_per_token),
                SEQ_MEAN=config.loss_type == "grpo",
                BLOCK_T=SEQUENCE_BLOCK_T,
                HAS_CLAMP=config.log_ratio_clamp is not None,
                num_warps=SEQUENCE_NUM_WARPS,
            )
        grpo_denominator = float(max(num_seqs, 1))
        dr_grpo_denominator = grpo_denominator * float(config.max_completion_length or 1)
        items = inputs.num_items_in_batch
        items = None if items is None else items.detach().reshape(1).to(device=device, dtype=torch.float32)
        gspo_reduce_kernel[(1,)](
            partials,
            items if items is not None else out,
            out,
            num_seqs,
            grpo_denominator,
            dr_grpo_denominator,
            float(config.entropy_coef),
            LOSS_TYPE=LOSS_TYPE_CODES[config.loss_type],
            HAS_NUM_ITEMS=items is not None,
            BLOCK_S=SEQUENCE_BLOCK_S,
            num_warps=SEQUENCE_NUM_WARPS,
        )
    return coef, out


class TritonSequenceObjective(torch.autograd.Function):
    """``(logp [N], entropy [N] | None) -> (loss 0-dim, out [NUM_OUTPUTS])``; ``out`` holds the metrics."""

    @staticmethod
    def forward(ctx, logp, entropy, inputs: LossInputs, config: GSPOConfig):
        batch = inputs.batch
        coef, out = sequence_stage(logp.detach(), None if entropy is None else entropy.detach(), inputs, config)
        ctx.save_for_backward(coef, out, batch.mask)
        ctx.logp_dtype = logp.dtype
        ctx.entropy_dtype = None if entropy is None else entropy.dtype
        ctx.entropy_coef = config.entropy_coef
        ctx.mark_non_differentiable(out)
        ctx.set_materialize_grads(False)
        return out[O_LOSS.value].clone(), out

    @staticmethod
    def backward(ctx, grad_loss, _grad_out):
        coef, out, mask = ctx.saved_tensors
        if grad_loss is None:
            return None, None, None, None
        grad_loss = grad_loss.to(torch.float32)
        grad_logp = None
        grad_entropy = None
        if ctx.needs_input_grad[0]:
            grad_logp = (coef * (grad_loss * out[O_SCALE_LOGP.value])).to(ctx.logp_dtype)
        if ctx.needs_input_grad[1] and ctx.entropy_coef != 0:
            grad_entropy = (mask * (grad_loss * out[O_SCALE_ENTROPY.value])).to(ctx.entropy_dtype)
        return grad_logp, grad_entropy, None, None


def fused_objective(logp: Tensor, entropy: Optional[Tensor], inputs: LossInputs, config: GSPOConfig) -> LossOutput:
    """The backend's ``objective``: :func:`gspo_kernels.objective.gspo_objective` computed by the fused kernels.

    ``logp``, ``entropy``: ``[N]`` (fp32). ``entropy`` may be None only when ``config.entropy_coef == 0``
    (the ``entropy`` metric is then omitted). Metrics are detached 0-dim fp32 tensors.
    """
    if entropy is None and config.entropy_coef != 0:
        raise ValueError("entropy is required when config.entropy_coef != 0")
    loss, out = TritonSequenceObjective.apply(logp, entropy, inputs, config)
    metrics = {name: out[index] for name, index in METRIC_NAMES}
    if entropy is not None:
        metrics["entropy"] = out[O_ENTROPY.value]
    if config.beta > 0:
        metrics["kl"] = out[O_KL.value]
    return LossOutput(loss.to(logp.dtype), metrics)
