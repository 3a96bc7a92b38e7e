"""The toy trainer's name in 0.1.0 (``gspo_kernels.train.trainer``, in that release's CHANGELOG): an alias of
:mod:`gspo_kernels.train.toy_trainer`, kept so the old imports work. New code imports ``toy_trainer``."""

import sys

from gspo_kernels.train import toy_trainer

sys.modules[__name__] = toy_trainer
