"""Every launch configuration of ``backend="triton"``: tile sizes, warps, stages, the tables they come from
and the functions that pick one, plus ``H100_CONFIGS``, what ``gspo-kernels h100-report`` compiles.

The kernel modules (``logits.py``, ``linear.py``, ``linear_invariant.py``, ``linear_loss.py``, ``sequence_kernels.py``)
import their launch parameters from here; this module imports no kernel module. ``H100_CONFIGS`` therefore names
each kernel by ``"module.function"`` (``h100_report.resolve_kernel`` looks it up), and its signatures are derived
from the kernels' argument names: only what a name cannot say (non-fp32 pointers, fp32 scalars, 16-divisible
sizes) is written here.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import triton

from gspo_kernels import objectives
from gspo_kernels.backends.contract import DEFAULT_MEMORY_BUDGET
from gspo_kernels.backends.triton.launch import ELEMENT_SIZES, interpreter_active
from gspo_kernels.config import AGGREGATIONS, IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, ROLLOUT_CORRECTIONS, GSPOConfig
from gspo_kernels.precision import compute_dtype

# The option codes the sequence kernels branch on (``sequence.py`` makes its kernel constants from these, the
# launcher passes them, ``H100_CONFIGS`` below compiles with them): one table, plain Python, no kernel import.
LEVEL_CODES = {name: code for code, name in enumerate(IMPORTANCE_SAMPLING_LEVELS)}
LOSS_TYPE_CODES = {name: code for code, name in enumerate(LOSS_TYPES)}
AGGREGATION_CODES = {name: code for code, name in enumerate(AGGREGATIONS)}  # LOSS_TYPE_CODES, then seq_sum
ROLLOUT_CODES = {None: 0, **{name: code + 1 for code, name in enumerate(ROLLOUT_CORRECTIONS)}}  # 0: metrics only

# The vendor-GEMM hidden-state path (linear.py): rows per chunk of the fp32 logits buffer.
GEMM_MIN_CHUNK_ROWS = 16  # never fewer rows per GEMM than this, whatever the budget (tiny GEMMs waste the GPU)
GEMM_ROW_MULTIPLE = 16  # chunk sizes in multiples of this (tensor-core friendly M)


def gemm_chunk_rows(n_rows: int, V: int, operand: torch.dtype, memory_budget: Optional[int], *, need_dz: bool) -> int:
    """Rows per chunk of the vendor-GEMM path: the most rows whose buffers fit ``memory_budget`` bytes
    (None: ``DEFAULT_MEMORY_BUDGET``): per row, ``V`` logits in the compute dtype (fp32, fp64 for fp64) and,
    with ``need_dz``, ``V`` gradient elements in the operand dtype (none extra when it is the compute dtype)."""
    budget = DEFAULT_MEMORY_BUDGET if memory_budget is None else int(memory_budget)
    acc = compute_dtype(operand).itemsize
    op = operand.itemsize
    per_row = V * (acc + (op if need_dz and op != acc else 0))
    rows = max(GEMM_MIN_CHUNK_ROWS, budget // max(per_row, 1))
    rows = max(GEMM_MIN_CHUNK_ROWS, rows // GEMM_ROW_MULTIPLE * GEMM_ROW_MULTIPLE)
    return int(min(rows, max(n_rows, 1)))


# The one-pass loss (linear_loss.py, ``fused_linear_loss``) without a memory_budget: the fp32 logits of
# ``ONE_PASS_LOGITS_ROWS`` rows at a time, and a store of ``ONE_PASS_STORE_ROWS`` rows of ``dZ`` (operand dtype)
# that the ``dH`` / ``dW`` GEMMs read at once. Each ``dW`` GEMM reads and writes the fp32 ``[V, H]`` accumulator
# once: ``8 V H`` bytes against the ``6 K V H`` FLOPs of ``K`` rows' three GEMMs, so the accumulator's share of the
# step is about ``4 F / (3 K B)`` (``F / B`` ~ 240 FLOP/byte on an H100, ~165 on an H200, whatever V and H): ~8% at
# K = 4096, ~31% at the 1024 rows a 1 GiB budget held at V = 151936 (measured on an H200: the dW GEMMs took
# 36 ms in 16 accumulations, 28.5 ms in 4).
ONE_PASS_LOGITS_ROWS = 1024
ONE_PASS_STORE_ROWS = 4096
# The two-pass backward (``linear_logprobs`` + autograd: the TRL drop-in's head, old / reference passes) holds
# half of that: it runs inside a model's backward, beside the model's own gradients and activations (measured
# on an H200 with the one-pass sizes: the drop-in's step at 1.42x stock TRL's peak memory for the same time).
TWO_PASS_LOGITS_ROWS = 512
TWO_PASS_STORE_ROWS = 2048
# The one-pass loss's backward scales the gradients it formed in the forward by the loss's incoming gradient, in
# place (linear_loss.scale_gradient_kernel): BLOCK elements per step (16 per thread at 8 warps: four 128-bit fp32
# loads, two bf16), a grid of a few programs per SM striding over the blocks (one launch, whatever the size; when
# the incoming gradient is 1 each program reads one scalar and stops).
SCALE_BLOCK = 4096
SCALE_NUM_WARPS = 8
SCALE_PROGRAMS_PER_SM = 4
# The two-pass backward over slices of the vocabulary (linear.py, ``_vocab_sliced_backward``), taken when the rows
# are few against the vocabulary (``V >= VOCAB_SLICE_ROW_RATIO * N``: an RL micro-batch of 8 x 1024 tokens against
# 151936 columns). Its loops run the other way round from the row chunks': per slice of ``S`` columns, the lm_head's
# slice (cast to the operand dtype there, so no whole-head copy is kept from the forward), its logits for ``R``
# rows (all of them when the buffers allow), ``dZ``, ``dW[slice]`` written once, and ``dH`` accumulated in fp32.
# The accumulator read and written per pass is then ``dH`` (``4 N H`` bytes, once per slice) instead of ``dW``
# (``4 V H``, once per store of ``K`` rows). Against the ``6 N H V`` FLOPs of the three GEMMs that traffic is
# ``8 N H V / S`` bytes (``8 V H N / K`` for the row chunks): a share of about ``4 F / (3 S B)`` of the GEMM time
# (``F / B`` ~ 165-240 FLOP/byte on an H200 / H100) whatever N is: ~5-8% at S = 4096-5376 (the row chunks' 2048-row
# store: ~11-16%). The ratio 4 bounds the extra memory: the fp32 ``dH`` and the masked hidden rows add ``6 N H``
# bytes, at most 1.5 V H (three quarters of a bf16 head copy, which is no longer kept).
VOCAB_SLICE_ROW_RATIO = 4
VOCAB_SLICE_BUDGET = 256 << 20  # bytes of its fp32 logits + operand-dtype dZ buffers without a memory_budget
VOCAB_SLICE_MULTIPLE = 128  # columns per slice in multiples of this (16-byte aligned rows, whole GEMM tiles)
VOCAB_SLICE_MIN_COLUMNS = 2048  # narrower slices re-read dH too often: fewer rows per pass instead
VOCAB_SLICE_MAX_COLUMNS = 8192  # wider slices gain little (~4% of the GEMM time at most) for more buffer bytes


def vocab_sliced(n_rows: int, V: int) -> bool:
    """Whether the two-pass backward runs over slices of the vocabulary (``V >= VOCAB_SLICE_ROW_RATIO * N``)."""
    return V >= VOCAB_SLICE_ROW_RATIO * max(int(n_rows), 1)


def vocab_slice_sizes(n_rows: int, V: int, operand: torch.dtype, memory_budget: Optional[int]) -> "tuple[int, int]":
    """``(R, S)``: rows per pass and columns per slice of the vocabulary-sliced backward. Its buffers (``R S`` fp32
    logits, and ``R S`` operand-dtype ``dZ`` for half operands) hold at most ``memory_budget`` bytes (None:
    ``VOCAB_SLICE_BUDGET``): ``S`` = the budget over every row's bytes, within ``[VOCAB_SLICE_MIN_COLUMNS,
    VOCAB_SLICE_MAX_COLUMNS]`` (a multiple of ``VOCAB_SLICE_MULTIPLE``), then ``R`` = as many rows as fit beside it
    (a multiple of ``GEMM_ROW_MULTIPLE``, at least ``GEMM_MIN_CHUNK_ROWS``: the only case in which the bytes may
    pass a tiny budget). Never more than ``n_rows`` rows or ``V`` columns (at least 1)."""
    acc = compute_dtype(operand).itemsize
    op = operand.itemsize
    per = acc + (op if op != acc else 0)  # bytes per (row, column) of the buffers
    budget = VOCAB_SLICE_BUDGET if memory_budget is None else int(memory_budget)
    n, v = max(int(n_rows), 1), max(int(V), 1)
    s = budget // (n * per) // VOCAB_SLICE_MULTIPLE * VOCAB_SLICE_MULTIPLE
    s = min(max(s, VOCAB_SLICE_MIN_COLUMNS), VOCAB_SLICE_MAX_COLUMNS, v)
    r = budget // (s * per) // GEMM_ROW_MULTIPLE * GEMM_ROW_MULTIPLE
    return min(max(r, GEMM_MIN_CHUNK_ROWS), n), s


# The most rows the one-pass logits buffer grows to so that the longest response is one chunk (one pass over the
# lm_head for it; a longer response is computed in parts and its logits recomputed in the backward).
ONE_PASS_MAX_LOGITS_ROWS = 16384


def one_pass_chunk_rows(n_rows: int, V: int, operand: torch.dtype, memory_budget: Optional[int],
                        free_bytes: Optional[int] = None, *, two_pass: bool = False,
                        longest: Optional[int] = None) -> "tuple[int, int]":
    """``(C, K)``: rows of the fp32 logits buffer and rows of the ``dZ`` store of the one-pass loss.

    Half-precision operands split their bytes as the default sizes do, ``K = r C`` (``r`` = store rows / logits
    rows: 4), so that a byte buys store rows (each store of ``K`` rows is one pass of the ``dW`` GEMM over the fp32
    accumulator) rather than logits rows (a GEMM of ``C`` rows already runs at the cuBLAS rate from a few hundred
    rows); fp32 / fp64 operands write ``dZ`` over the logits, ``K = C``. The bytes of both buffers,
    ``C V acc + K V op`` (``acc``: the compute dtype's size, ``op``: the operand's), are:

    * ``memory_budget`` given: at most the budget, its exact meaning (``C`` the most rows that fit, a multiple of
      ``GEMM_ROW_MULTIPLE``, at least ``GEMM_MIN_CHUNK_ROWS``);
    * None: ``C = ONE_PASS_LOGITS_ROWS`` and ``K = ONE_PASS_STORE_ROWS`` (``TWO_PASS_*`` with ``two_pass``, the
      two-pass backward's), scaled down together when their bytes would pass
      ``max(DEFAULT_MEMORY_BUDGET, free_bytes / 4)`` (``free_bytes``: the device's free memory, None: not known).

    ``longest``: the longest response's token count (the one-pass loss: a response longer than ``C`` goes through
    the GEMMs twice, its logits recomputed). When it is more than ``C`` (and at most ``ONE_PASS_MAX_LOGITS_ROWS``),
    ``C`` grows to hold it whenever the same bytes allow (``K >= C`` rows of store beside it: the store gives up
    rows first, down to ``C``); otherwise the sizes stay. Neither is ever more than ``n_rows`` rows (at least 1).
    """
    acc = compute_dtype(operand).itemsize
    op = operand.itemsize
    separate = op != acc
    logits_rows, store_rows = ((TWO_PASS_LOGITS_ROWS, TWO_PASS_STORE_ROWS) if two_pass
                               else (ONE_PASS_LOGITS_ROWS, ONE_PASS_STORE_ROWS))
    ratio = store_rows // logits_rows if separate else 1
    per_c = V * (acc + ratio * op if separate else acc)  # bytes of one logits row and its r store rows
    if memory_budget is not None:
        c = int(memory_budget) // max(per_c, 1)
    else:
        cap = DEFAULT_MEMORY_BUDGET if free_bytes is None else max(DEFAULT_MEMORY_BUDGET, int(free_bytes) // 4)
        c = min(logits_rows if separate else store_rows, cap // max(per_c, 1))
    c = max(GEMM_MIN_CHUNK_ROWS, c // GEMM_ROW_MULTIPLE * GEMM_ROW_MULTIPLE)
    k = ratio * c
    if longest is not None and not two_pass and c < longest <= ONE_PASS_MAX_LOGITS_ROWS:
        limit = int(memory_budget) if memory_budget is not None else cap
        whole = -(-int(longest) // GEMM_ROW_MULTIPLE) * GEMM_ROW_MULTIPLE
        if separate:
            fits = (limit - whole * V * acc) // max(V * op, 1) // GEMM_ROW_MULTIPLE * GEMM_ROW_MULTIPLE
            if fits >= whole:
                c, k = whole, min(max(k, whole), fits)
        elif whole * V * acc <= limit:
            c = k = whole
    n = max(int(n_rows), 1)
    return min(c, n), min(k, n)


# ---------------------------------------------------------------------------------------------------------
# Logits path (logits.py): one program per row, the row streamed in BLOCK_V tiles.
LOGITS_MAX_BLOCK_V = 4096
# One tile is at most 8 KiB of logits (4096 bf16/fp16, 2048 fp32, 1024 fp64 values): with the prefetched next
# tile in registers, fp32 rows at 4096 would take 98 registers per thread (2 blocks of 8 warps per SM instead
# of 3); at 2048 they stay near the bf16 kernel's count.
LOGITS_MAX_TILE_BYTES = 8192
LOGITS_NUM_WARPS = 8
LOGITS_NUM_STAGES = 3


def logits_block_v(vocab_size: int, element_size: int = 2) -> int:
    """Tile width over the vocabulary: the whole row up to ``LOGITS_MAX_TILE_BYTES`` of ``element_size``-byte
    logits (a power of two, at most ``LOGITS_MAX_BLOCK_V``)."""
    widest = min(LOGITS_MAX_BLOCK_V, LOGITS_MAX_TILE_BYTES // max(int(element_size), 1))
    return min(widest, triton.next_power_of_2(max(int(vocab_size), 1)))


def logits_edge_v(block_v: int, vec: int) -> int:
    """Tile width of the forward's masked edge (the columns before the aligned body and after it): a quarter of
    ``block_v`` (its scattered loads then hold no more registers than the body), all of it when the row has no
    aligned body (``vec == 1``: a vocabulary stride other than 1)."""
    return block_v if vec == 1 else max(1, block_v // 4)


# ---------------------------------------------------------------------------------------------------------
# Hidden-state path, batch-invariant kernels (linear_invariant.py). CUDA, half-precision operands: tuned against the static sm_90a report
# (0 spills, HGMMA in the SASS). fp32 operands: exact products (``input_precision="ieee"``, no tensor cores).
# SPLIT_COLS: columns per vocabulary split, a constant so that a row's bits do not depend on the batch.
CUDA_FWD_CONFIG: Dict[str, int] = {
    "BLOCK_N": 128, "BLOCK_V": 128, "BLOCK_H": 64, "GROUP_N": 8, "SPLIT_COLS": 4096, "num_warps": 8, "num_stages": 3,
}
CUDA_FWD_CONFIG_FP32: Dict[str, int] = {
    "BLOCK_N": 64, "BLOCK_V": 64, "BLOCK_H": 32, "GROUP_N": 8, "SPLIT_COLS": 4096, "num_warps": 4, "num_stages": 2,
}
INTERPRETER_FWD_CONFIG: Dict[str, int] = {
    "BLOCK_N": 16, "BLOCK_V": 32, "BLOCK_H": 16, "GROUP_N": 2, "SPLIT_COLS": 64, "num_warps": 4, "num_stages": 1,
}
COMBINE_BLOCK = 128
COMBINE_NUM_WARPS = 4

# Backward. Keys: dz (the logits-gradient epilogue), dh and dw (the two GEMMs).
CUDA_BWD_CONFIG: Dict[str, Dict[str, int]] = {
    "dz": {"BLOCK_N": 128, "BLOCK_V": 128, "BLOCK_H": 64, "GROUP": 8, "num_warps": 8, "num_stages": 3},
    "dh": {"BLOCK_N": 128, "BLOCK_H": 128, "BLOCK_V": 64, "GROUP": 8, "num_warps": 8, "num_stages": 4},
    "dw": {"BLOCK_V": 128, "BLOCK_H": 128, "BLOCK_K": 64, "GROUP": 8, "num_warps": 8, "num_stages": 4},
}
CUDA_BWD_CONFIG_FP32: Dict[str, Dict[str, int]] = {
    "dz": {"BLOCK_N": 64, "BLOCK_V": 64, "BLOCK_H": 32, "GROUP": 8, "num_warps": 4, "num_stages": 2},
    # dh: one stage. With two, triton 3.6 (torch 2.11's CUDA wheels) spills 8 bytes to the stack at 128 registers
    # (triton 3.9: 124, no spill); with one, 96 / 107 registers and no spill on both, the same main-loop SASS
    # (1208 instructions per 1024 FMAs per thread). The fp32 product is FMA-bound: load pipelining buys little.
    "dh": {"BLOCK_N": 64, "BLOCK_H": 64, "BLOCK_V": 32, "GROUP": 8, "num_warps": 4, "num_stages": 1},
    "dw": {"BLOCK_V": 64, "BLOCK_H": 64, "BLOCK_K": 32, "GROUP": 8, "num_warps": 4, "num_stages": 2},
}
INTERPRETER_BWD_CONFIG: Dict[str, Dict[str, int]] = {
    "dz": {"BLOCK_N": 16, "BLOCK_V": 32, "BLOCK_H": 16, "GROUP": 2, "num_warps": 4, "num_stages": 1},
    "dh": {"BLOCK_N": 16, "BLOCK_H": 16, "BLOCK_V": 32, "GROUP": 2, "num_warps": 4, "num_stages": 1},
    "dw": {"BLOCK_V": 32, "BLOCK_H": 16, "BLOCK_K": 16, "GROUP": 2, "num_warps": 4, "num_stages": 1},
}


def linear_fwd_config(dtype: torch.dtype, config: Optional[Dict[str, int]] = None) -> Dict[str, int]:
    """The forward's launch configuration: ``config`` if given, else the interpreter's or the CUDA one for ``dtype``."""
    if config is not None:
        return dict(config)
    if interpreter_active():
        return dict(INTERPRETER_FWD_CONFIG)
    return dict(CUDA_FWD_CONFIG_FP32 if dtype == torch.float32 else CUDA_FWD_CONFIG)


def linear_bwd_config(
    dtype: torch.dtype, config: Optional[Dict[str, Dict[str, int]]] = None
) -> Dict[str, Dict[str, int]]:
    """The backward's three launch configurations (``dz``, ``dh``, ``dw``): ``config`` if given, else the
    interpreter's or CUDA's for ``dtype``."""
    if config is not None:
        return {k: dict(v) for k, v in config.items()}
    if interpreter_active():
        base = INTERPRETER_BWD_CONFIG
    else:
        base = CUDA_BWD_CONFIG_FP32 if dtype == torch.float32 else CUDA_BWD_CONFIG
    return {k: dict(v) for k, v in base.items()}


def chunk_rows(n_rows: int, V: int, operand: torch.dtype, block_n: int, memory_budget: Optional[int]) -> int:
    """Rows per backward chunk: the most whole row tiles whose buffers fit ``memory_budget`` bytes (at least
    one tile; None: ``DEFAULT_MEMORY_BUDGET``).

    Per row: ``V`` operand-dtype elements of ``dZ`` plus ``4 V / block_n`` bytes of bias partial sums.
    """
    budget = DEFAULT_MEMORY_BUDGET if memory_budget is None else int(memory_budget)
    per_tile = block_n * V * torch.empty((), dtype=operand).element_size() + 4 * V
    tiles = max(1, budget // max(per_tile, 1))
    return int(min(tiles, triton.cdiv(max(n_rows, 1), block_n)) * block_n)


# ---------------------------------------------------------------------------------------------------------
# Sequence stage (sequence.py): one program per response, BLOCK_T tokens at a time; one reduction program.
SEQUENCE_BLOCK_T = 1024
SEQUENCE_BLOCK_S = 128  # the reduction holds a [BLOCK_S, 32] tile of partials
SEQUENCE_NUM_WARPS = 4


# ---------------------------------------------------------------------------------------------------------
# Launch configurations for the static H100 report (gspo_kernels/tools/h100_report.py documents the format;
# "kernel" is "module.function" inside this package).


def _logits_fwd_h100(dtype: str, has_active: bool, has_entropy: bool, vocab: str = "aligned",
                     softcap: bool = False) -> dict:
    """The forward kernel as the runtime specializes it for contiguous logits: ``vocab`` "aligned" (``V % 16
    == 0``: Qwen, Llama-3, Gemma-3; 16-divisible row strides and size), "unaligned" (GPT-2's ``V = 50257``, an
    uneven tensor-parallel shard: nothing but the pointers divisible by 16) or "v1" (``V = 1``, a constant)."""
    constexprs = {"stride_v": 1, "VEC": 16 // ELEMENT_SIZES[dtype], "HAS_ACTIVE": has_active,
                  "HAS_ENTROPY": has_entropy, "HAS_SOFTCAP": softcap, "FAST_MATH": True}
    size = {"aligned": 1 << 20, "unaligned": 50257, "v1": 1}[vocab]
    constexprs["BLOCK_V"] = logits_block_v(size, ELEMENT_SIZES[dtype])
    constexprs["EDGE_V"] = logits_edge_v(constexprs["BLOCK_V"], constexprs["VEC"])
    if vocab == "v1":
        constexprs["vocab_size"] = 1
    tags = [dtype, "active" if has_active else "all", "H" if has_entropy else "noH"]
    tags += [] if vocab == "aligned" else ["V=50257" if vocab == "unaligned" else "V=1"]
    tags += ["softcap"] if softcap else []
    return {
        "name": f"logprobs_fwd[{','.join(tags)}]",
        "kernel": "logits.logprobs_fwd_kernel",
        # fp64 logits are computed in fp64 (the outputs too)
        "pointers": {"logits_ptr": dtype, "labels_ptr": "i64", "active_ptr": "i1",
                     **({name: "fp64" for name in ("logp_ptr", "entropy_ptr", "row_stats_ptr")}
                        if dtype == "fp64" else {})},
        "floats": ["inv_temperature", "softcap"],
        "constexprs": constexprs,
        # What the runtime sees for a fresh allocation: 16-divisible pointers; with V % 16 == 0 also the row
        # strides and the size. The aligned body gives 128-bit loads in both cases.
        "aligned_ints": ["stride_b", "stride_t", "vocab_size"] if vocab == "aligned" else ["stride_b"],
        "vector_loads": vocab != "v1",
        # the main loop (the aligned body) handles BLOCK_V elements per iteration over the block's threads
        "loop_elements": constexprs["BLOCK_V"] if vocab != "v1" else None,
        "num_warps": LOGITS_NUM_WARPS,
        "num_stages": LOGITS_NUM_STAGES,
    }


def _logits_bwd_h100(dtype: str, has_grad_entropy: bool, vocab: str = "aligned", softcap: bool = False) -> dict:
    """The backward kernel for contiguous logits and gradient (``vocab`` as in :func:`_logits_fwd_h100`)."""
    size = {"aligned": 1 << 20, "unaligned": 50257, "v1": 1}[vocab]
    constexprs = {"stride_v": 1, "dstride_v": 1, "BLOCK_V": logits_block_v(size, ELEMENT_SIZES[dtype]),
                  "VEC": 16 // ELEMENT_SIZES[dtype], "DST_ALIGNED": True, "HAS_ACTIVE": True, "HAS_GRAD_LOGP": True,
                  "HAS_GRAD_ENTROPY": has_grad_entropy, "HAS_GRAD_SCALE": True,  # gspo_loss's variant
                  "HAS_SOFTCAP": softcap, "FAST_MATH": True}
    if vocab == "v1":
        constexprs["vocab_size"] = 1
    tags = [dtype, "dlogp+dH" if has_grad_entropy else "dlogp"]
    tags += [] if vocab == "aligned" else ["V=50257" if vocab == "unaligned" else "V=1"]
    tags += ["softcap"] if softcap else []
    aligned = ["stride_b", "stride_t", "dstride_b", "dstride_t", "vocab_size"] if vocab == "aligned" else [
        "stride_b", "dstride_b"]
    return {
        "name": f"logprobs_bwd[{','.join(tags)}]",
        "kernel": "logits.logprobs_bwd_kernel",
        "pointers": {"logits_ptr": dtype, "dlogits_ptr": dtype, "labels_ptr": "i64", "active_ptr": "i1",
                     **({name: "fp64" for name in ("grad_logp_ptr", "grad_entropy_ptr", "entropy_ptr", "row_stats_ptr")}
                        if dtype == "fp64" else {})},
        "floats": ["inv_temperature", "softcap"],
        "constexprs": constexprs,
        "aligned_ints": [name for name in aligned if name not in constexprs],
        "vector_loads": vocab != "v1",
        "loop_elements": constexprs["BLOCK_V"] if vocab != "v1" else None,
        "num_warps": LOGITS_NUM_WARPS,
        "num_stages": LOGITS_NUM_STAGES,
    }


def _linear_h100() -> List[dict]:
    """bf16 operands (the production case) must use HGMMA. fp32 operands are multiplied exactly
    (``input_precision="ieee"``: FMA, no tensor cores, by design), so their rows only check spills."""
    out = []
    index = {"order_ptr": "i64", "count_ptr": "i64", "labels_ptr": "i64"}
    for dtype, cfg, variants in (("bf16", CUDA_FWD_CONFIG, (False, True)), ("fp32", CUDA_FWD_CONFIG_FP32, (True,))):
        for has_bias, softcap in [(b, False) for b in variants] + ([(True, True)] if dtype == "bf16" else []):
            out.append({
                "name": f"linear_logprobs_fwd{'_bias' if has_bias else ''}[{dtype}{',softcap' if softcap else ''}]",
                "kernel": "linear_invariant_kernels.linear_logprobs_fwd_kernel",
                "pointers": {"hidden_ptr": dtype, "weight_ptr": dtype, **index},
                "floats": ["inv_temperature", "softcap"],
                "constexprs": {
                    "stride_hh": 1, "stride_wh": 1, "HAS_BIAS": has_bias, "HAS_ORDER": True, "EVEN_H": True,
                    "UPCAST": False, "BLOCK_N": cfg["BLOCK_N"], "BLOCK_V": cfg["BLOCK_V"], "BLOCK_H": cfg["BLOCK_H"],
                    "GROUP_N": cfg["GROUP_N"], "HAS_SOFTCAP": softcap, "FAST_MATH": True,
                },
                "num_warps": cfg["num_warps"],
                "num_stages": cfg["num_stages"],
                "uses_dot": dtype != "fp32",
                # the sizes/strides that are multiples of 16 for real models (H, H * T, H)
                "aligned_ints": ["H", "stride_hb", "stride_ht", "stride_wv"],
            })
    out.append({"name": "linear_logprobs_combine", "kernel": "linear_invariant_kernels.linear_logprobs_combine_kernel",
                "pointers": index, "constexprs": {"HAS_ORDER": True, "BLOCK": COMBINE_BLOCK},
                "num_warps": COMBINE_NUM_WARPS, "num_stages": 1})
    for dtype, cfgs in (("bf16", CUDA_BWD_CONFIG), ("fp32", CUDA_BWD_CONFIG_FP32)):
        dz, dh, dw = cfgs["dz"], cfgs["dh"], cfgs["dw"]
        common = {"floats": ["inv_temperature"], "uses_dot": dtype != "fp32"}
        dz_variants = (("linear_dz_bias_entropy", True, False), ("linear_dz", False, False))
        if dtype == "bf16":
            dz_variants += (("linear_dz_bias_entropy_softcap", True, True),)
        for name, with_bias_entropy, softcap in dz_variants:
            out.append(dict(common, **{
                "name": f"{name}[{dtype}]", "kernel": "linear_invariant_kernels.linear_dz_kernel",
                "pointers": {"hidden_ptr": dtype, "weight_ptr": dtype, "dz_ptr": dtype, **index},
                "floats": ["inv_temperature", "softcap"],
                "constexprs": {
                    "stride_hh": 1, "stride_wh": 1, "HAS_BIAS": with_bias_entropy, "HAS_LOGP_GRAD": True,
                    "HAS_ENTROPY_GRAD": with_bias_entropy, "COMPUTE_DB": with_bias_entropy, "EVEN_H": True,
                    "UPCAST": False, "BLOCK_N": dz["BLOCK_N"], "BLOCK_V": dz["BLOCK_V"], "BLOCK_H": dz["BLOCK_H"],
                    "GROUP": dz["GROUP"], "HAS_SOFTCAP": softcap, "FAST_MATH": True},
                "num_warps": dz["num_warps"], "num_stages": dz["num_stages"],
                "aligned_ints": ["H", "V", "stride_hb", "stride_ht", "stride_wv"],
            }))
        out.append(dict(common, **{
            "name": f"linear_dh[{dtype}]", "kernel": "linear_invariant_kernels.linear_dh_kernel",
            "pointers": {"dz_ptr": dtype, "weight_ptr": dtype, "dh_ptr": dtype, "order_ptr": "i64",
                         "count_ptr": "i64"},
            "constexprs": {"stride_wh": 1, "UPCAST": False, "BLOCK_N": dh["BLOCK_N"], "BLOCK_H": dh["BLOCK_H"],
                           "BLOCK_V": dh["BLOCK_V"], "GROUP": dh["GROUP"]},
            "num_warps": dh["num_warps"], "num_stages": dh["num_stages"],
            "aligned_ints": ["H", "V", "stride_wv"],
        }))
        out.append(dict(common, **{
            "name": f"linear_dw_db[{dtype}]", "kernel": "linear_invariant_kernels.linear_dw_kernel",
            "pointers": {"dz_ptr": dtype, "hidden_ptr": dtype, "order_ptr": "i64", "count_ptr": "i64"},
            "constexprs": {"stride_hh": 1, "COMPUTE_DW": True, "COMPUTE_DB": True, "UPCAST": False,
                           "BLOCK_V": dw["BLOCK_V"], "BLOCK_H": dw["BLOCK_H"], "BLOCK_K": dw["BLOCK_K"],
                           "GROUP": dw["GROUP"], "DZ_BLOCK_N": dz["BLOCK_N"]},
            "num_warps": dw["num_warps"], "num_stages": dw["num_stages"],
            "aligned_ints": ["H", "V", "stride_hb", "stride_ht"],
        }))
    return out


_SEQUENCE_FLAG_NAMES = {"HAS_KL": "kl", "BIAS_CORRECTION_KL": "kl_bias_corr", "HAS_IS_RATIO": "is_ratio",
                        "HAS_DELTA": "delta", "ADV_PER_TOKEN": "token_adv", "HAS_CLAMP": "clamp"}
# The flags of a row that say an input is present: without the flag, the kernel gets None for that pointer (as
# the launcher passes an input the options do not need). The old log-probs and the entropy are always present.
_SEQUENCE_INPUTS = {"HAS_KL": "ref_ptr", "HAS_IS_RATIO": "is_ratio_ptr", "HAS_ROLLOUT": "rollout_ptr"}


def _sequence_h100(level: str, objective: Optional[str] = None, **flags) -> dict:
    """A launch of the sequence kernel for ``h100-report``: the objective ``objective`` (the default config's when
    None: its Triton helpers, imported now), at ``level``, with ``flags`` (constexprs; ``HAS_*`` inputs present;
    ``ROLLOUT`` by its mode's name). ``HELPERS`` is the objective's name here (this module imports no kernel module):
    ``h100-report`` puts its Triton helpers (``backends/triton/objectives``) in its place."""
    spec = objectives.objective(objective or GSPOConfig().objective)
    if "ROLLOUT" in flags:
        flags["ROLLOUT"] = ROLLOUT_CODES[flags["ROLLOUT"]]
    constexprs = {
        "LEVEL": LEVEL_CODES[level], "BIAS_CORRECTION_KL": False, "HAS_DELTA": False, "ADV_PER_TOKEN": False,
        "SEQ_MEAN": True, "BLOCK_T": SEQUENCE_BLOCK_T, "HAS_CLAMP": False,
        "HELPERS": spec.name, "OBJ_OPTION": False, "FOLD": spec.folds_correction,
        "THROUGH_WEIGHT": spec.loss_through_weight, "HAS_DUAL": False, "ROLLOUT": ROLLOUT_CODES[None],
        "HAS_OPSM": False,
        "SEQ_UNITS": spec.one_weight_per_response or (level == "sequence" and not flags.get("ADV_PER_TOKEN", False)),
    }
    constexprs.update({k: v for k, v in flags.items() if k not in _SEQUENCE_INPUTS})
    constexprs.update({pointer: None for flag, pointer in _SEQUENCE_INPUTS.items() if not flags.get(flag)})
    on = ",".join(([f"objective={spec.name}"] if objective else [])
                  + [_SEQUENCE_FLAG_NAMES.get(k, k.lower()) + ("" if v is True else f"={v}")
                     for k, v in flags.items() if v])
    return {
        "name": f"gspo_sequence[{level}{',' + on if on else ''}]",
        "kernel": "sequence_kernels.gspo_sequence_kernel",
        # Every pointer is fp32 but cu_seqlens; the float options are fp32.
        "pointers": {"cu_seqlens_ptr": "i32"},
        "floats": ["eps_low", "eps_high", "delta", "beta", "log_ratio_clamp", "clip_ratio_c", "obj_a", "obj_b",
                   "obj_c", "obj_d", "rc_lo", "rc_hi", "opsm_threshold"],
        "constexprs": constexprs,
        "num_warps": SEQUENCE_NUM_WARPS,
        "num_stages": 3,
    }


def _h100_configs() -> List[dict]:
    """``H100_CONFIGS``, built at its first use: its sequence kernel rows hold the objectives' Triton helpers, which
    this module does not import before (importing it imports no kernel module)."""
    return [
        _logits_fwd_h100("bf16", True, True),
        _logits_fwd_h100("bf16", False, False),
        _logits_fwd_h100("fp16", True, True),
        _logits_fwd_h100("fp32", True, True),
        _logits_fwd_h100("bf16", True, True, vocab="unaligned"),
        _logits_fwd_h100("fp32", True, True, vocab="unaligned"),
        _logits_fwd_h100("bf16", True, True, vocab="v1"),
        _logits_fwd_h100("bf16", True, True, softcap=True),
        _logits_fwd_h100("fp32", True, True, softcap=True),
        _logits_fwd_h100("fp64", True, True, softcap=True),  # libdevice's fp64 paths compile
        _logits_bwd_h100("bf16", False),
        _logits_bwd_h100("bf16", True),
        _logits_bwd_h100("fp16", False),
        _logits_bwd_h100("fp32", True),
        _logits_bwd_h100("bf16", True, vocab="unaligned"),
        _logits_bwd_h100("fp32", True, vocab="unaligned"),
        _logits_bwd_h100("bf16", True, vocab="v1"),
        _logits_bwd_h100("bf16", True, softcap=True),
        _logits_bwd_h100("fp64", True, softcap=True),
        *_linear_h100(),
        _sequence_h100("sequence"),
        _sequence_h100("sequence", HAS_KL=True, BIAS_CORRECTION_KL=True, HAS_IS_RATIO=True, HAS_DELTA=True),
        _sequence_h100("sequence_token", ADV_PER_TOKEN=True, HAS_IS_RATIO=True),
        _sequence_h100("token", HAS_KL=True, HAS_DELTA=True),
        _sequence_h100("sequence_token", ADV_PER_TOKEN=True, HAS_IS_RATIO=True, HAS_CLAMP=True),
        # the other objectives, the dual clip, off-policy masking and rollout correction (one launch each)
        _sequence_h100("token", HAS_DUAL=True, HAS_OPSM=True, HAS_ROLLOUT=True, ROLLOUT="token_truncate"),
        # the divergence gates (per token, and their mean per response in pass 1)
        _sequence_h100("token", ADV_PER_TOKEN=True, HAS_ROLLOUT=True, ROLLOUT="token_binary_kl_mask"),
        _sequence_h100("sequence", ADV_PER_TOKEN=True, HAS_ROLLOUT=True, ROLLOUT="sequence_tv_mask"),
        # each objective's launches (Objective.h100)
        *[_sequence_h100(objective=spec.name, **launch) for spec in objectives.objectives() for launch in spec.h100],
        *[{
            "name": f"scale_gradient[{dtype}]",
            "kernel": "linear_loss.scale_gradient_kernel",
            "pointers": {"g_ptr": dtype},
            "constexprs": {"BLOCK": SCALE_BLOCK, "FP64": dtype == "fp64"},
            "aligned_ints": ["n"],
            "vector_loads": True,
            "num_warps": SCALE_NUM_WARPS,
            "num_stages": 3,
        } for dtype in ("bf16", "fp32")],
        {
            "name": "gspo_reduce[dapo]",
            "kernel": "sequence_kernels.gspo_reduce_kernel",
            "floats": ["grpo_denominator", "dr_grpo_denominator", "entropy_coef"],
            "constexprs": {"LOSS_TYPE": AGGREGATION_CODES["dapo"], "HAS_NUM_ITEMS": True, "BLOCK_S": SEQUENCE_BLOCK_S},
            "num_warps": SEQUENCE_NUM_WARPS,
            "num_stages": 3,
        },
    ]


def __getattr__(name: str):
    if name == "H100_CONFIGS":  # every launch configuration gspo-kernels h100-report compiles
        return _h100_configs()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
