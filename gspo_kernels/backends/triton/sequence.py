"""The fused sequence stage: importance weights, clipping, IS correction, KL, aggregation, metrics, gradients.

Two launches, both deterministic (fixed reduction order, no floating-point atomics):

1. ``_gspo_sequence_kernel``, one program per response ``i`` (a 1-D grid over ``cu_seqlens``; the padded
   layout arrives as regular ``cu_seqlens``). Pass 1 sums ``mask`` and ``mask * (logp - old)`` over the
   response; pass 2 computes, per token, the weight ``w``, the clipped surrogate ``l_t`` (times
   ``is_ratio``, plus ``beta * kl_t``), the response's partial sums (loss, tokens, entropy, KL, clip
   counts, weight stats) and the gradient coefficient ``c_t = dL/dlogp_t`` up to the global divisor;
   pass 3 (``"sequence"`` level only) adds the term that flows through the response's mean log-ratio,
   ``w_i / |y_i| * sum_t' mask_t' dl_t'/dw``.
2. ``_gspo_reduce_kernel``, a single program: sums the ``[S, NUM_PARTIALS]`` partials in a fixed order
   and writes the loss, the metrics and the two global gradient scales.

The autograd Function (``autograd.py``) turns the coefficients into gradients with
``dL/dlogp = c * (grad_out * scale_logp)`` and ``dL/dH = mask * (grad_out * scale_entropy)``.

Per token (docs/math.md): ``c1 = min(w, delta)``, ``c2 = clamp(w, 1 - eps_low, 1 + eps_high)``,
``l = -min(c1 A, c2 A)``. ``dl/dw`` follows PyTorch's subgradients of the reference: the clamps pass the
gradient on their closed intervals, and a tie ``c1 A == c2 A`` splits it in halves (``torch.minimum``).

Overflow: a weight ``w = e^(logp - old)`` may be ``inf`` in fp32 (``old = logp - 100``) where the float64
reference still has a finite ``e^100``. Every product with a weight is taken as ``_times(a, w)``: a factor
``a == 0`` (a clipped token's ``dl/dw``, a zero advantage, a zero KL term) gives exactly 0, never
``0 * inf = NaN``; a clipped or ``delta``-capped response therefore has finite loss and gradients.

The level and loss-type codes are the positions of the names in ``config.IMPORTANCE_SAMPLING_LEVELS`` and
``config.LOSS_TYPES``; the kernels compare them with the named constants below.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from gspo_kernels.backends.triton import device_guard
from gspo_kernels.config import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, GSPOConfig
from gspo_kernels.layout import LossInputs

# Per-response partial sums written by the first kernel: row i of a [S, 16] fp32 buffer holds, in columns
# 0..10, the aggregated loss sum, |y_i|, sum of masked entropy, sum of masked KL, low / high / region clip
# counts, weight sum, weight min, weight max and the number of counted items.
PARTIALS_STRIDE = tl.constexpr(16)
# Outputs of the reduction kernel.
O_LOSS, O_SCALE_LOGP, O_SCALE_ENTROPY, O_LOW, O_HIGH, O_REGION, O_W_MEAN, O_W_MIN, O_W_MAX, O_ENTROPY, O_KL = range(11)
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
BLOCK_T = 1024
BLOCK_S = 1024
NUM_WARPS = 4


@triton.jit
def _times(a, w):
    """``a * w`` where a zero ``a`` gives exactly 0 even when ``w`` overflowed to ``inf``."""
    return tl.where(a == 0, 0.0, a * w)


@triton.jit
def _gspo_sequence_kernel(
    logp_ptr,
    entropy_ptr,
    old_ptr,
    ref_ptr,
    adv_ptr,
    is_ratio_ptr,
    mask_ptr,
    cu_seqlens_ptr,
    coef_ptr,
    partials_ptr,
    eps_low,
    eps_high,
    delta,
    beta,
    log_ratio_clamp,
    LEVEL: tl.constexpr,
    HAS_OLD: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    HAS_KL: tl.constexpr,
    BIAS_CORRECTION_KL: tl.constexpr,
    HAS_IS_RATIO: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    ADV_PER_TOKEN: tl.constexpr,
    SEQ_MEAN: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_CLAMP: tl.constexpr = False,
):
    seq = tl.program_id(0)
    start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    end = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64)
    offs = tl.arange(0, BLOCK_T)
    low_edge = 1.0 - eps_low
    high_edge = 1.0 + eps_high

    # Pass 1: |y_i| and the sum of masked log-ratios.
    tok_acc = tl.zeros([BLOCK_T], tl.float32)
    r_acc = tl.zeros([BLOCK_T], tl.float32)
    for t0 in range(start, end, BLOCK_T):
        idx = t0 + offs
        inside = idx < end
        m = tl.load(mask_ptr + idx, mask=inside, other=0.0)
        tok_acc += m
        if LEVEL != LEVEL_TOKEN:
            if HAS_OLD:
                lp = tl.load(logp_ptr + idx, mask=inside, other=0.0)
                old = tl.load(old_ptr + idx, mask=inside, other=0.0)
                r_acc += tl.where(m > 0, lp - old, 0.0)
    n_tok = tl.sum(tok_acc, axis=0)
    denom = tl.maximum(n_tok, 1.0)
    mean_r = tl.sum(r_acc, axis=0) / denom
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
        m = tl.load(mask_ptr + idx, mask=inside, other=0.0)
        on = m > 0
        lp = tl.where(on, tl.load(logp_ptr + idx, mask=inside, other=0.0), 0.0)
        if LEVEL == LEVEL_TOKEN:
            if HAS_OLD:
                old = tl.where(on, tl.load(old_ptr + idx, mask=inside, other=0.0), 0.0)
                lr = lp - old
                if HAS_CLAMP:
                    w = tl.exp(tl.minimum(lr, log_ratio_clamp))
                    dw = tl.where(lr <= log_ratio_clamp, w, 0.0)  # d w_t / d logp_t
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
        if ADV_PER_TOKEN:
            adv = tl.load(adv_ptr + idx, mask=inside, other=0.0)
        else:
            adv = tl.full([BLOCK_T], 1.0, tl.float32) * adv_seq

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
        dl_dw = -adv * dmin
        if HAS_IS_RATIO:
            isr = tl.load(is_ratio_ptr + idx, mask=inside, other=0.0)
            loss = loss * isr
            dl_dw = dl_dw * isr
        direct = tl.zeros([BLOCK_T], tl.float32)  # d l_t / d logp_t not through w
        if HAS_KL:
            ref = tl.where(on, tl.load(ref_ptr + idx, mask=inside, other=0.0), 0.0)
            d = ref - lp
            ed = tl.exp(d)
            kl = ed - d - 1.0
            dkl = 1.0 - ed
            if BIAS_CORRECTION_KL:
                dl_dw += beta * kl
                direct = _times(beta * dkl, w)
                kl = _times(kl, w)
            else:
                direct = beta * dkl
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
            low = on & (w < low_edge) & (adv < 0)
            high = on & (w > high_edge) & (adv > 0)
            low_acc += low.to(tl.float32)
            high_acc += high.to(tl.float32)
            region_acc += (low | high).to(tl.float32)
            w_acc += tl.where(on, w, 0.0)
            w_min = tl.minimum(w_min, tl.where(on, w, float("inf")))
            w_max = tl.maximum(w_max, tl.where(on, w, float("-inf")))

    if LEVEL == LEVEL_SEQUENCE:
        # Pass 3: the gradient through the mean log-ratio reaches every unmasked token of the response.
        cross = _times(lam * tl.sum(q_acc, axis=0) * seq_pass / denom, w_seq)
        for t0 in range(start, end, BLOCK_T):
            idx = t0 + offs
            inside = idx < end
            m = tl.load(mask_ptr + idx, mask=inside, other=0.0)
            coef = tl.load(coef_ptr + idx, mask=inside, other=0.0)
            tl.store(coef_ptr + idx, coef + tl.where(m > 0, cross, 0.0), mask=inside)

    out = partials_ptr + seq.to(tl.int64) * PARTIALS_STRIDE
    tl.store(out + 0, lam * tl.sum(loss_acc, axis=0))
    tl.store(out + 1, n_tok)
    tl.store(out + 2, tl.sum(ent_acc, axis=0))
    tl.store(out + 3, tl.sum(kl_acc, axis=0))
    if (LEVEL != LEVEL_SEQUENCE) | ADV_PER_TOKEN:
        tl.store(out + 4, tl.sum(low_acc, axis=0))
        tl.store(out + 5, tl.sum(high_acc, axis=0))
        tl.store(out + 6, tl.sum(region_acc, axis=0))
        tl.store(out + 7, tl.sum(w_acc, axis=0))
        tl.store(out + 8, tl.min(w_min, axis=0))
        tl.store(out + 9, tl.max(w_max, axis=0))
        tl.store(out + 10, n_tok)
    else:  # GSPO with one advantage per response: metrics over responses with at least one token
        counted = n_tok > 0
        low = counted & (w_seq < low_edge) & (adv_seq < 0)
        high = counted & (w_seq > high_edge) & (adv_seq > 0)
        tl.store(out + 4, low.to(tl.float32))
        tl.store(out + 5, high.to(tl.float32))
        tl.store(out + 6, (low | high).to(tl.float32))
        tl.store(out + 7, tl.where(counted, w_seq, 0.0))
        tl.store(out + 8, tl.where(counted, w_seq, float("inf")))
        tl.store(out + 9, tl.where(counted, w_seq, float("-inf")))
        tl.store(out + 10, counted.to(tl.float32))


@triton.jit
def _gspo_reduce_kernel(
    partials_ptr,
    num_items_ptr,
    out_ptr,
    num_seqs,
    grpo_denominator,
    dr_grpo_denominator,
    entropy_coef,
    LOSS_TYPE: tl.constexpr,
    HAS_NUM_ITEMS: tl.constexpr,
    BLOCK_S: tl.constexpr,
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
        loss += tl.load(p + 0, mask=inside, other=0.0)
        tokens += tl.load(p + 1, mask=inside, other=0.0)
        ent += tl.load(p + 2, mask=inside, other=0.0)
        kl += tl.load(p + 3, mask=inside, other=0.0)
        low += tl.load(p + 4, mask=inside, other=0.0)
        high += tl.load(p + 5, mask=inside, other=0.0)
        region += tl.load(p + 6, mask=inside, other=0.0)
        w_sum += tl.load(p + 7, mask=inside, other=0.0)
        w_min = tl.minimum(w_min, tl.load(p + 8, mask=inside, other=float("inf")))
        w_max = tl.maximum(w_max, tl.load(p + 9, mask=inside, other=float("-inf")))
        units += tl.load(p + 10, mask=inside, other=0.0)
    total_tokens = tl.sum(tokens, axis=0)
    token_mean = tl.maximum(total_tokens, 1.0)
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
    tl.store(out_ptr + 0, tl.sum(loss, axis=0) / denominator - entropy_coef * entropy_mean)
    tl.store(out_ptr + 1, 1.0 / denominator)
    tl.store(out_ptr + 2, -entropy_coef / token_mean)
    tl.store(out_ptr + 3, tl.sum(low, axis=0) / unit_mean)
    tl.store(out_ptr + 4, tl.sum(high, axis=0) / unit_mean)
    tl.store(out_ptr + 5, tl.sum(region, axis=0) / unit_mean)
    tl.store(out_ptr + 6, tl.sum(w_sum, axis=0) / unit_mean)
    some = n_units > 0
    tl.store(out_ptr + 7, tl.where(some, tl.min(w_min, axis=0), 0.0))
    tl.store(out_ptr + 8, tl.where(some, tl.max(w_max, axis=0), 0.0))
    tl.store(out_ptr + 9, entropy_mean)
    tl.store(out_ptr + 10, tl.sum(kl, axis=0) / token_mean)


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
        (loss, gradient scales and metrics at the ``O_*`` indices).
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
            _gspo_sequence_kernel[(num_seqs,)](
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
                BLOCK_T=BLOCK_T,
                HAS_CLAMP=config.log_ratio_clamp is not None,
                num_warps=NUM_WARPS,
            )
        grpo_denominator = float(max(num_seqs, 1))
        dr_grpo_denominator = grpo_denominator * float(config.max_completion_length or 1)
        items = inputs.num_items_in_batch
        items = None if items is None else items.detach().reshape(1).to(device=device, dtype=torch.float32)
        _gspo_reduce_kernel[(1,)](
            partials,
            items if items is not None else out,
            out,
            num_seqs,
            grpo_denominator,
            dr_grpo_denominator,
            float(config.entropy_coef),
            LOSS_TYPE=LOSS_TYPE_CODES[config.loss_type],
            HAS_NUM_ITEMS=items is not None,
            BLOCK_S=BLOCK_S,
            num_warps=NUM_WARPS,
        )
    return coef, out


def _sequence_config(level: str, **flags: bool) -> dict:
    constexprs = {
        "LEVEL": LEVEL_CODES[level],
        "HAS_OLD": True,
        "HAS_ENTROPY": True,
        "HAS_KL": False,
        "BIAS_CORRECTION_KL": False,
        "HAS_IS_RATIO": False,
        "HAS_DELTA": False,
        "ADV_PER_TOKEN": False,
        "SEQ_MEAN": True,
        "BLOCK_T": BLOCK_T,
        "HAS_CLAMP": False,
    }
    constexprs.update(flags)
    short = {"HAS_KL": "kl", "BIAS_CORRECTION_KL": "kl_bias_corr", "HAS_IS_RATIO": "is_ratio", "HAS_DELTA": "delta",
             "ADV_PER_TOKEN": "token_adv", "HAS_CLAMP": "clamp"}
    on = ",".join(short.get(k, k.lower()) for k, v in flags.items() if v)
    return {
        "name": f"gspo_sequence[{level}{',' + on if on else ''}]",
        "fn": _gspo_sequence_kernel,
        # The signature is derived from the argument names (h100_report.derive_signature): every pointer is
        # fp32 but cu_seqlens; the five scalars are fp32.
        "pointers": {"cu_seqlens_ptr": "i32"},
        "floats": ["eps_low", "eps_high", "delta", "beta", "log_ratio_clamp"],
        "constexprs": constexprs,
        "num_warps": NUM_WARPS,
        "num_stages": 3,
    }


# Launch configurations for the static H100 report (see gspo_kernels/tools/h100_report.py).
H100_CONFIGS = [
    _sequence_config("sequence"),
    _sequence_config("sequence", HAS_KL=True, BIAS_CORRECTION_KL=True, HAS_IS_RATIO=True, HAS_DELTA=True),
    _sequence_config("sequence_token", ADV_PER_TOKEN=True, HAS_IS_RATIO=True),
    _sequence_config("token", HAS_KL=True, HAS_DELTA=True),
    _sequence_config("sequence_token", ADV_PER_TOKEN=True, HAS_IS_RATIO=True, HAS_CLAMP=True),
    {
        "name": "gspo_reduce[dapo]",
        "fn": _gspo_reduce_kernel,
        "floats": ["grpo_denominator", "dr_grpo_denominator", "entropy_coef"],
        "constexprs": {"LOSS_TYPE": LOSS_TYPE_CODES["dapo"], "HAS_NUM_ITEMS": True, "BLOCK_S": BLOCK_S},
        "num_warps": NUM_WARPS,
        "num_stages": 3,
    },
]
