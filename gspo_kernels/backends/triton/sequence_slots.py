"""The sequence stage's slots and codes as kernel constants: the columns of the per-response partials row
(``P_*``), the output slots (``O_*``), ``METRICS`` (the one table of the general metric slots) and
``OBJECTIVE_SLOTS``, the option codes the kernels branch on and the positions of an objective's helpers (``H_*``).
The kernels are in ``sequence_kernels.py``."""

from __future__ import annotations

import math

import triton.language as tl

from gspo_kernels.backends.triton.configs import AGGREGATION_CODES, LEVEL_CODES, ROLLOUT_CODES
from gspo_kernels.config import ROLLOUT_PROBABILITY_CLAMP

# Columns of the per-response partial sums (row i of a [S, PARTIALS_STRIDE] fp32 buffer), written by the
# sequence kernel and reduced by the reduction kernel. Kernel constants: the host reads their ``.value``.
PARTIALS_STRIDE = tl.constexpr(32)
P_LOSS = tl.constexpr(0)  # the aggregated loss sum
P_TOKENS = tl.constexpr(1)  # |y_i|
P_ENTROPY = tl.constexpr(2)  # sum of masked entropy
P_KL = tl.constexpr(3)  # sum of masked KL
P_LOW = tl.constexpr(4)  # low / high clip counts (an objective with one clip count: P_HIGH)
P_HIGH = tl.constexpr(5)
P_CLIP_UNITS = tl.constexpr(6)  # the items the clip counts count (tokens, or responses)
P_W_SUM = tl.constexpr(7)  # weight sum, min, max
P_W_MIN = tl.constexpr(8)
P_W_MAX = tl.constexpr(9)
P_UNITS = tl.constexpr(10)  # the number of counted items (tokens, or responses for sequence-level metrics)
P_AUX = tl.constexpr(11)  # the objective's extra metric (VESPO's phi): its sum over the items, and their number
P_AUX_UNITS = tl.constexpr(12)
P_R_DIFF = tl.constexpr(13)  # rollout mismatch: sum of (rollout - trainer) log-probs
P_R_ZERO = tl.constexpr(14)  # tokens whose rollout correction weight is 0
P_RW_SUM = tl.constexpr(15)  # rollout weight sum, min, max, items
P_RW_MIN = tl.constexpr(16)
P_RW_MAX = tl.constexpr(17)
P_RW_UNITS = tl.constexpr(18)
P_RF = tl.constexpr(19)  # the correction's units (tokens, or responses) whose statistic left [C_min, C_max]
P_RF_UNITS = tl.constexpr(20)
P_COUNT = tl.constexpr(P_RF_UNITS.value + 1)  # the columns written; the rest of the row is never read
# Columns the reduction takes the minimum / maximum of (the others are summed); kernel constants.
MIN_COLUMNS = tl.constexpr((P_W_MIN.value, P_RW_MIN.value))
MAX_COLUMNS = tl.constexpr((P_W_MAX.value, P_RW_MAX.value))

# Slots of the reduction kernel's output ``out [NUM_OUTPUTS]`` (on the host: ``out[O_LOSS.value]``); the metrics
# they report are named in ``METRICS`` below. Both numberings run 0, 1, ... without a gap (tests/repository/test_structure.py).
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
O_AUX_MEAN = tl.constexpr(11)  # the objective's extra metric
O_ROLLOUT_KL = tl.constexpr(12)
O_ROLLOUT_MASKED = tl.constexpr(13)
O_RW_MIN = tl.constexpr(14)
O_RW_MEAN = tl.constexpr(15)
O_RW_MAX = tl.constexpr(16)
O_ROLLOUT_FILTERED = tl.constexpr(17)
NUM_OUTPUTS = O_ROLLOUT_FILTERED.value + 1

# The metrics the output reports (TRL's names: those of ``objectives.stage.gspo_objective``), one row each: the name,
# its ``O_*`` slot, and when it is reported: for every objective ("objective"), or when the batch has rollout
# log-probs ("rollout"), an entropy ("entropy"), a KL term ("kl"). An objective's own metrics are its rows,
# declared by its module (``Objective.metrics``: name and slot name) and read from the objectives' registry by
# :func:`~gspo_kernels.backends.triton.sequence.metric_slots`; nothing else names a slot of a metric.
METRICS = (
    ("importance_weight/mean", O_W_MEAN, "objective"),
    ("importance_weight/min", O_W_MIN, "objective"),
    ("importance_weight/max", O_W_MAX, "objective"),
    ("rollout/kl", O_ROLLOUT_KL, "rollout"),
    ("rollout/masked_fraction", O_ROLLOUT_MASKED, "rollout"),
    ("rollout/weight_min", O_RW_MIN, "rollout"),
    ("rollout/weight_mean", O_RW_MEAN, "rollout"),
    ("rollout/weight_max", O_RW_MAX, "rollout"),
    ("rollout/is_filter_ratio", O_ROLLOUT_FILTERED, "rollout"),
    ("entropy", O_ENTROPY, "entropy"),
    ("kl", O_KL, "kl"),
)
# The slots an objective's metric may name (``Objective.metrics``): its clip counts and its extra metric.
OBJECTIVE_SLOTS = {"O_LOW": O_LOW, "O_HIGH": O_HIGH, "O_REGION": O_REGION, "O_AUX_MEAN": O_AUX_MEAN}

# The codes as kernel constants (the kernels branch on these names, never on literal numbers).
LEVEL_SEQUENCE = tl.constexpr(LEVEL_CODES["sequence"])
LEVEL_SEQUENCE_TOKEN = tl.constexpr(LEVEL_CODES["sequence_token"])
LEVEL_TOKEN = tl.constexpr(LEVEL_CODES["token"])
LOSS_BNPO = tl.constexpr(AGGREGATION_CODES["bnpo"])
LOSS_DR_GRPO = tl.constexpr(AGGREGATION_CODES["dr_grpo"])
LOSS_DAPO = tl.constexpr(AGGREGATION_CODES["dapo"])
RC_NONE = tl.constexpr(ROLLOUT_CODES[None])
RC_TOKEN_TRUNCATE = tl.constexpr(ROLLOUT_CODES["token_truncate"])
RC_TOKEN_MASK = tl.constexpr(ROLLOUT_CODES["token_mask"])
RC_SEQUENCE_TRUNCATE = tl.constexpr(ROLLOUT_CODES["sequence_truncate"])
RC_SEQUENCE_MASK = tl.constexpr(ROLLOUT_CODES["sequence_mask"])
RC_ICEPOP = tl.constexpr(ROLLOUT_CODES["icepop"])
RC_SEQUENCE_MASKED_TIS = tl.constexpr(ROLLOUT_CODES["sequence_masked_tis"])
RC_SEQUENCE_GEOMETRIC_MASK = tl.constexpr(ROLLOUT_CODES["sequence_geometric_mask"])
RC_TOKEN_BINARY_KL_MASK = tl.constexpr(ROLLOUT_CODES["token_binary_kl_mask"])
RC_SEQUENCE_BINARY_KL_MASK = tl.constexpr(ROLLOUT_CODES["sequence_binary_kl_mask"])
RC_TOKEN_TV_MASK = tl.constexpr(ROLLOUT_CODES["token_tv_mask"])
RC_SEQUENCE_TV_MASK = tl.constexpr(ROLLOUT_CODES["sequence_tv_mask"])
# The divergence gates' clamp of the sampled token's probabilities, as log-probs: [log eps, log(1 - eps)]
_LOG_P_LOW = tl.constexpr(math.log(ROLLOUT_PROBABILITY_CLAMP))
_LOG_P_HIGH = tl.constexpr(math.log1p(-ROLLOUT_PROBABILITY_CLAMP))
# The objective's Triton helpers (``HELPERS``, a kernel constant: a tuple of ``@triton.jit`` functions, its
# module's ``TRITON``), by position; their signatures are those of the defaults below.
H_SUMS = tl.constexpr(0)  # pass 1, per tile: two per-response sums of its own
H_RESPONSE = tl.constexpr(1)  # after pass 1: its per-response values, the response's weight and extra metric
H_TOKEN = tl.constexpr(2)  # pass 2, per tile: l_t, dl_t/dw, dl_t/dlogp_t not through w, its metric sums
H_FINISH = tl.constexpr(3)  # pass 3: a gradient through its per-response values
H_CLIP_COUNTS = tl.constexpr(4)  # the clip counts of the response's partials row
