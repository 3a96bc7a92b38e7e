"""Parameters sharded by a training framework, handled where the hidden-state functions receive them.

:mod:`.zero3`: a DeepSpeed ZeRO-3 partitioned lm_head (weight and bias), gathered for as long as the kernels need
it, in the forward and again in the backward.
"""
